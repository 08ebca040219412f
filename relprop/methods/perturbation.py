"""Perturbation methods (survey §2.2–2.3): Value Zeroing and ViT-CX.

=================  ==================================================================================
method             definition
=================  ==================================================================================
``value_zeroing``  per block b: VZ_b[i, j] = cosine distance between the block's output for token i
                   and the same output with the value vectors of token j zeroed (all heads); rows
                   normalized to sum 1; C = VZ_{B-1} · … · VZ_0 (output side first, no identity);
                   scores = C[CLS, :] (Mohebbi et al., EACL 2023, §3, and the authors' code)
``vit_cx``         masks = the last block's patch-feature channels, min-max normalized and upsampled,
                   clustered (cosine distance, average linkage) and averaged per cluster; s_k = target
                   score of the image kept where mask k is and set to a baseline elsewhere;
                   map = Σ_k s_k M_k / Σ_k M_k (Xie et al. 2022, ViT-CX, §3)
=================  ==================================================================================

Both re-run parts of the cached captured graph (never a new export): value zeroing one block at a
time through ``trace.session.block_output_with_value_scaled``, ViT-CX the whole model on masked
images through ``Session.target_scores``.
"""
from __future__ import annotations

from typing import List, Optional, Union

import torch
import torch.nn.functional as F

from ..errors import MethodError, OptionError
from .aggregation import Aggregation, aggregate
from .gradients import Reruns
from .layout import grid_tokens
from .progress import progress_bar
from .method_registry import method


# ---------------------------------------------------------------- Value Zeroing

def cosine_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """1 − cos(a, b) over the last dimension, in float64; exactly 0 where a and b are identical
    (so a token whose zeroing changes nothing, e.g. padding, gets exactly 0). Computed as
    ½‖â − b̂‖² (â = a/‖a‖), which does not lose the small distances to cancellation."""
    a64, b64 = a.double(), b.double()
    na = a64 / a64.norm(dim=-1, keepdim=True).clamp_min(1e-300)
    nb = b64 / b64.norm(dim=-1, keepdim=True).clamp_min(1e-300)
    d = 0.5 * (na - nb).pow(2).sum(-1)
    return torch.where((a == b).all(-1), torch.zeros_like(d), d)


@method("value_zeroing",
        description="Value Zeroing: how much each block's output for token i changes when the values of "
                    "token j are zeroed (cosine distance), row-normalized and rolled out over the blocks",
        class_specific=False, signed=False,
        reference="Mohebbi et al., EACL 2023, 'Quantifying Context Mixing in Transformers', §3 (Value Zeroing)",
        needs_relevance=False, rollout=True, checks_only=True, head_fusions=("all",),
        no_windows="it zeroes one token's value vector across a block, which window attention holds per window")
def value_zeroing(trace, head_fusion: str = "all", positive: bool = False, discard_ratio: float = 0.0,
                  start_block: int = 0, end_block: Optional[int] = None, layers: str = "rollout", last_k: int = 1,
                  query: str = "cls", batch_size: int = 32):
    """Value Zeroing (Mohebbi et al., EACL 2023, §3).

    For every block b and token j, block b is re-evaluated on its original input with the value
    vectors v_j of token j set to zero in every head (the attention weights stay the same), and

        VZ_b[i, j] = cosine distance(x̃_i^{¬j}, x̃_i),

    x̃_i the block's output (after its feed-forward sublayer, residuals and norms) for token i and
    x̃_i^{¬j} the same with v_j zeroed. The diagonal is kept (zeroing a token's own value counts as
    the token mixing with itself), as in the authors' code (``scoring/value_zeroing.py``:
    ``score_matrix[l, :, t] = distances``, then each row divided by its sum). Each row of VZ_b is
    normalized to sum 1 (a row with no change at all stays 0). The blocks are then combined by
    rollout without the identity, since the residual connection is already inside the measured
    output (the authors' ``compute_joint_attention(..., res=False)``):

        C = VZ_{B-1} · … · VZ_1 · VZ_0     (blocks numbered from the input; output side first)

    ``tokens`` = C[CLS, :] (row 0; every token, special tokens included) and ``matrix`` = C.
    Class-agnostic (it never looks at the target). A padding token's values are multiplied by
    attention weights that are exactly 0, so zeroing them changes nothing and its column is exactly
    0 for the real tokens: padding never changes the real tokens' rows (those of the padding
    positions themselves are meaningless). Cost: one evaluation of one block per (block, token), on
    the whole explained batch (tokens that no query of any sample attends to are skipped). The
    evaluations of several tokens run as one batched re-run of the block: ``batch_size`` rows per
    re-run, i.e. max(1, batch_size // batch) zeroed tokens of every sample at a time
    (``torch.func.vmap`` over the zeroed token; the per-token loop where a block's ops cannot be
    batched that way). Each (token, sample) row is computed on its own, so results do not depend
    on ``batch_size`` or on the batch, up to float rounding.
    """
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise MethodError(f"value_zeroing: batch_size must be a positive int, not {batch_size!r}")
    blocks = trace.blocks
    if not blocks:
        raise MethodError("value_zeroing needs attention blocks, and none were found in the graph of this model. "
                          "Methods that apply without attention: lrp, input_x_gradient, smoothgrad, "
                          "integrated_gradients.")
    if any(b.value is None for b in blocks):
        raise MethodError("value_zeroing needs the value vectors V of every attention block (the right operand "
                          "of A @ V), which were not found in this model's graph. Use rollout or "
                          "transformer_attribution instead.")
    if head_fusion != "all":
        raise OptionError(f"value_zeroing: head_fusion={head_fusion!r} is not a choice. Choices: ['all'] (the "
                          "values of a token are zeroed in every head at once)")
    agg = Aggregation("mean", positive, discard_ratio, start_block, end_block, layers, last_k, False)
    return aggregate(trace, "value_zeroing", agg, None, add_identity=False, query=query,
                     block_maps=lambda chosen: _vz_maps(trace, chosen, batch_size), dtype=torch.float32)


def _vz_maps(trace, chosen, batch_size: int = 32) -> List[torch.Tensor]:
    """VZ_b of every chosen block: [batch, tokens, tokens] float64, rows normalized to sum 1."""
    session = trace.session
    env = session.base_env()
    maps = []
    n = chosen[0].attention.shape[-1]
    with progress_bar(len(chosen) * n, "value_zeroing") as bar:
        for blk in chosen:
            v = blk.value  # [batch, heads, tokens, head_dim]
            bsz, tokens = v.shape[0], v.shape[-2]
            ones = torch.ones((bsz, 1, tokens, 1), dtype=v.dtype, device=v.device)
            ref = session.block_output_with_value_scaled(env, blk.index, ones)  # [batch, tokens, hidden]
            dist = torch.zeros((bsz, tokens, tokens), dtype=torch.float64, device=ref.device)
            # a token no query attends to changes nothing when its values are zeroed: its distances are 0
            # (set after the loop, decided on the device: nothing is read on the host)
            unread = (blk.attention.sum(dim=(1, 2)) == 0).all(0)  # [tokens]
            step = max(1, batch_size // bsz)
            for start in range(0, tokens, step):
                js = list(range(start, min(tokens, start + step)))
                outs = _zeroed_outputs(session, env, blk.index, ones, js)  # [len(js), batch, tokens, hidden]
                dist[:, :, js] = cosine_distance(outs, ref.expand_as(outs)).permute(1, 2, 0)
                bar.update(len(js))
            dist = dist.masked_fill_(unread, 0.0)
            total = dist.sum(-1, keepdim=True)
            vz = torch.where(total > 0, dist / total.clamp_min(1e-300), torch.zeros_like(dist))
            maps.append(vz)
    return maps


def _zeroed_outputs(session, env, index: int, ones: torch.Tensor, js: List[int]) -> torch.Tensor:
    """Block ``index``'s output with the values of token j zeroed in every head, for each j of
    ``js``: [len(js), batch, tokens, hidden]. One batched re-run of the block (``torch.func.vmap``
    over j); one re-run per token where an op of the block has no batched form."""
    scales = ones.expand((len(js),) + tuple(ones.shape)).clone()
    for k, j in enumerate(js):
        scales[k, :, :, j, :] = 0
    if len(js) > 1:
        try:
            return torch.func.vmap(lambda s: session.block_output_with_value_scaled(env, index, s))(scales)
        except RuntimeError:  # an op without a batching rule: the same evaluation one token at a time
            pass
    return torch.stack([session.block_output_with_value_scaled(env, index, s) for s in scales])


# ---------------------------------------------------------------- ViT-CX

_TEXT_METHODS = "transformer_attribution, attcat, cat, rollout, value_zeroing, integrated_gradients"


def _interpolation_gram(gh: int, gw: int, size, device) -> torch.Tensor:
    """G = U Uᵀ, U [gh·gw, H·W] the bilinear upsampling (``align_corners=False``) of each grid cell's
    indicator, so that for grid maps f, g: ⟨up(f), up(g)⟩ = fᵀ G g. Cosine distances between
    upsampled maps are thus computed exactly without materializing them. Bilinear upsampling is
    separable, U = U_h ⊗ U_w, hence G = (U_h U_hᵀ) ⊗ (U_w U_wᵀ)."""
    def one_dim(n, out):
        eye = torch.eye(n, dtype=torch.float64, device=device)[:, None, :]
        u = F.interpolate(eye, size=int(out), mode="linear", align_corners=False)[:, 0]
        return u @ u.T
    return torch.kron(one_dim(gh, size[0]), one_dim(gw, size[1]))


def vitcx_masks(maps: torch.Tensor, gram: torch.Tensor, distance_threshold: float) -> torch.Tensor:
    """Masks of one sample on the patch grid, [K, gh·gw], from its feature maps [channels, gh·gw]:
    per-channel min-max to [0, 1] (constant channels dropped: they carry no spatial information),
    agglomerative clustering of the upsampled channel maps (cosine distance, average linkage,
    ``distance_threshold``, no fixed number of clusters), and the mean map of each cluster.
    Upsampling is linear, so the mean of upsampled maps is the upsampled mean."""
    import numpy as np  # optional dependencies of vit_cx (relprop[eval])
    from sklearn.cluster import AgglomerativeClustering

    maps = maps.double()
    lo, hi = maps.amin(1, keepdim=True), maps.amax(1, keepdim=True)
    keep = (hi - lo)[:, 0] > 0
    if not bool(keep.any()):
        return maps.new_zeros((0, maps.shape[1]))
    m = (maps[keep] - lo[keep]) / (hi - lo)[keep]
    if m.shape[0] == 1:
        return m
    inner = m @ gram @ m.T
    norm = inner.diagonal().clamp_min(1e-300).sqrt()
    dist = (1.0 - inner / (norm[:, None] * norm[None, :])).clamp_min(0.0)
    dist.fill_diagonal_(0.0)
    dist = 0.5 * (dist + dist.T)
    labels = AgglomerativeClustering(n_clusters=None, distance_threshold=distance_threshold,
                                     metric="precomputed", linkage="average").fit(dist.cpu().numpy()).labels_
    labels = torch.as_tensor(np.asarray(labels), device=m.device)
    return torch.stack([m[labels == k].mean(0) for k in range(int(labels.max()) + 1)])


@method("vit_cx",
        description="ViT-CX: last-block patch features clustered into masks; each mask scored by the target "
                    "score of the image kept under it; coverage-corrected sum of the scored masks",
        class_specific=True, signed=True,
        reference="Xie et al. 2022, 'ViT-CX: Causal Explanation of Vision Transformers', §3 (mask generation, "
                  "causal impact scoring with coverage-bias correction)",
        needs_relevance=False, checks_only=True,
        no_windows="it reads the token features entering the attention, which window attention cuts into windows")
def vit_cx(trace, distance_threshold: float = 0.1, baseline: Union[str, float] = "zero", batch_size: int = 32,
           relative: bool = True):
    """ViT-CX (Xie et al. 2022, §3). Images only.

    1. Features: the patch tokens of the features entering the attention of the block next to the
       output (``trace.blocks[-1].features``: LN1(h) in pre-norm ViTs, the layer the authors' code
       hooks, ``model.blocks[-1].norm1``; h itself if the model has no such node). The class and
       distillation tokens are dropped; each of the C channels is a map on the gh × gw patch grid.
    2. Masks, per sample: each channel map min-max normalized to [0, 1] and upsampled bilinearly
       (``align_corners=False``) to the image size; the maps are clustered by sklearn's
       ``AgglomerativeClustering(n_clusters=None, distance_threshold=..., linkage="average")`` on
       their cosine distances, and each cluster's maps are averaged into one mask M_k.
    3. Scores: s_k = target score of x ⊙ M_k + b ⊙ (1 − M_k), the image kept where the mask is 1
       and replaced by the baseline b where it is 0 (the authors fill the masked-out part with
       random noise; a deterministic baseline is used here so that results are reproducible).
    4. Saliency (coverage-bias correction): map = Σ_k (s_k − s_0) M_k / Σ_k M_k (0 where no mask
       covers a pixel), returned as ``"pixels"`` [batch, H, W]; the patch scores are its sums over
       each patch. s_0 is the target score of the baseline image (every mask 0), so 0 means "the
       images that keep this pixel score like the baseline image", positive above it, negative below.

    The paper's saliency is Σ_k s_k M_k / Σ_k M_k (``relative=False``): it differs from the default
    by s_0 on every covered pixel, so both rank pixels alike, but the paper's map sits wherever the
    logits sit (a trained model's map can lie entirely between, say, 4.7 and 6.3), which makes its
    sign meaningless and a map drawn around 0 uniformly red. Subtracting s_0 costs one more run per
    sample. Signed (a weighted mean of score differences). Each sample is clustered and scored on
    its own, so a batch explains like its samples one by one.

    Parameters
    ----------
    distance_threshold : cosine distance above which clusters are not merged (default 0.1, the
        authors' default). Smaller: more, finer masks, more re-runs of the model.
    baseline : ``"zero"`` (default: 0 pixels, which for normalized inputs is the dataset's mean
        colour) or ``"mean"`` (each image's own mean pixel, per colour channel), or a number.
    batch_size : masked images per re-run of the model; see :class:`relprop.methods.gradients.Reruns`.
    relative : subtract the baseline image's score s_0 (default True); False gives the paper's
        Σ_k s_k M_k / Σ_k M_k.
    """
    if trace.modality != "vision":
        raise MethodError(f"vit_cx explains vision models only (it masks pixels with feature maps laid out on a "
                          f"patch grid); this model's input is {trace.modality}. Methods for text: {_TEXT_METHODS}.")
    if trace.grid is None:
        raise MethodError("vit_cx needs the patch grid of a vision transformer (a patch-embedding convolution on "
                          "the pixels), and none was found in this model's graph. Methods that need no patch grid: "
                          "input_x_gradient, smoothgrad, integrated_gradients, lrp.")
    if not trace.blocks:
        raise MethodError("vit_cx needs the patch features of an attention block, and none were found in the graph; "
                          "use input_x_gradient, smoothgrad or integrated_gradients instead.")
    if not distance_threshold > 0:
        raise MethodError(f"vit_cx: distance_threshold must be > 0, not {distance_threshold!r}")
    last = trace.blocks[-1]
    feats = last.features if last.features is not None else last.hidden
    if feats is None:
        raise MethodError("vit_cx needs the token features of the block next to the output, which this trace lacks")
    x = trace.session.source_value.float()  # pixels [batch, C, H, W]
    bsz = x.shape[0]
    gh, gw = trace.grid
    feats = grid_tokens(trace, feats, "vit_cx")  # [batch, gh*gw, C], patch-grid order
    if isinstance(baseline, str):
        if baseline == "zero":
            base = torch.zeros_like(x)
        elif baseline == "mean":
            base = x.mean(dim=(2, 3), keepdim=True).expand_as(x)
        else:
            raise MethodError(f"vit_cx: baseline must be 'zero', 'mean' or a number, not {baseline!r}")
    else:
        base = torch.full_like(x, float(baseline))

    size = x.shape[-2:]
    gram = _interpolation_gram(gh, gw, size, feats.device)
    masks: List[torch.Tensor] = []  # per sample [K_i, H, W]
    for i in range(bsz):
        grid = vitcx_masks(feats[i].T, gram, distance_threshold)  # [K, gh*gw]
        up = F.interpolate(grid.float().reshape(-1, 1, gh, gw), size=tuple(size), mode="bilinear",
                           align_corners=False)[:, 0] if grid.shape[0] else x.new_zeros((0,) + tuple(size))
        masks.append(up.to(x))

    n_masks = [m.shape[0] for m in masks]
    if relative:  # one more, all-zero mask per sample: its image is the baseline, its score s_0
        masks = [torch.cat([m, m.new_zeros((1,) + tuple(size))]) if m.shape[0] else m for m in masks]
    counts = [m.shape[0] for m in masks]
    scores = [x.new_zeros(c) for c in counts]
    reruns = Reruns(trace, batch_size)
    with progress_bar(sum(counts), "vit_cx") as bar:
        for run in reruns.plan(counts):
            rows, copies, ok = run.rows_list, run.copies_list, run.valid_list
            keep = [k for k in range(len(rows)) if ok[k]]
            if not keep:
                continue
            mk = torch.stack([masks[rows[k]][copies[k]] if ok[k] else x.new_ones(size)
                              for k in range(len(rows))])[:, None]  # [rows, 1, H, W]
            r = run.rows.to(x.device)
            masked = x[r] * mk + base[r] * (1 - mk)
            s = reruns.session_for(run).target_scores(primary=masked)
            for k in keep:
                scores[rows[k]][copies[k]] = s[k]
            bar.update(len(keep))

    out = x.new_zeros((bsz,) + tuple(size))
    for i in range(bsz):
        k = n_masks[i]
        if k == 0:
            continue
        s_i = scores[i][:k] - scores[i][k] if relative else scores[i]
        cover = masks[i][:k].sum(0)
        weighted = (s_i[:, None, None] * masks[i][:k]).sum(0)
        out[i] = torch.where(cover > 0, weighted / cover.clamp_min(1e-12), torch.zeros_like(cover))
    return {"pixels": out}
