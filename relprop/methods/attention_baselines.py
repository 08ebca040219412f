"""The baselines of Chefer, Gur & Wolf (CVPR 2021, §4 and supplementary §A) and its Table-3
ablations, plus the gradient rollout of Chefer, Gur & Wolf (ICCV 2021).

Blocks are counted from the input (0-based), as everywhere in relprop; the paper counts them from
the output (its "block 1" is ``trace.blocks[-1]``). ``E_h`` is the mean over heads, ``(·)⁺`` the
positive part, and "the CLS row" is row 0 of a [tokens, tokens] map.

=======================  =========================================================================
method                   definition
=======================  =========================================================================
``ta_without_gradient``  C = Π_b (I + E_h(A_b ⊙ R_A,b)⁺), output side first; CLS row (Table 3, i)
``ta_last_block``        E_h(dA ⊙ R_A)⁺ of the block next to the output; CLS row (Table 3, ii)
``ta_second_block``      E_h(dA ⊙ R_A)⁺ of blocks[1]; CLS row (Table 3, iii)
``lrp``                  relevance at the input under the plain-LRP rules (supp. §A)
``partial_lrp``          E_h(R_A)⁺ of the block next to the output, plain-LRP rules; CLS row
``raw_attention``        E_h A of the block next to the output; CLS row
``rollout``              Π_b rownorm(I + E_h A_b), output side first; CLS row (Eq. 15–16)
``attention_gradcam``    (E_h w_h A_h)⁺ of the block next to the output, w_h = mean dA over the
                         CLS row's patch/token columns; CLS row (supp. §A "GradCAM")
``gradient_rollout``     R ← R + E_h(dA ⊙ A)⁺ · R from the input to the output; CLS row (ICCV 2021)
=======================  =========================================================================
"""
from __future__ import annotations

from typing import Optional

import torch

from ..errors import MethodError
from .aggregation import Aggregation, aggregate
from .method_registry import method
from .layout import patch_tokens, per_position
from .bimodal import check_normalize_self, is_two_stream, two_stream_result
from .query import query_rows, query_vector
from .identity import DEFAULT_IDENTITY, flat_cause, treat
from .rollout_utils import chain, head_mean, query_row, rollout_blocks, stage_transitions

#: methods that need no attention blocks (named when a model has none)
_WITHOUT_ATTENTION = "lrp, input_x_gradient, smoothgrad, integrated_gradients"


def _blocks(trace, name: str, needed: int = 1):
    """The trace's attention blocks; a MethodError naming what is missing if there are too few."""
    blocks = trace.blocks
    if not blocks:
        raise MethodError(f"{name} needs attention blocks, and none were found in the graph of this model. "
                          f"Methods that apply without attention: {_WITHOUT_ATTENTION}.")
    if len(blocks) < needed:
        raise MethodError(f"{name} needs at least {needed} attention blocks; this model has {len(blocks)}. "
                          "Use transformer_attribution or ta_last_block instead.")
    return blocks


def _relevance(block, name: str) -> torch.Tensor:
    if block.relevance is None:
        raise MethodError(f"{name} needs the relevance of the attention maps (R_A), which this trace lacks")
    return block.relevance


def _check_start(start_block: int, blocks, name: str) -> None:
    if not 0 <= start_block < len(blocks):
        raise MethodError(f"{name}: start_block={start_block} out of range: the model has blocks "
                          f"0..{len(blocks) - 1}")


def _only_defaults(name: str, **given) -> None:
    """A MethodError for an option the two-stream rules do not take (given as (value, default))."""
    for option, (value, default) in given.items():
        if value != default:
            raise MethodError(f"{name} on a model with two token streams follows the bi-modal rules of Chefer et al. "
                              f"(ICCV 2021), which have no {option}={value!r}; leave {option} at {default!r}")


def _with_query(trace, m: torch.Tensor) -> dict:
    """tokens = the query row of map ``m`` (:mod:`relprop.methods.query`), with the query's weights."""
    return {"tokens": query_rows(trace, m), "matrix": m,
            "query": query_vector(trace, m.shape[-2], m.device, m.dtype)}


def _single_block_map(trace, index: int, name: str) -> dict:
    block = _blocks(trace, name, needed=2 if index == 1 else 1)[index]
    m = head_mean((block.gradient * _relevance(block, name)).clamp(min=0))
    return _with_query(trace, m)


# ---------------------------------------------------------------- Table 3 ablations (CVPR 2021)

def _ta_without_gradient_maps(b):
    """Ablation (i)'s per-head maps A ⊙ R_A of a block record (the folded path folds the same maps)."""
    return b.attention * b.relevance


@method("ta_without_gradient",
        description="Transformer Attribution with the attention A in place of its gradient: "
                    "I + E_h(A ⊙ R_A)⁺ per block, rolled out over the blocks (ablation)",
        class_specific=True, signed=False, reference="Chefer et al., CVPR 2021, Table 3 (i), Eq. 13-14",
        needs_relevance=True, folds=_ta_without_gradient_maps, rollout=True)
def ta_without_gradient(trace, start_block: int = 0, normalize_rows: bool = False, query: str = "cls",
                        identity: str = DEFAULT_IDENTITY):
    """Ablation (i) of Table 3: Eq. 13 with A_b in place of ∇A_b,
    Ā_b = I + E_h[(A_b ⊙ R_A,b)⁺], rolled out as Eq. 14 (C = Ā_1 · … · Ā_B, paper numbering);
    scores = the classification token's row of C.

    Parameters
    ----------
    start_block : first block (counted from the input, 0-based) in the product; default 0 (every
        block), as ``transformer_attribution``.
    normalize_rows : divide each I + Ā_b by its row sums; default off, as ``transformer_attribution``.
    identity : the query rows' identity share, as ``transformer_attribution`` (:mod:`relprop.methods.identity`).
    """
    blocks = _blocks(trace, "ta_without_gradient")
    _check_start(start_block, blocks, "ta_without_gradient")
    maps = [head_mean((b.attention * _relevance(b, "ta_without_gradient")).clamp(min=0))
            for b in rollout_blocks(trace, "ta_without_gradient", start_block)]
    transitions = stage_transitions(trace, start_block)
    joint = chain(maps, normalize_rows=normalize_rows, transitions=transitions)
    row, w = query_row(trace, joint, query)
    row = treat(identity, row, w, joint, maps, normalize_rows, transitions, "ta_without_gradient")
    return {"tokens": row, "matrix": joint, "query": w, "flat_cause": flat_cause(identity, w)}


@method("ta_last_block",
        description="E_h(dA ⊙ R_A)⁺ of the block next to the output only, no rollout (ablation)",
        class_specific=True, signed=False, reference="Chefer et al., CVPR 2021, Table 3 (ii)",
        needs_relevance=True)
def ta_last_block(trace):
    """Ablation (ii) of Table 3, ∇A^(1) R^(n_1): E_h[(∇A ⊙ R_A)⁺] of the block next to the output
    (the paper's block 1), without rollout; scores = its classification-token row.

    No identity is added: this follows the authors' code (``last_layer`` with ``is_ablation``),
    which only differs from the paper's Eq. 13 at the classification token's own entry.
    """
    return _single_block_map(trace, -1, "ta_last_block")


@method("ta_second_block",
        description="E_h(dA ⊙ R_A)⁺ of the second block from the input only, no rollout (ablation)",
        class_specific=True, signed=False, reference="Chefer et al., CVPR 2021, Table 3 (iii)",
        needs_relevance=True)
def ta_second_block(trace):
    """Ablation (iii) of Table 3, ∇A^(B-1) R^(n_{B-1}): E_h[(∇A ⊙ R_A)⁺] of the block next-but-one
    to the input (``blocks[1]``; the paper's block B-1; the authors' ``second_layer``), without
    rollout and without an identity; scores = its classification-token row.
    """
    return _single_block_map(trace, 1, "ta_second_block")


# ---------------------------------------------------------------- LRP baselines (plain rules)

@method("lrp",
        description="LRP to the input, by default with AttnLRP's conservative rules (preset 'attnlrp'; "
                    "preset='lrp' for the CVPR 2021 paper's plain-LRP baseline): pixels summed over the colour "
                    "channels, or the token embeddings' relevance",
        class_specific=True, signed=True, reference="Achtibat et al., ICML 2024 (AttnLRP); Chefer et al., CVPR "
                                                    "2021, Eq. 4 and supplementary §A (preset 'lrp')",
        needs_relevance=True, preset="attnlrp", needs_blocks=False, streams=2)
def lrp(trace):
    """LRP to the input (Bach et al. 2015; CVPR 2021 Eq. 4), by default under the ``"attnlrp"`` preset:
    AttnLRP (Achtibat et al., ICML 2024), whose rules conserve relevance (the input relevance plus what
    biases absorb equals the explained score) and are computed with one modified-gradient backward pass
    where possible (:mod:`relprop.engine.fast_path`). It is the default because the paper's plain-LRP
    rules are not conservative on real checkpoints: on all-MiniLM-L6-v2 their ledger's relative error is
    in the thousands and the word scores sum to −1830 for a logit of 24 (``docs/methods.md``, "Which
    rules `lrp` uses").

    ``preset="lrp"`` is the CVPR 2021 paper's LRP baseline (supplementary §A, "LRP") as the authors'
    ``layers_lrp.py`` computes it (Transformer-Explainability, commit c3e578f): plain z-rule sums, and
    linear layers whose x⁺W⁺ and x⁻W⁻ parts each have their own denominator (each part passes all the
    relevance, so the rules are not conservative). On identical weights it equals the authors'
    ``generate_LRP(method="full")`` (ViT) and, at the encoder input (``exp.blocks[0].hidden_relevance``),
    their BERT ``generate_full_lrp``, to float64 rounding when both run in float64 with ``eps=0``
    (``benchmarks/authors_reference.py``, ``benchmarks/RESULTS.md`` §7). ``"cp_lrp"`` is CP-LRP (Ali et
    al., ICML 2022). Images: ``pixels`` = the input relevance summed over the colour channels; text:
    ``tokens`` = the token embeddings' relevance summed over the embedding size. Signed.
    """
    rel = trace.input_relevance
    if rel is None:
        raise MethodError("lrp needs the relevance at the input, and no input of this model received any "
                          "(no floating-point input or embedding lookup was found)")
    if is_two_stream(trace):
        rel = trace.stream_relevance
        streams = {k: (rel[k].sum(1) if rel[k].dim() == 4 else rel[k]) for k in trace.streams if k in rel}
        first = streams[trace.streams[0]]
        if first.dim() == 3 and trace.grid is not None:
            return {"pixels": first, "streams": streams}
        return {"tokens": first.sum(-1) if first.dim() == 3 else first, "streams": streams}
    if trace.modality == "vision" and rel.dim() == 4:
        pixels = rel.sum(1)
        if trace.grid is None:
            return {"tokens": pixels.flatten(1)}
        return {"pixels": pixels}
    if rel.dim() == 3:  # input embeddings [batch, positions, size], or channels-first features
        rel = per_position(trace, rel)
    return {"tokens": rel}


@method("partial_lrp",
        description="relevance of the attention map of the block next to the output under plain LRP, "
                    "positive part, averaged over heads",
        class_specific=True, signed=False, reference="Chefer et al., CVPR 2021, §4 and supplementary §A "
                                                     "(following Voita et al., 2019)",
        needs_relevance=True, preset="lrp")
def partial_lrp(trace):
    """Partial LRP (Voita et al. 2019, as the CVPR 2021 paper applies it, supplementary §A):
    E_h[(R_A)⁺] of the block next to the output (R^(n_1)), under the ``"lrp"`` preset (the
    authors' ``layers_lrp.py`` rules, commit c3e578f); scores = its classification-token row. The
    positive part follows the authors' code (``last_layer`` without ``is_ablation`` in
    ``ViT_orig_LRP.py``; ``generate_LRP_last_layer`` for BERT).
    """
    block = _blocks(trace, "partial_lrp")[-1]
    m = head_mean(_relevance(block, "partial_lrp").clamp(min=0))
    return _with_query(trace, m)


# ---------------------------------------------------------------- attention-only baselines

@method("raw_attention",
        description="attention of the block next to the output, averaged over heads (class-agnostic)",
        class_specific=False, signed=False, reference="Chefer et al., CVPR 2021, §4 (raw attention)",
        needs_relevance=False)
def raw_attention(trace, head_fusion: str = "mean", positive: bool = False, discard_ratio: float = 0.0,
                  start_block: int = 0, end_block: Optional[int] = None, layers: str = "last", last_k: int = 1,
                  normalize_rows: bool = False, query: str = "cls", identity: str = DEFAULT_IDENTITY):
    """Raw attention (CVPR 2021, §4; the survey's §1.1): E_h A of the block next to the output;
    scores = its classification-token row. Class-agnostic.

    The aggregation options of :mod:`relprop.methods.aggregation` (survey §1.4) apply to the
    per-head maps A_b,h; the defaults (``layers="last"``, ``last_k=1`` over every block: the block
    next to the output alone, E_h, no positive part, nothing discarded) are raw attention.
    ``layers="rollout"`` with ``normalize_rows=True`` is attention rollout (``identity``: as rollout's).
    """
    agg = Aggregation(head_fusion, positive, discard_ratio, start_block, end_block, layers, last_k, normalize_rows,
                      identity)
    return aggregate(trace, "raw_attention", agg, lambda b: b.attention, query=query)


def _rollout_maps(b):
    """Attention rollout's per-head maps A of a block record (the folded path folds the same maps)."""
    return b.attention


@method("rollout",
        description="attention rollout: I + E_h A per block, rows normalized, multiplied over the "
                    "blocks (class-agnostic)",
        class_specific=False, signed=False, reference="Abnar & Zuidema, 2020; Chefer et al., CVPR 2021, Eq. 15-16",
        needs_relevance=False, folds=_rollout_maps, rollout=True)
def rollout(trace, start_block: int = 0, normalize_rows: bool = True, query: str = "cls",
            end_block: Optional[int] = None, head_fusion: str = "mean", positive: bool = False,
            discard_ratio: float = 0.0, layers: str = "rollout", last_k: int = 1,
            identity: str = DEFAULT_IDENTITY):
    """Attention rollout (Abnar & Zuidema 2020; CVPR 2021 Eq. 15–16): Â_b = I + E_h A_b, each
    row divided by its sum, rollout = Â_1 · … · Â_B (paper numbering: output side first);
    scores = the classification token's row. Class-agnostic.

    Parameters
    ----------
    start_block : first block (counted from the input, 0-based; negative: from the output) in the
        product; default 0 (every block, Eq. 16).
    normalize_rows : divide each I + E_h A_b by its row sums (default on: Abnar & Zuidema, and the
        authors' code for both ViT and BERT — ``compute_rollout_attention`` in
        ``ViT_explanation_generator.py`` and in ``BERT_explainability/modules/BERT/ExplanationGenerator.py``;
        Transformer-Explainability, commit 7cf1edb).
    end_block, head_fusion, positive, discard_ratio, layers, last_k : the aggregation
        hyperparameters of :mod:`relprop.methods.aggregation` (survey §1.4); the defaults are
        Eq. 15–16 (``head_fusion="max"`` with ``discard_ratio=0.9`` is the common "max fusion").
    identity : what the scores keep of each query row's identity share: ``"exclude"`` (default;
        the same scores as Eq. 16 on a [CLS] model), ``"keep"``, ``"exclude_self"``
        (:mod:`relprop.methods.identity`).
    """
    agg = Aggregation(head_fusion, positive, discard_ratio, start_block, end_block, layers, last_k, normalize_rows,
                      identity)
    return aggregate(trace, "rollout", agg, _rollout_maps, query=query)



def _key_columns(trace, n: int, device) -> torch.Tensor:
    """[batch, n] bool: the columns whose gradient weights Grad-CAM's heads — the patch tokens for
    images (:func:`relprop.methods.layout.patch_tokens`), and every real (non-padding) position for
    text."""
    cols = patch_tokens(trace, n, device)
    if cols is not None:
        return cols
    mask = getattr(trace, "token_mask", None)
    if mask is None and trace.session is not None:
        mask = getattr(trace.session, "kwargs", {}).get("attention_mask")
    if torch.is_tensor(mask) and tuple(mask.shape) == (trace.batch_size, n):
        return mask.to(device) != 0
    return torch.ones(trace.batch_size, n, dtype=torch.bool, device=device)


@method("attention_gradcam",
        description="Grad-CAM on the attention map of the block next to the output: heads weighted by "
                    "the mean gradient of the classification token's row, positive part",
        class_specific=True, signed=False, reference="Chefer et al., CVPR 2021, §4 and supplementary §A "
                                                     "(Grad-CAM, Selvaraju et al. 2017)",
        needs_relevance=False)
def attention_gradcam(trace):
    """Grad-CAM on attention (CVPR 2021, supplementary §A, "GradCAM"): on the block next to the
    output, w_h = mean over the patch (image) or token (text) columns of ∇A_h's classification-token
    row; map = (E_h w_h A_h)⁺; scores = its classification-token row.

    For images the columns exclude the class/distillation tokens (the last gh*gw tokens are the
    patches), as the authors' ViT code. For text every real position is a column (padding is
    excluded so that a padded batch explains like each text alone). The authors' BERT code
    averages ∇A over every row and column; in the block next to the output of a [CLS]-pooled
    classifier only the [CLS] row of ∇A is non-zero, so that mean is the [CLS]-row mean times
    1/tokens, the same factor for every head, which the positive part and their min-max rescaling
    do not see: on a text alone the two agree (Pearson 1.000000, ``benchmarks/authors_reference.py``).
    Run on a padded text, their mean also takes in the padding columns, and their map moves away
    from their map of the text alone (Pearson 0.87–0.97 with relprop's in that benchmark). The
    authors' final min-max rescaling of each map is left out (it does not change the ranking).
    """
    block = _blocks(trace, "attention_gradcam")[-1]
    a, da = block.attention, block.gradient
    cols = _key_columns(trace, a.shape[-1], a.device).to(da.dtype)  # [B, N]
    w = (query_rows(trace, da) * cols[:, None, :]).sum(-1) / cols.sum(-1, keepdim=True).clamp_min(1)  # [B, H]
    m = head_mean(w[:, :, None, None] * a).clamp(min=0)
    return _with_query(trace, m)


def _gradient_rollout_maps(b):
    """The gradient rollout's per-head maps ∇A ⊙ A (ICCV 2021, Eq. 5; the folded path folds the same maps)."""
    return b.gradient * b.attention


@method("gradient_rollout",
        description="gradient-weighted attention rollout: R <- R + E_h(dA ⊙ A)⁺ R from the input to the "
                    "output block",
        class_specific=True, signed=False, reference="Chefer et al., ICCV 2021 (Generic attention-model "
                                                     "explainability), Eq. 5-6",
        needs_relevance=False, folds=_gradient_rollout_maps, streams=2, rollout=True)
def gradient_rollout(trace, query: str = "cls", head_fusion: str = "mean", positive: bool = True,
                     discard_ratio: float = 0.0, start_block: int = 0, end_block: Optional[int] = None,
                     layers: str = "rollout", last_k: int = 1, normalize_rows: bool = False,
                     normalize_self: bool = True, identity: str = DEFAULT_IDENTITY):
    """Chefer, Gur & Wolf, ICCV 2021 ("Generic Attention-model Explainability"), self-attention
    rules: R = I; for every block from the input to the output, Ā = E_h[(∇A ⊙ A)⁺] (Eq. 5) and
    R ← R + Ā · R (Eq. 6); scores = the classification token's row of R. Needs only gradients.

    ``query="mean"`` reads the mean of the real tokens' rows instead (mean-pooled models). The
    aggregation options of :mod:`relprop.methods.aggregation` (survey §1.3–1.4) apply to the
    per-head maps ∇A_b,h ⊙ A_b,h; the defaults are Eq. 5–6. ``identity`` (the query rows' share of
    R's initial I: ``"exclude"`` by default, the same scores as Eq. 6 on a [CLS] model; ``"keep"``;
    ``"exclude_self"``) is :mod:`relprop.methods.identity`.

    On a model with two token streams (encoder–decoder, co-attention) the ICCV 2021 rules for
    every pair of streams apply (Eq. 1–11, :mod:`relprop.methods.bimodal`): the result has one
    score row per stream (``exp.streams``); the aggregation options keep their defaults there.
    ``normalize_self=False`` (two streams only) leaves out the normalization of the self relevancy
    maps before a cross-attention update (Eq. 8–9), the paper's ablation.
    """
    check_normalize_self(trace, "gradient_rollout", normalize_self)
    if is_two_stream(trace):  # encoder-decoder, co-attention: the bi-modal rules (Eq. 6-11)
        _blocks(trace, "gradient_rollout")
        _only_defaults("gradient_rollout", query=(query, "cls"), head_fusion=(head_fusion, "mean"),
                       positive=(positive, True), discard_ratio=(discard_ratio, 0.0), start_block=(start_block, 0),
                       end_block=(end_block, None),
                       layers=(layers, "rollout"), last_k=(last_k, 1), normalize_rows=(normalize_rows, False),
                       identity=(identity, DEFAULT_IDENTITY))
        return two_stream_result(trace, "gradient", normalize_self)
    agg = Aggregation(head_fusion, positive, discard_ratio, start_block, end_block, layers, last_k, normalize_rows,
                      identity)
    return aggregate(trace, "gradient_rollout", agg, _gradient_rollout_maps, query=query)
