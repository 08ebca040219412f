"""Where the tokens entering each attention block come from: a cell of the patch grid, a position
of the text, or neither (a class, distillation or register token, a constant).

Scores come out of the methods per token of some block's input (the first block's for a rollout,
the last block's keys for a method that reads the block next to the output); a user reads them per
input patch or word. Most models put a few constant tokens first and the patches after them in
row-major order, but not all: ViTMAE shuffles the patch tokens (and may drop some), CaiT adds its
class token only before its class-attention blocks, other models gather tokens. Nothing here knows a
model. :func:`plan_tokens` finds, in the graph, the tensor where positions are defined — the patch
grid ``[batch, C, gh, gw]`` that a patch embedding produces, or the token sequence ``[batch, T, C]``
of a text source — and the ops that carry positions from it to each block's input;
:func:`token_positions` runs those ops, on each call, on a tensor that holds ``1 + position`` in
every channel (0 in every token made from constants). Shape and indexing ops (view, permute, gather
with the model's own indices, cat, ...) move the positions as they move the tokens; per-token ops
(adding a position embedding, LayerNorm, a linear layer over the channels, the residual sum of a
block) keep them — an attention branch added to the residual does not change which token a
row is. Where no chain of such ops reaches a block (a convolution over the tokens, an attention
output without a residual), that block's positions are unknown; for the first block the tokens are
then taken to be the constants first and the patch grid after them, row-major.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Dict, List, Optional, Set, Tuple

import torch
import torch.fx

from .host_reads import expect, speculating
from .nodes import ancestors, evaluate

aten = torch.ops.aten

#: ops that only move, copy or select elements: run on the positions as they are
MOVING = {
    aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.permute.default, aten.transpose.int,
    aten.t.default, aten.flatten.using_ints, aten.unflatten.int, aten.unsqueeze.default, aten.squeeze.dim,
    aten.squeeze.dims, aten.squeeze.default, aten.expand.default, aten.clone.default, aten.contiguous.default,
    aten.alias.default, aten.slice.Tensor, aten.select.int, aten.cat.default, aten.stack.default,
    aten.gather.default, aten.index_select.default, aten.index.Tensor, aten.roll.default, aten.repeat.default,
    aten.detach.default, aten.constant_pad_nd.default, aten.narrow.default, aten.split.Tensor,
    aten.split_with_sizes.default, aten.unbind.int, operator.getitem,
}
#: ops that act on each token alone: positions pass through (broadcast to the output's shape)
PER_TOKEN = {
    aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar, aten.mul.Tensor, aten.mul.Scalar,
    aten.div.Tensor, aten.div.Scalar, aten.where.self, aten.gelu.default, aten.silu.default, aten.relu.default,
    aten.tanh.default, aten.sigmoid.default, aten.dropout.default, aten.layer_norm.default, aten.rms_norm.default,
    aten.neg.default, aten.pow.Tensor_Scalar, aten.rsqrt.default, aten._to_copy.default, aten.linear.default,
    aten.masked_fill.Scalar, aten.masked_fill.Tensor, aten.hardswish.default, aten.erf.default,
}


@dataclasses.dataclass
class TokenPlan:
    """The ops that carry input positions from ``start`` to the blocks' inputs ``ends``."""

    start: torch.fx.Node  # the patch grid [batch, C, gh, gw] or a text sequence [batch, T, C]
    ends: Dict[int, torch.fx.Node]  # block index -> the block's input h (blocks positions reach)
    grid: Optional[Tuple[int, int]]  # (gh, gw) when ``start`` is a patch grid
    nodes: List[torch.fx.Node]  # carrying positions, graph order
    reads: Set[torch.fx.Node]  # other nodes whose values the trace reads (indices, constants)

    @property
    def end(self) -> Optional[torch.fx.Node]:
        """The first block's input (when positions reach it)."""
        return self.ends.get(0)


def _val(n):
    return n.meta.get("val") if isinstance(n, torch.fx.Node) else None


def _traceable(n) -> bool:
    if n.op != "call_function":
        return False
    if n.target is operator.getitem:  # an element of a list output: only of an op that moves elements
        return isinstance(n.args[0], torch.fx.Node) and _traceable(n.args[0])
    return n.target in MOVING or n.target in PER_TOKEN


def plan_tokens(graph, live, blocks, sources, modality: str) -> Optional[TokenPlan]:
    """The :class:`TokenPlan` of a graph with attention ``blocks`` (:class:`relprop.graph.attention_blocks.
    BlockInfo`), or None when the positions of the first block's tokens cannot be traced (see the
    module docstring). Positions are traced to the first block's input, and to the input of every
    block that does not map the first block's tokens to themselves (another number of tokens, or
    fewer queries than keys); the others share the first block's tokens."""
    hiddens = _ends_needed(blocks)
    if not hiddens or hiddens[0] is None:
        return None
    order = {n: i for i, n in enumerate(graph.nodes)}
    start = _start(live, hiddens[0], sources, modality, order)
    if start is None:
        return None
    # forward from the start through ops that carry positions; ends: the block inputs reached
    reach = {start}
    for n in graph.nodes:
        if n is not start and n in live and _traceable(n) and any(m in reach for m in n.all_input_nodes):
            reach.add(n)
    ends = {i: h for i, h in hiddens.items() if h is not None and h in reach}
    if 0 not in ends:
        return None
    needed = ancestors(set(ends.values()), reach)
    nodes = sorted((n for n in needed if n is not start), key=order.__getitem__)
    # only ops that move positions read other values (indices, constants): per-token ops read shapes
    reads = {m for n in nodes if n.target in MOVING for m in n.all_input_nodes if m not in needed}
    v = _val(start)
    grid = (int(v.shape[2]), int(v.shape[3])) if v.dim() == 4 else None
    return TokenPlan(start, ends, grid, nodes, reads)


def key_tokens(block) -> Optional[torch.fx.Node]:
    """The per-token tensor whose tokens are a block's keys: the features entering its attention
    module (LN1(h), or for a class-attention block the concatenation of the class token and the
    patches), else its input h, when that has as many tokens as the attention has keys."""
    for node in (block.features, block.hidden):
        v = _val(node) if node is not None else None
        if isinstance(v, torch.Tensor) and v.dim() == 3 and int(v.shape[1]) == block.keys:
            return node
    return None


def _ends_needed(blocks) -> Dict[int, Optional[torch.fx.Node]]:
    """Block index -> the tensor of its key tokens, for the first block and for every block whose
    keys are not the first block's tokens (another number of them, or fewer queries than keys)."""
    if not blocks:
        return {}
    out = {0: key_tokens(blocks[0])}
    for b in blocks[1:]:
        if b.keys != blocks[0].keys or not b.square or not blocks[0].square:
            out[b.index] = key_tokens(b)
    return out


def _start(live, end, sources, modality, order) -> Optional[torch.fx.Node]:
    """Walking back from the first block's input through ops that carry positions: the patch grid
    (vision) or the token sequence (text) where they stop — the earliest in the graph, when several
    paths stop (a convolution on a residual branch stops one path, the stem's grid another); None
    when another op stops them."""
    starts, seen, stack = [], set(), [end]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        v = _val(n)
        if n in sources or not _traceable(n):
            if isinstance(v, torch.Tensor) and v.dim() in (3, 4):
                starts.append(n)
                continue
            return None  # positions mixed before the first block
        stack.extend(m for m in n.all_input_nodes if m in live)
    grids = sorted((s for s in starts if _val(s).dim() == 4), key=order.__getitem__)
    sequences = sorted((s for s in starts if _val(s).dim() == 3), key=order.__getitem__)
    if modality == "vision" and grids:
        return grids[0]
    if modality != "vision" and sequences:
        return sequences[0]
    return None



def token_positions(plan: Optional[TokenPlan], env: Dict[torch.fx.Node, object], batch: int
                    ) -> Dict[int, torch.Tensor]:
    """Block index -> [batch, tokens of the block's input] long: the input position of each token
    (row-major patch index, or text position), -1 for tokens made from constants; blocks whose
    positions cannot be traced on these values are left out (empty without a plan)."""
    if plan is None:
        return {}
    start = env[plan.start]
    if plan.grid is not None:  # [B, C, gh, gw]: positions over the grid, the same in every channel
        gh, gw = plan.grid
        pos = torch.arange(1, gh * gw + 1, dtype=torch.float64, device=start.device).reshape(1, 1, gh, gw)
    else:  # [B, T, C]: positions along the sequence
        pos = torch.arange(1, start.shape[1] + 1, dtype=torch.float64, device=start.device).reshape(1, -1, 1)
    local = {plan.start: pos.expand(start.shape).contiguous()}
    try:
        for n in plan.nodes:
            local[n] = _step(n, local, env)
    except (RuntimeError, TypeError, ValueError, IndexError):
        return {}
    out = {}
    for index, end in plan.ends.items():
        t = local.get(end)
        if not torch.is_tensor(t) or t.dim() < 2 or t.shape[0] != batch:
            continue
        if t.dim() > 2:
            mixed = (t != t[..., :1]).any()  # a channel map mixed positions: not traced
            if speculating():  # (assumed not, verified with the call's other reads: relprop.graph.host_reads)
                expect(mixed, f"no channel map of block {index} mixes token positions")
            elif bool(mixed):
                continue
            t = t[..., 0]
        out[index] = t.reshape(batch, -1).round().long() - 1
    return out


def _step(n, local, env):
    """The positions of node ``n`` from those of its traced arguments."""
    if n.target in MOVING:
        def value(m):
            if m in local:
                return local[m]
            v = env[m]
            if torch.is_tensor(v) and v.is_floating_point() and _in_list_arg(n, m):
                return torch.zeros(v.shape, dtype=torch.float64, device=v.device)  # a constant token
            return v.to(torch.float64) if torch.is_tensor(v) and v.is_floating_point() else v
        return evaluate(n, value)
    traced = [local[m] for m in n.all_input_nodes if m in local]
    first = traced[0]
    for other in traced[1:]:
        if other.shape != first.shape or not torch.equal(other, first):
            raise ValueError("two different position maps meet")
    shape = tuple(int(s) for s in tuple(_val(n).shape)[1:])
    if first.shape[-1] != shape[-1] and n.target is aten.linear.default:
        first = first[..., :1]  # a channel map: positions kept, channels resized
    return first.expand((first.shape[0],) + shape).contiguous()


def _in_list_arg(n, m) -> bool:
    """Whether ``m`` enters ``n`` inside a list argument (the tensors ``cat``/``stack`` join)."""
    return any(isinstance(a, (list, tuple)) and m in a for a in n.args)
