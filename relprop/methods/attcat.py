"""Class-activation methods of the AttCAT paper and two attention/feature baselines of the survey.

From Qiang et al., "AttCAT: Explaining Transformers via Attentive Class Activation Tokens"
(NeurIPS 2022, §4 and Fig. 2), with its authors' code
(github.com/qiangyao1988/AttCAT, ``BERT_explainability/modules/BERT/ExplanationGenerator.py``):
``cat``, ``attcat``, and its baselines ``grads`` and ``attgrads`` (Grad-SAM, Barkan et al. 2021).
From the survey of transformer explainability methods that relprop follows ("the survey": §1 attention-based
methods, §2 methods for vision transformers): ``attention_norm`` (Kobayashi et al. 2020) and
``gradcam`` on token features.

Notation: blocks are counted from the input (0-based; the papers' "last layer" is
``trace.blocks[-1]``); h_b = the hidden states entering block b, ∇h_b = d y_t / d h_b;
A = attention probabilities [heads, tokens(query i), tokens(key j)], dA = d y_t / d A;
E_h = mean over heads; (·)⁺ = max(·, 0); "the CLS row" = row 0 (query = the class token).

===================  ==========================================================================
method               definition (per sample)
===================  ==========================================================================
``cat``              Σ_b Σ_c ∇h_b[i, c] · h_b[i, c]                                  (Eq. 10, 12)
``attcat``           Σ_b CAT_b[i] · ᾱ_b[i],  ᾱ_b[i] = E_h mean_q A_b[h, q, i]: the attention
                     token i receives, averaged over the queries q and the heads    (Eq. 11–12)
``grads``            E_h dA of the block next to the output; CLS row          (AttCAT Fig. 2)
``attgrads``         M = E_b E_h A_b ⊙ (dA_b)⁺; token i: Σ_j M[i, j]   (Grad-SAM; AttCAT Fig. 2)
``attention_norm``   N[i, j] = ‖Σ_h A[h, i, j] · W_O^h v^h_j‖, block next to the output; CLS row
                     (Kobayashi et al. 2020)
``gradcam``          (Σ_c w_c F[i, c])⁺, w_c = mean of dF[:, c] over the patch (image) or
                     non-padding (text) tokens, F = features of the block next to the output
===================  ==========================================================================

Signs: ``cat``, ``attcat`` and ``grads`` are signed (AttCAT's "directionality": a negative score is
a token that speaks against the target); the others are ≥ 0.

Padding: where a definition averages over tokens, tokens that no query can attend to (the padding
of a text batch: every head gives them exactly zero attention) are left out of the average, so a
padded batch explains exactly like each text alone.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..errors import MethodError, OptionError
from .aggregation import HEAD_FUSIONS, Aggregation, aggregate, fuse_heads
from .norm_flows import norm_map
from .method_registry import method
from .layout import patch_tokens
from .query import query_rows, query_vector
from .identity import DEFAULT_IDENTITY
from .rollout_utils import head_mean

#: methods that need no attention blocks (named when a model has none)
_WITHOUT_ATTENTION = "lrp, input_x_gradient, smoothgrad, integrated_gradients"


def _blocks(trace, name: str, *fields: str):
    """The trace's blocks, each with the record ``fields`` set; else a MethodError saying what is missing."""
    blocks = trace.blocks
    if not blocks:
        raise MethodError(f"{name} needs attention blocks, and none were found in the graph of this model. "
                          f"Methods that apply without attention: {_WITHOUT_ATTENTION}.")
    for b in blocks:
        for f in fields:
            if getattr(b, f) is None:
                raise MethodError(f"{name} needs the {_FIELD_WORDS.get(f, f)} of every attention block, and none "
                                  f"was recognized for block {b.index} ('{b.name}') of this model. Methods that "
                                  "apply with the attention maps alone: raw_attention, rollout, grads, attgrads, "
                                  "attention_gradcam, gradient_rollout, transformer_attribution.")
    return blocks


_FIELD_WORDS = {
    "hidden": "hidden states entering the block (h)",
    "hidden_gradient": "gradient of the hidden states entering the block (∇h)",
    "value": "attention values V",
    "out_proj_weight": "attention output projection W_O",
    "features": "token features entering the attention (LN1(h) or h)",
    "features_gradient": "gradient of the token features entering the attention",
}


def _pick(blocks, block, name: str, layer=None):
    """The block record ``block`` (an index, negative from the output), or the one whose layer or attention
    module is ``layer`` (a module path such as ``"blocks.10"``, ``"blocks.10.norm1"`` or ``"bert.encoder.layer.11"``,
    as pytorch-grad-cam's ``target_layers`` names a layer)."""
    if layer is not None:
        if not isinstance(layer, str):
            raise MethodError(f"{name}: layer must be a module path such as 'blocks.10', not {type(layer).__name__}")
        for b in blocks:
            if layer in (b.layer, b.name) or layer.startswith(b.layer + "."):
                return b
        raise MethodError(f"{name}: layer={layer!r} is no attention block of the model; its blocks' layers are "
                          f"{[b.layer for b in blocks]} (give one of these module paths, or block=INDEX)")
    if not isinstance(block, int) or isinstance(block, bool):
        raise MethodError(f"{name}: block must be an int (a block index), not {block!r}; pass layer='module.path' "
                          "to name a block by its module")
    if not -len(blocks) <= block < len(blocks):
        raise MethodError(f"{name}: block={block} out of range: the model has blocks 0..{len(blocks) - 1} "
                          "(negative values count from the output, -1 = the block next to the output)")
    return blocks[block]


def attended_tokens(attention: torch.Tensor) -> torch.Tensor:
    """[batch, tokens] bool: the tokens some query of some head attends to with a non-zero weight.

    Padding is masked with a large negative number before the softmax, so its attention is exactly
    zero in every head and row; a real token always gets a positive weight somewhere.
    """
    return attention.amax(dim=(1, 2)) > 0


def _check_choice(name: str, option: str, value, choices) -> None:
    if value not in choices:
        raise MethodError(f"{name}: {option}={value!r} is not one of {list(choices)}")


# ------------------------------------------------------------------------------------------- AttCAT

def _cat_per_block(blocks):
    """CAT_b[i] = Σ_c ∇h_b[i, c] · h_b[i, c] for every block: a list of [batch, tokens]."""
    return [(b.hidden_gradient * b.hidden).sum(-1) for b in blocks]


@method("cat",
        description="class activation tokens: gradient x hidden states entering each block, summed over the "
                    "hidden size and over the blocks (signed)",
        class_specific=True, signed=True, reference="Qiang et al., AttCAT (NeurIPS 2022), Eq. 10 and 12",
        needs_relevance=False,
        no_windows="it sums gradient x hidden states over blocks whose stages have different numbers of tokens")
def cat(trace):
    """Class Activation Tokens, the AttCAT paper's in-house baseline (Eq. 10, summed as Eq. 12):

        CAT[i] = Σ_b Σ_c ∇h_b[i, c] · h_b[i, c],   ∇h_b = d y_t / d h_b,

    with h_b the hidden states entering block b (the authors' code uses
    ``output_hidden_states[b]`` for b = 0..L-1: the embedding output and the inputs of the later
    blocks). Eq. 10 is a Hadamard product; the sum over the hidden size that turns it into one score
    per token is the authors' code. No ReLU: the sign says whether a token speaks for (> 0) or
    against (< 0) the target. The authors min-max scale each explanation for display; relprop
    returns the raw scores.
    """
    blocks = _blocks(trace, "cat", "hidden", "hidden_gradient")
    return {"tokens": torch.stack(_cat_per_block(blocks)).sum(0)}


@method("attcat",
        description="attentive class activation tokens: per block, gradient x hidden states times the attention "
                    "each token receives (averaged over queries and heads), summed over the blocks (signed)",
        class_specific=True, signed=True, reference="Qiang et al., AttCAT (NeurIPS 2022), Eq. 11-12",
        needs_relevance=False,
        no_windows="it sums gradient x hidden states over blocks whose stages have different numbers of tokens")
def attcat(trace, attention: str = "received"):
    """Attentive Class Activation Tokens (Eq. 11–12)::

        AttCAT_b[i] = E_h(α_b[h, i] · CAT_b[i]) = CAT_b[i] · E_h α_b[h, i]      (Eq. 11)
        AttCAT[i]   = Σ_b AttCAT_b[i]                                           (Eq. 12)

    with CAT_b[i] = Σ_c ∇h_b[i, c] · h_b[i, c] (Eq. 10, summed over the hidden size) and
    h_b the hidden states entering block b. Signed (the paper's "directionality").

    Eq. 11 calls α_i "the attention weights of the i-th token" without saying which (α is a
    matrix). The default follows the authors' code, which produced the paper's tables: the attention
    token i *receives*, averaged over the heads and over the query rows,
    α_b[h, i] = mean_q A_b[h, q, i] (``att.mean(0).mean(0)`` on A[heads, query, key]).

    Parameters
    ----------
    attention : ``"received"`` (default, the authors' code): mean over the query rows of the
        column of token i; rows of tokens nobody attends to (padding) are left out of the mean, so
        a padded batch gives each text's own scores (the authors explained one unpadded text at a
        time, where this is their formula exactly). ``"cls"``: the attention the class token pays
        to token i, A_b[h, 0, i].
    """
    _check_choice("attcat", "attention", attention, ("received", "cls"))
    blocks = _blocks(trace, "attcat", "hidden", "hidden_gradient")
    total = None
    for b, cat_b in zip(blocks, _cat_per_block(blocks)):
        a = head_mean(b.attention)  # [batch, query, key]
        if attention == "cls":
            alpha = query_rows(trace, a)
        else:
            rows = attended_tokens(b.attention).to(a.dtype)  # padding rows left out
            alpha = (a * rows[:, :, None]).sum(1) / rows.sum(1, keepdim=True).clamp_min(1)
        term = cat_b * alpha
        total = term if total is None else total + term
    return {"tokens": total}


@method("grads",
        description="gradient of the attention map of the block next to the output, averaged over heads; "
                    "class token's row (signed)",
        class_specific=True, signed=True, reference="Qiang et al., AttCAT (NeurIPS 2022), Fig. 2 'Grads'",
        needs_relevance=False)
def grads(trace, block: int = -1, layer: Optional[str] = None):
    """The "Grads" baseline of the AttCAT paper (Fig. 2: E_H(∇α^L)): the gradient of the target
    score with respect to the attention probabilities of the block next to the output, averaged over
    the heads; token scores = the class token's row, E_h dA[h, 0, j] (the row the attention baselines
    of the authors' code read; in a model that classifies from the class token it is the only
    non-zero row of the last block). Signed, as the paper reports it.

    Parameters
    ----------
    block : which block (counted from the input; default -1, the block next to the output).
    layer : the block by its module path (``"blocks.10"``), as pytorch-grad-cam's ``target_layers``.

    Returns ``matrix`` = E_h dA of that block.
    """
    b = _pick(_blocks(trace, "grads"), block, "grads", layer)
    m = head_mean(b.gradient)
    return {"tokens": query_rows(trace, m), "matrix": m, "query": query_vector(trace, m.shape[-2], m.device)}


@method("attgrads",
        description="Grad-SAM: attention times the positive part of its gradient, averaged over heads and blocks; "
                    "each token's row summed",
        class_specific=True, signed=False,
        reference="Barkan et al., Grad-SAM (CIKM 2021); AttCAT (NeurIPS 2022) Fig. 2 'AttGrads'",
        needs_relevance=False,
        no_windows="it averages attention maps over blocks whose stages have different numbers of tokens")
def attgrads(trace, token_scores: str = "rows"):
    """AttGrads / Grad-SAM (Barkan et al. 2021)::

        M = 1/(B·H) Σ_b Σ_h A_b[h] ⊙ (dA_b[h])⁺        (averaged over heads and blocks)

    Token scores (``token_scores``):

    ``"rows"`` (default, Grad-SAM): token i scores its own row, s_i = Σ_j M[i, j] — how much the
        update of token i draws, with a positive gradient, on the tokens it attends to. Grad-SAM
        also divides by the number of tokens n, s_i = 1/(L·H·n) Σ_l Σ_h Σ_j H_lh[i, j] (this
        reading of its row reduction is taken from public implementations of Grad-SAM, including
        the one next to the AttCAT authors' code in ContrastCAT). The 1/n is left out here: with padding n
        would be the padded length,
        and a padded batch would no longer explain like each text alone.
    ``"cls"``: the class token's row of M, M[0, j], like the attention baselines.

    Unsigned (≥ 0). Returns ``matrix`` = M.
    """
    _check_choice("attgrads", "token_scores", token_scores, ("rows", "cls"))
    blocks = _blocks(trace, "attgrads")
    m = torch.stack([head_mean(b.attention * b.gradient.clamp(min=0)) for b in blocks]).mean(0)
    scores = m.sum(-1) if token_scores == "rows" else query_rows(trace, m)
    return {"tokens": scores, "matrix": m}


# ------------------------------------------------------------------------------------------ survey

@method("attention_norm",
        description="norm of the attention-weighted transformed value vectors ||Σ_h α_ij f_h(x_j)|| of the block "
                    "next to the output; class token's row (class-agnostic)",
        class_specific=False, signed=False,
        reference="Kobayashi et al., 'Attention is not only a weight' (EMNLP 2020): "
                  "||Σ_h α_ij f_h(x_j)||; survey §1.5",
        needs_relevance=False, head_fusions=("combined",) + HEAD_FUSIONS,
        no_windows="it needs the value vectors of every token, which window attention computes per window")
def attention_norm(trace, block: int = -1, head_fusion: str = "combined", positive: bool = False,
                   discard_ratio: float = 0.0, start_block: int = 0, end_block: Optional[int] = None,
                   layers: str = "last", last_k: int = 1, normalize_rows: bool = True, query: str = "cls",
                   layer: Optional[str] = None, identity: str = DEFAULT_IDENTITY):
    """Norm-based attention analysis (Kobayashi et al. 2020, Eq. 5–6; the survey's §1.5)::

        N[i, j] = ‖ Σ_h A[h, i, j] · f^h(x_j) ‖₂,   f^h(x_j) = W_O^h v^h_j

    where v^h_j is token j's value vector in head h (value bias included) and W_O^h the columns
    h·d:(h+1)·d of the attention output projection (the output bias is not part of the transformed
    vector: it does not depend on j). Token scores = the class token's row N[0, j]; ``matrix`` = N.
    Class-agnostic (no gradient), ≥ 0.

    Aggregated over heads and blocks as the survey's §1.5 says ("we can aggregate over heads and
    layers as we did in 1.3"), with the options of :mod:`relprop.methods.aggregation`:
    ``head_fusion="combined"`` (default) is the norm of the sum over the heads above; ``"mean"``,
    ``"max"``, ``"min"``, ``"gradient"`` fuse the per-head norms N^h[i, j] = ‖A[h, i, j] f^h(x_j)‖.
    With ``layers="rollout"`` each block's N is first divided by its row sums (a row-stochastic map
    like A) and then rolled out as attention rollout (Eq. 16: rows of I + N̂_b normalized with
    ``normalize_rows``, the default).

    Parameters
    ----------
    block : which block (counted from the input; default -1, the block next to the output): the
        last block of the range (same as ``end_block=block + 1``).
    layer : that block by its module path (``"blocks.10"``), as pytorch-grad-cam's ``target_layers``.
    identity : with ``layers="rollout"``, what the scores keep of each query row's identity share,
        as rollout's (:mod:`relprop.methods.identity`).
    """
    blocks = _blocks(trace, "attention_norm")
    if block != -1 or layer is not None:
        if end_block is not None:
            raise OptionError("attention_norm: give block=/layer= or end_block=, not both (block=b is end_block=b+1)")
        end_block = _pick(blocks, block, "attention_norm", layer).index + 1
    agg = Aggregation("mean" if head_fusion == "combined" else head_fusion, positive, discard_ratio, start_block,
                      end_block, layers, last_k, normalize_rows, identity)

    def block_maps(chosen):
        maps = []
        for b in chosen:
            m = norm_map(b) if head_fusion == "combined" else fuse_heads(norm_map(b, per_head=True), b.gradient, agg)
            if layers == "rollout":
                total = m.sum(-1, keepdim=True)
                m = torch.where(total > 0, m / total.clamp_min(1e-30), torch.zeros_like(m))
            maps.append(m)
        return maps
    return aggregate(trace, "attention_norm", agg, None, query=query, block_maps=block_maps,
                     heads_of=lambda b: norm_map(b, per_head=True))


@method("gradcam",
        description="Grad-CAM on the token features entering the attention of the block next to the output: "
                    "channel weights = mean gradient over the tokens, ReLU of the weighted sum per token",
        class_specific=True, signed=False,
        reference="Selvaraju et al., Grad-CAM (ICCV 2017), Eq. 1-2, on ViT tokens as in the survey §2.2",
        needs_relevance=False,
        no_windows="it reads the token features entering the attention, which window attention cuts into windows")
def gradcam(trace, block: int = -1, layer: Optional[str] = None):
    """Grad-CAM (Selvaraju et al. 2017, Eq. 1–2) on token features, as the survey's §2.2 applies it to
    ViTs (pytorch-grad-cam with ``target_layers = [model.blocks[-1].norm1]``)::

        w_c = mean_{i ∈ T} dF[i, c]          (global average pooling of the gradient, Eq. 1)
        cam_i = ( Σ_c w_c F[i, c] )⁺         (Eq. 2)

    F = the token features entering the attention of the block (its first LayerNorm's output in
    pre-norm models, the block input in post-norm ones such as BERT), dF = d y_t / d F. T = the
    patch tokens (the last gh·gw) for images — the class/distillation tokens are not part of the
    spatial map, they get a cam value of their own that the packaging drops — and every non-padding
    token for text (padding: tokens no query attends to). The patch tokens fold back onto the patch
    grid. Unsigned (≥ 0).

    Parameters
    ----------
    block : which block (counted from the input; default -1, the block next to the output: its
        output tokens other than the class token do not reach the classifier, so the features
        *entering* it are the last ones with a useful gradient).
    layer : the block by its module path (``"blocks.10"``, the layer or its attention module), as
        pytorch-grad-cam's ``target_layers`` names the layer; overrides ``block``.
    """
    blocks = _blocks(trace, "gradcam", "features", "features_gradient")
    b = _pick(blocks, block, "gradcam", layer)
    feats, grad = b.features, b.features_gradient  # [B, N, C]
    n = feats.shape[1]
    patches = patch_tokens(trace, n, feats.device)
    pool = patches.to(feats.dtype) if patches is not None else attended_tokens(b.attention).to(feats.dtype)
    weights = (grad * pool[:, :, None]).sum(1) / pool.sum(1, keepdim=True).clamp_min(1)  # [B, C]
    cam = torch.einsum("bnc,bc->bn", feats, weights).clamp(min=0)
    return {"tokens": cam}
