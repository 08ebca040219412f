"""Window attention (Swin): each window's attention mapped onto the global token positions of its
stage, and the patch merging that links one stage to the next.

Swin (Liu et al., ICCV 2021) attends within non-overlapping windows of M×M tokens: the token grid
of a stage is (padded,) cyclically shifted every other block, cut into windows and folded into the
batch, so the attention of a block is a ``[batch·windows, heads, M², M²]`` tensor. Between stages,
patch merging concatenates the channels of each 2×2 group of tokens and projects them, so the
next stage has a quarter of the tokens.

Nothing here knows Swin's code. Both facts are read off the captured graph:

* **window map** — the q/k/v of the block are linear maps of a tensor ``end`` (``[batch·windows,
  M², C]``) that the graph computes from a per-token tensor ``start`` (``[batch, *grid, C]`` or
  ``[batch, tokens, C]``, the block's normalized hidden states) by shape-only ops alone (view,
  permute, pad, the two ``index_select`` of a cyclic shift, ...). Running those ops on a tensor
  that holds ``1 + the global token index`` (0 where padding is created) tells, for each window row,
  which global token it is. The attention A, its gradient dA and its relevance R_A are then scattered
  onto ``[batch, heads, tokens, tokens]``: entry (i, j) is the weight token i gives token j inside
  their shared window, and 0 for tokens in different windows (they do not attend to each other).
  Window rows of padding are dropped. Each real token is in exactly one window of a block.
* **stage link** — between two consecutive blocks with different token counts, the shape-only ops
  that follow the first block's output (view, strided slices, cat: Swin's patch merging) produce a
  tensor whose token j holds, in its channels, copies of the tokens of the previous stage it
  merges. The same index trick gives the children of each merged token; the link is the
  ``[tokens_next, tokens_prev]`` matrix D with D[j, i] = 1/|children(j)| for each child i (rows sum
  to 1: a merged token depends on its children equally).

With these, the rollout methods multiply the block maps of a stage and step to the next stage with
D (:func:`relprop.methods.rollout_utils.chain`), and the pooled output of a model without a class
token is the mean of the rows of the last stage (:func:`relprop.methods.query.query_rows`).
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Dict, List, Optional

import torch
import torch.fx

from .axis_provenance import kinds
from ..errors import RelpropError
from .nodes import evaluate

aten = torch.ops.aten

#: ops that only move elements, through which token indices are traced
SHAPE_OPS = {
    aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.permute.default,
    aten.transpose.int, aten.clone.default, aten.contiguous.default, aten.alias.default,
    aten.index_select.default, aten.constant_pad_nd.default, aten.roll.default, aten.slice.Tensor,
    aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.flatten.using_ints,
    aten.unflatten.int, aten.cat.default, aten.as_strided.default, aten._to_copy.default,
}
#: ops between the value projection and V (head split of a fused qkv)
_HEAD_SPLIT = SHAPE_OPS | {aten.select.int, aten.unbind.int, aten.split.Tensor, aten.split_with_sizes.default,
                           aten.chunk.default, operator.getitem, aten.expand.default, aten.mul.Scalar}
#: per-token ops between a merged tensor and the next stage's hidden states
_PER_TOKEN = {aten.layer_norm.default, aten.linear.default, aten.rms_norm.default}


@dataclasses.dataclass
class WindowMap:
    """How the window rows of one block's attention sit in the token grid of its stage."""

    start: torch.fx.Node  # per-token tensor of the stage [batch, *grid, C] or [batch, tokens, C]
    end: torch.fx.Node  # window tokens [batch·windows, M², C] entering the q/k/v projections
    nodes: List[torch.fx.Node]  # shape-only ops from start to end, in graph order


@dataclasses.dataclass
class StageLink:
    """The shape-only ops from one block's output to the merged tokens of the next stage."""

    source: torch.fx.Node  # output of the last block of a stage
    merged: torch.fx.Node  # [batch, *grid', C'] : token j holds copies of its children
    nodes: List[torch.fx.Node]


def find_window_maps(blocks, live, axes: Optional[dict] = None) -> Dict[int, WindowMap]:
    """Block index → WindowMap for every block whose attention is computed on windows (a
    non-empty chain of shape-only ops between its per-token input and its q/k/v that folds positions
    into the batch axis; ``axes``: :mod:`relprop.graph.axis_provenance`, which tells a window partition
    from a channels-first feature map flattened into one sequence)."""
    maps = {}
    for b in blocks:
        if b.value is None:
            continue
        proj = _walk_back(b.value, _HEAD_SPLIT, live)
        if proj is None or proj.op != "call_function" or proj.target not in (aten.linear.default, aten.addmm.default):
            continue
        end = proj.args[0] if proj.target is aten.linear.default else proj.args[1]
        if not isinstance(end, torch.fx.Node) or end.op != "call_function" or end.target not in SHAPE_OPS:
            continue
        start = _walk_back(end, SHAPE_OPS, live)
        if start is None or start is end or not _windowed(start, end, b.attention, axes):
            continue
        nodes = _between(start, end, live)
        if nodes:
            maps[b.index] = WindowMap(start, end, nodes)
    return maps


def _windowed(start, end, attention, axes: Optional[dict] = None) -> bool:
    """The tokens entering q/k/v are cut from a per-token tensor differently than one sequence per
    sample: ``end`` is [groups, tokens, C] with as many tokens as the attention has keys, and its first
    axis folds positions into the batch (windows, grids); where the axes' provenance is known it decides
    (a channels-first map flattened and transposed, DETR's encoder input, is one sequence per sample), else
    ``end`` is not ``start`` reshaped as it is."""
    sv, ev, av = (n.meta.get("val") for n in (start, end, attention))
    if not all(isinstance(v, torch.Tensor) for v in (sv, ev, av)) or sv.dim() < 3 or ev.dim() != 3:
        return False
    if ev.shape[1] != av.shape[-1]:
        return False
    groups = kinds(axes.get(end), 0) if axes else set()
    if groups and "?" not in groups and "batch" in groups:
        return bool(groups - {"batch"})
    return ev.shape[0] != sv.shape[0] or tuple(ev.shape) != (sv.shape[0], _prod(sv.shape[1:-1]), sv.shape[-1])


def _prod(shape):
    out = 1
    for s in shape:
        out = out * s
    return out


def find_stage_links(blocks, live) -> Dict[int, StageLink]:
    """Block index b → StageLink from block b's output to the merged tokens that feed block b+1,
    where the shape-only ops after block b's output reach a tensor that per-token ops (LayerNorm,
    linear) turn into block b+1's input."""
    links = {}
    for b, nxt in zip(blocks, blocks[1:]):
        if b.output is None or nxt.hidden is None or b.output is nxt.hidden:
            continue
        closure = _closure(b.output, live)
        node, hops = nxt.hidden, 0
        while node not in closure and isinstance(node, torch.fx.Node) and node.op == "call_function" \
                and node.target in _PER_TOKEN and hops < 8:
            node, hops = node.args[0], hops + 1
        if node in closure and node is not b.output:
            links[b.index] = StageLink(b.output, node, _between(b.output, node, live))
    return links


def _walk_back(node, ops, live, limit=24):
    """Follow the single live input of ``ops`` nodes back; the first node that is not one of them."""
    for _ in range(limit):
        if not isinstance(node, torch.fx.Node) or node.op != "call_function" or node.target not in ops:
            return node
        ins = [m for m in node.all_input_nodes if m in live]
        if len(ins) != 1:
            return node if len(ins) == 0 else None
        node = ins[0]
    return None


def _closure(source, live) -> set:
    """``source`` and every node reachable from it through shape-only ops."""
    seen, stack = {source}, [source]
    while stack:
        n = stack.pop()
        for u in n.users:
            if u not in seen and u in live and u.op == "call_function" and u.target in SHAPE_OPS:
                seen.add(u)
                stack.append(u)
    return seen


def _between(start, end, live) -> List[torch.fx.Node]:
    """The shape-only nodes on paths from ``start`` to ``end`` (``end`` included), graph order."""
    down = _closure(start, live)
    up, stack = {end}, [end]
    while stack:
        n = stack.pop()
        for m in n.all_input_nodes:
            if m in down and m not in up and m is not start:
                up.add(m)
                stack.append(m)
    nodes = [n for n in down & up if n is not start]
    order = {n: i for i, n in enumerate(end.graph.nodes)}
    return sorted(nodes, key=order.__getitem__)


def _trace_indices(start, nodes, env) -> dict:
    """Run ``nodes`` on ``1 + token index`` of ``start`` (float64; padding created on the way is 0)."""
    v = env[start]
    grid = v.shape[1:-1]
    tokens = 1
    for s in grid:
        tokens *= int(s)
    idx = torch.arange(1, tokens + 1, dtype=torch.float64, device=v.device).reshape((1,) + tuple(grid) + (1,))
    local = {start: idx.expand(v.shape).contiguous()}
    for n in nodes:
        local[n] = evaluate(n, lambda m: local[m] if m in local else env[m],
                            _copy_in_float64 if n.target is aten._to_copy.default else None)
    return local, tokens


def _copy_in_float64(x, *args, **kwargs):
    """``_to_copy`` that keeps the float64 of the traced indices (any other conversion is kept)."""
    return aten._to_copy.default(x, *args, **{k: v for k, v in kwargs.items() if k != "dtype"})


def window_positions(wm: WindowMap, env, batch: int):
    """([batch·windows, M²] long global token index, 0-based, -1 for padding; tokens of the stage)."""
    local, tokens = _trace_indices(wm.start, wm.nodes, env)
    out = local[wm.end]
    if out.dim() < 3 or out.shape[0] % batch:
        raise RelpropError(f"window tokens of shape {tuple(out.shape)} do not fold the batch of {batch} "
                           "into their first dimension; relprop cannot map this attention onto the token grid")
    pos = out.reshape(out.shape[0], -1, out.shape[-1])[..., 0].round().long() - 1
    return pos, tokens


def to_global(t: torch.Tensor, pos: torch.Tensor, batch: int, tokens: int) -> torch.Tensor:
    """Scatter window maps ``t`` [batch·windows, heads, M², M²] onto [batch, heads, tokens, tokens]
    (``pos`` from :func:`window_positions`; rows and columns of padding are dropped)."""
    bw, heads, m, _ = t.shape
    nw = bw // batch
    p = pos.reshape(batch, nw, m)
    valid = p >= 0
    pc = p.clamp_min(0)
    flat = pc[..., :, None] * tokens + pc[..., None, :]  # [batch, windows, M², M²]
    both = valid[..., :, None] & valid[..., None, :]
    src = (t.reshape(batch, nw, heads, m, m) * both[:, :, None].to(t.dtype)).permute(0, 2, 1, 3, 4)
    index = flat[:, None].expand(batch, heads, nw, m, m)
    out = t.new_zeros(batch, heads, tokens * tokens)
    out.scatter_add_(2, index.reshape(batch, heads, -1), src.reshape(batch, heads, -1))
    return out.reshape(batch, heads, tokens, tokens)


def merge_matrix(link: StageLink, env) -> torch.Tensor:
    """D [tokens_next, tokens_prev]: D[j, i] = 1/|children(j)| for every token i merged into j."""
    local, tokens = _trace_indices(link.source, link.nodes, env)
    merged = local[link.merged]
    merged = merged[0].reshape(-1, merged.shape[-1]).round().long() - 1  # sample 0: all samples alike
    n_next = merged.shape[0]
    d = torch.zeros(n_next, tokens, dtype=torch.float32, device=merged.device)
    rows = torch.arange(n_next, device=merged.device)[:, None].expand_as(merged)
    ok = merged >= 0
    d[rows[ok], merged[ok]] = 1.0
    return d / d.sum(1, keepdim=True).clamp_min(1)


@dataclasses.dataclass
class Stages:
    """Token counts per block and the links between stages of a windowed (hierarchical) model.

    ``tokens[b]`` is the number of tokens of block b's stage; ``links[b]`` is the merge matrix D
    [tokens[b+1], tokens[b]] where block b+1 starts a new stage.
    """

    tokens: List[int]
    links: Dict[int, torch.Tensor]

    def transitions(self, start: int = 0, stop: Optional[int] = None) -> List[Optional[torch.Tensor]]:
        """For blocks start..stop-1: the matrix taking block b's tokens to block b+1's (None within
        a stage), one per consecutive pair."""
        stop = len(self.tokens) if stop is None else stop
        return [self.links.get(b) for b in range(start, stop - 1)]

    def lift(self, scores: torch.Tensor) -> torch.Tensor:
        """Scores on the tokens of some stage ([..., tokens_s]) → scores on the first stage's tokens
        (the patch grid): each merged token's score is shared equally by its children (s · D)."""
        first = self.tokens[0]
        for b in sorted(self.links, reverse=True):
            if scores.shape[-1] == first:
                break
            d = self.links[b]
            if scores.shape[-1] == d.shape[0]:
                scores = scores @ d.to(scores.dtype)
        if scores.shape[-1] != first:
            raise RelpropError(f"scores over {scores.shape[-1]} tokens match no stage of this model "
                               f"(stages have {sorted(set(self.tokens), reverse=True)} tokens)")
        return scores


@dataclasses.dataclass
class WindowLayout:
    """What :func:`locate_windows` read off one forward pass: block index → (window positions,
    tokens of the stage), and block index b → merge matrix D after block b."""

    positions: Dict[int, tuple]
    merges: Dict[int, torch.Tensor]


def locate_windows(analysis, env, batch: int) -> Optional[WindowLayout]:
    """Window positions of every windowed block and the merge matrices between stages, from the
    forward values ``env`` (None for a model without window attention)."""
    if not analysis.windows:
        return None
    positions = {i: window_positions(wm, env, batch) for i, wm in analysis.windows.items()}
    merges = {b: merge_matrix(link, env) for b, link in analysis.stage_links.items()}
    return WindowLayout(positions, merges)


def globalize(layout: Optional[WindowLayout], records, batch: int):
    """Replace the window-shaped A, dA and R_A of ``records`` (BlockRecords) by their global
    [batch, heads, tokens, tokens] maps; return (records, Stages or None)."""
    if layout is None:
        return records, None
    out = []
    tokens = []
    for rec in records:
        if rec.index not in layout.positions:
            tokens.append(rec.attention.shape[-1])
            out.append(rec)
            continue
        pos, n = layout.positions[rec.index]
        counts = torch.zeros(batch, n, dtype=torch.long, device=pos.device)
        real = pos.reshape(batch, -1)
        counts.scatter_add_(1, real.clamp_min(0), (real >= 0).long())
        if not bool((counts == 1).all()):
            raise RelpropError(f"the windows of block {rec.index} ('{rec.name}') do not cover each token of its "
                               "stage exactly once; relprop maps only non-overlapping window attention")
        tokens.append(n)
        def g(t, pos=pos, n=n):
            return to_global(t, pos, batch, n) if t is not None else None

        out.append(dataclasses.replace(rec, attention=g(rec.attention), gradient=g(rec.gradient),
                                       relevance=g(rec.relevance), value=None, features=None,
                                       features_gradient=None))
    links = {}
    for b in range(len(records) - 1):
        if tokens[b] == tokens[b + 1]:
            continue
        d = layout.merges.get(b)
        if d is None:
            raise RelpropError(f"block {b + 1} has {tokens[b + 1]} tokens and block {b} has {tokens[b]}, and no "
                               "shape-only merging of tokens was found between them")
        if tuple(d.shape) != (tokens[b + 1], tokens[b]):
            raise RelpropError(f"the token merging after block {b} gives {tuple(d.shape)}, expected "
                               f"({tokens[b + 1]}, {tokens[b]})")
        links[b] = d.to(records[b].attention.device)
    return out, Stages(tokens, links)
