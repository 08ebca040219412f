"""Aggregation of per-head, per-block token maps as hyperparameters (the survey of transformer
explainability methods, §1.2–1.4; Abnar & Zuidema 2020; Chefer et al., CVPR 2021, Eq. 13–16).

Every rollout-style method builds, for each attention block b and head h, a token-to-token map
M_b,h (A for raw attention and rollout, ∇A ⊙ R_A for Transformer Attribution, ∇A ⊙ A for the
gradient rollout, the norms ‖α f(x)‖ for attention norms, the value-zeroing distances) and then
makes three choices, each an option here, each with the method's paper as default:

``head_fusion``
    ``"mean"`` E_h M_b,h (the survey's Eq. for rollout, §1.2), ``"max"`` max_h, ``"min"`` min_h,
    ``"gradient"`` E_h (∇A_b,h ⊙ M_b,h) (the survey's gradient-weighted heads, §1.3).
``positive``
    (·)⁺ of each head's map (after the gradient weighting) before the fusion (§1.3: "the positive
    contribution is considered").
``discard_ratio``
    after the fusion, the lowest ``floor(ratio · N²)`` entries of each block's fused [N, N] map are
    set to 0, except the query tokens' own entries M[q, q] (as attention-rollout tools commonly
    offer; ties broken by position).
``start_block`` / ``end_block``
    the blocks ``start_block ≤ b < end_block`` (counted from the input, 0-based; negative values
    count from the output, ``end_block=None`` = through the last block).
``layers``
    ``"rollout"`` the product C = (I + M_{e-1}) · … · (I + M_s) (Eq. 14 / 16; each factor divided
    by its row sums with ``normalize_rows``); ``"sum"`` C = Σ_b M_b; ``"last"`` C = the mean of
    the maps of the last ``last_k`` blocks of the range (``last_k=1``: the block's own map, raw
    attention).

Which options are valid is checked once, before any work, by :func:`relprop.api.options.check_aggregation`
from the tuples here.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, List, Optional

import torch

from ..errors import MethodError, OptionError
from .identity import flat_cause, treat
from .query import query_rows, weighted_rows
from .rollout_utils import chain, query_row, rollout_blocks, stage_transitions

#: head fusions every rollout-style method takes (attention norms and value zeroing add their own default)
HEAD_FUSIONS = ("mean", "max", "min", "gradient")
#: layer aggregations
LAYER_AGGREGATIONS = ("rollout", "sum", "last")
#: the names of the aggregation options
AGGREGATION_OPTIONS = ("head_fusion", "positive", "discard_ratio", "start_block", "end_block", "layers", "last_k")


@dataclasses.dataclass(frozen=True)
class Aggregation:
    """One setting of the aggregation options (see the module docstring)."""

    head_fusion: str = "mean"
    positive: bool = False
    discard_ratio: float = 0.0
    start_block: int = 0
    end_block: Optional[int] = None
    layers: str = "rollout"
    last_k: int = 1
    normalize_rows: bool = False
    #: what the rollout's scores keep of the query rows' identity share (:mod:`relprop.methods.identity`)
    identity: str = "keep"


def block_range(n: int, start_block: int, end_block: Optional[int], name: str) -> range:
    """The block indices ``start_block ≤ b < end_block`` of a model with ``n`` blocks (negative
    values count from the output); a MethodError naming the valid range when it is empty."""
    s = start_block + n if start_block < 0 else start_block
    e = n if end_block is None else (end_block + n if end_block < 0 else end_block)
    if not 0 <= s < n:
        raise MethodError(f"{name}: start_block={start_block} out of range: the model has blocks 0..{n - 1} "
                          f"(negative values count from the output)")
    if not s < e <= n:
        raise MethodError(f"{name}: end_block={end_block} out of range: it must be past start_block={start_block} "
                          f"and at most {n} (the model has blocks 0..{n - 1}; negative values count from the output)")
    return range(s, e)


def used_blocks(n: int, agg: Aggregation, name: str) -> range:
    """The blocks whose maps the aggregation reads: the range, or its last ``last_k`` blocks."""
    r = block_range(n, agg.start_block, agg.end_block, name)
    if agg.layers == "last":
        if agg.last_k > len(r):
            raise MethodError(f"{name}: last_k={agg.last_k} is more than the {len(r)} blocks of the range "
                              f"{r.start}..{r.stop - 1}")
        return r[len(r) - agg.last_k:]
    return r


def fuse_heads(maps: torch.Tensor, gradient: Optional[torch.Tensor], agg: Aggregation) -> torch.Tensor:
    """One block's fused map [batch, N, N] from its per-head maps [batch, heads, N, N] (a map
    without a head axis, [batch, N, N], is taken as already fused)."""
    if agg.head_fusion == "gradient":
        if gradient is None:
            raise MethodError("head_fusion='gradient' needs the gradient of the attention maps, which this trace lacks")
        maps = gradient * maps
    if agg.positive:
        maps = maps.clamp(min=0)
    if maps.dim() == 3:
        return maps
    if agg.head_fusion in ("mean", "gradient"):
        return maps.mean(1)
    if agg.head_fusion == "max":
        return maps.amax(1)
    if agg.head_fusion == "min":
        return maps.amin(1)
    raise OptionError(f"head_fusion={agg.head_fusion!r} is not a choice. Choices: {list(HEAD_FUSIONS)}")


def discard_lowest(m: torch.Tensor, ratio: float, query: torch.Tensor) -> torch.Tensor:
    """``m`` [batch, N, N] with its lowest ``floor(ratio · N²)`` entries per sample set to 0, the
    entries M[q, q] of the query tokens (``query`` [batch, N] > 0) kept."""
    if ratio <= 0:
        return m
    b, n = m.shape[0], m.shape[-1]
    if query.shape != (b, n):
        raise MethodError(f"discard_ratio needs the query on the block's {n} tokens, and the query has "
                          f"{tuple(query.shape)[1:]} (models whose token count changes between blocks); "
                          "use discard_ratio=0")
    keep = torch.zeros(b, n, n, dtype=torch.bool, device=m.device)
    idx = torch.arange(n, device=m.device)
    keep[:, idx, idx] = query.to(m.device) > 0
    keep = keep.reshape(b, n * n)
    k = min(int(ratio * n * n), n * n - int(keep.sum(1).max()))
    if k <= 0:
        return m
    flat = m.reshape(b, n * n)
    order = torch.argsort(flat.masked_fill(keep, float("inf")), dim=-1, stable=True)[:, :k]
    return flat.scatter(1, order, 0.0).reshape(m.shape)


def combine(maps: List[torch.Tensor], agg: Aggregation, add_identity: bool = True,
            transitions=None) -> torch.Tensor:
    """The layer aggregation of the fused maps (input → output order): rollout (with I added to each
    block's map unless ``add_identity`` is False), sum or last-k mean."""
    if agg.layers == "rollout":
        if add_identity:
            return chain(maps, normalize_rows=agg.normalize_rows, transitions=transitions)
        joint = None
        for m in maps:
            if agg.normalize_rows:
                total = m.sum(-1, keepdim=True)
                m = torch.where(total > 0, m / total.clamp_min(1e-300), torch.zeros_like(m))
            joint = m if joint is None else m @ joint
        return joint
    if len(maps) == 1:
        return maps[0]
    if len({tuple(m.shape) for m in maps}) != 1:
        raise MethodError(f"layers={agg.layers!r} adds the maps of several blocks, and their token counts differ "
                          "(hierarchical model); use layers='rollout' or a range within one stage")
    total = torch.stack(maps).sum(0)
    return total if agg.layers == "sum" else total / len(maps)


def aggregate(trace, name: str, agg: Aggregation, head_maps: Callable, add_identity: bool = True,
              query: str = "cls", block_maps: Optional[Callable] = None, dtype=None,
              heads_of: Optional[Callable] = None) -> dict:
    """Run the aggregation ``agg`` of method ``name`` on ``trace``: ``head_maps(block)`` gives a
    block's per-head maps [batch, heads, N, N] (or ``block_maps(blocks)`` the fused maps of several
    blocks at once; the matrix is cast to ``dtype`` when given); returns the method's output
    (``tokens``, ``matrix``, ``query``, and ``heads``: the query row of each head's map at the last
    block of the range, [batch, heads, N], from ``heads_of(block)`` or ``head_maps(block)`` after
    the gradient weighting and the positive part; the survey's ref. [4], DINO's per-head maps).
    A rollout that adds I to each block's map (``add_identity``) reads its scores as
    ``agg.identity`` says (:func:`relprop.methods.identity.treat`)."""
    blocks = trace.blocks
    if not blocks:
        raise MethodError(f"{name} needs attention blocks, and none were found in the graph of this model. "
                          "Methods that apply without attention: lrp, input_x_gradient, smoothgrad, "
                          "integrated_gradients.")
    r = used_blocks(len(blocks), agg, name)
    chosen = [blocks[i] for i in r]
    if len(chosen) > 1 or agg.layers == "rollout":
        chosen = rollout_blocks(trace, name, r.start, r.stop)
    if block_maps is not None:
        fused = block_maps(chosen)
    else:
        fused = [fuse_heads(head_maps(b), b.gradient, agg) for b in chosen]
    if agg.discard_ratio > 0:
        if getattr(trace, "stages", None) is not None:
            raise MethodError("discard_ratio needs one token sequence, and this model's attention works on windows "
                              "(its token count changes between stages); use discard_ratio=0")
        _, w = query_row(trace, fused[-1], query)
        fused = [discard_lowest(m, agg.discard_ratio, w) for m in fused]
    transitions = stage_transitions(trace, r.start) if agg.layers == "rollout" else None
    joint = combine(fused, agg, add_identity=add_identity, transitions=transitions)
    if dtype is not None:
        joint = joint.to(dtype)
    row, w = query_row(trace, joint, query)
    out = {"query": w, "heads": _head_rows(trace, chosen[-1], agg, heads_of or head_maps, query)}
    if agg.layers == "rollout" and add_identity:
        row = treat(agg.identity, row, w, joint, fused, agg.normalize_rows, transitions, name)
        out["flat_cause"] = flat_cause(agg.identity, w)
    return {"tokens": row, "matrix": joint, **out}


def _head_rows(trace, block, agg: Aggregation, heads_of: Optional[Callable], query: str) -> Optional[torch.Tensor]:
    """[batch, heads, N]: the query row of each head's map of ``block`` (None without per-head maps
    or for window attention)."""
    if heads_of is None or getattr(trace, "stages", None) is not None:
        return None
    maps = per_head_maps(block, heads_of(block), agg)
    if maps is None:
        return None
    if query == "cls":
        return query_rows(trace, maps)
    _, w = query_row(trace, maps.mean(1), query)
    return weighted_rows(w, maps)


def per_head_maps(block, maps: torch.Tensor, agg: Aggregation) -> Optional[torch.Tensor]:
    """Each head's map of ``block`` as the per-head query rows (``exp.heads``) read it: ∇A ⊙ map
    with ``head_fusion="gradient"``, its positive part with ``positive=True``; None when ``maps``
    is not [batch, heads, N, N]."""
    if maps.dim() != 4 or maps.shape[-1] != maps.shape[-2]:
        return None
    if agg.head_fusion == "gradient":
        maps = block.gradient * maps
    if agg.positive:
        maps = maps.clamp(min=0)
    return maps
