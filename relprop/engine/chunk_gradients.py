"""One chunk of an attention core recomputed once for both passes: the gradients of the segment's
backward pass and the values and ∂y/∂A that the relevance walk of the chunk reads.

The row-chunked walk (:mod:`relprop.engine.chunked_walk`) recomputes each chunk of query rows of a
core for its rules (the values, A and dA = ∂y/∂A); the segment's backward pass
(:mod:`relprop.engine.chunked_core`) recomputed each chunk once more for ∇Q, ∇Kᵀ, ∇V. When the
relevance at the core's output is known before the segment's gradients are propagated through the
core (:mod:`relprop.engine.fused_segment`), :class:`ChunkGradients` serves the walk as its source of
chunks: each chunk is evaluated once with autograd, the gradient at its output (dO, the rows of the
core's output gradient) is taken back to the operands and to A in one call, and the walk gets the
values and dA of that same evaluation. CVPR 2021 Eq. 1–3 and the rules are unchanged; only the
number of times each chunk is computed is.

Where a chunk's rows of dO are all zero (a decoder explained at its last position: in the block next
to the output, every row but the last), the chunk's gradients are zero: it is evaluated without
autograd and its dA is zero.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.fx

from ..graph.attention_core import PRODUCTS, AttentionCore, add_on_first_keys, evaluate_rows, first_keys
from ..graph.host_reads import deferring


class ChunkGradients:
    """The chunks of ``core`` evaluated once each, with autograd, for the walk and the backward pass.

    ``operands``: the whole value of each operand from outside the core (``core.rows`` and
    ``core.whole``), ``needs``: the operands whose gradient the segment's backward pass wants, ``dout``:
    the gradient at the core's output, ``attention``: the core node whose gradient the walk reads (the
    block's attention map A). Called as the walk's source of chunks (``source(lo, hi, keys)`` →
    (values, dA), as :func:`relprop.engine.chunked_walk.chunk_values` gives them); :meth:`rest`
    computes the gradients of the chunks the walk did not ask for, :meth:`gradients` gives the
    operands' gradients once every chunk was computed."""

    def __init__(self, core: AttentionCore, attention: torch.fx.Node, operands: Dict[torch.fx.Node, torch.Tensor],
                 needs: Dict[torch.fx.Node, bool], dout: torch.Tensor, compute: Optional[torch.dtype] = None,
                 out: Optional[torch.Tensor] = None):
        self.core, self.attention, self.dout, self.compute = core, attention, dout, compute
        self.whole_values = operands
        self.wanted = [n for n in operands if needs.get(n) and operands[n].is_floating_point()]
        self.split = set(core.rows)
        self.row_parts: Dict[torch.fx.Node, Dict[int, torch.Tensor]] = {n: {} for n in self.wanted if n in self.split}
        self.whole: Dict[torch.fx.Node, torch.Tensor] = {}
        self.done: set = set()
        self.out = out if _product_by_hand(core, attention, operands, out, dout, compute) else None

    def __call__(self, lo: int, hi: int, keys: tuple, counting: bool = False):
        """(the core's values on rows ``lo:hi``, detached; dA on those rows): the chunk evaluated on its
        first keys (``keys`` = (kept, all)) and its gradients taken, once. ``counting`` (a counting pass
        of the walk, which reads no dA): the values only, from an evaluation without autograd."""
        if counting or lo in self.done:
            return self._values(lo, hi, keys), None
        d = self.dout[..., lo:hi, :]
        self.done.add(lo)
        if not self.wanted or not deferring() and not bool(d.any()):  # (read on the host: not within a one-read call)
            vals = self._values(lo, hi, keys)
            for n in self.row_parts:
                self.row_parts[n][lo] = torch.zeros_like(self.whole_values[n][..., lo:hi, :])
            return vals, torch.zeros_like(vals[self.attention])
        if self.out is not None:
            return self._by_hand(lo, hi, keys, d)
        with torch.enable_grad():
            leaves = {n: self._leaf(n, lo, hi) for n in self.whole_values}
            vals = evaluate_rows(self.core, leaves.__getitem__, lo, hi, self.compute, sliced=True, keys=keys)
            out, a = vals[self.core.nodes[-1]], vals[self.attention]
            gs = torch.autograd.grad(out, [leaves[n] for n in self.wanted] + [a], d.to(out.dtype), allow_unused=True)
        for n, g in zip(self.wanted, gs[:-1]):
            self._add(n, lo, g if g is not None else torch.zeros_like(leaves[n]))
        da = gs[-1] if gs[-1] is not None else torch.zeros_like(a)
        return {n: v.detach() if torch.is_tensor(v) else v for n, v in vals.items()}, da

    def _by_hand(self, lo: int, hi: int, keys: tuple, d: torch.Tensor):
        """The chunk with the product's backward written out: the core evaluated with autograd up
        to A, dA = dO·Vᵀ and ∇V = Aᵀ·dO (on the chunk's first keys), autograd from A on; A·V on
        the chunk's rows is the core's output (``out``), not computed again."""
        core, product = self.core, self.core.nodes[-1]
        vnode = product.args[1]
        kept, every = keys
        with torch.enable_grad():
            # (whole operands as leaves on their first keys: their gradients are added into those keys)
            leaves = {n: self._leaf(n, lo, hi, keys) for n in self.whole_values}
            vals = evaluate_rows(core, leaves.__getitem__, lo, hi, self.compute, sliced=True, keys=keys,
                                 product=False)
            a = vals[self.attention]
            v = first_keys(core, vnode, self.whole_values[vnode], every, kept)
            da = d @ v.transpose(-1, -2)
            rest = [n for n in self.wanted if n is not vnode]
            gs = torch.autograd.grad(a, [leaves[n] for n in rest], da, allow_unused=True) if rest else ()
        for n, g in zip(rest, gs):
            self._add(n, lo, g if g is not None else torch.zeros_like(leaves[n]))
        if vnode in self.wanted:
            self._add(vnode, lo, (a.detach().transpose(-1, -2) @ d).sum_to_size(v.shape))
        vals = {n: v.detach() if torch.is_tensor(v) else v for n, v in vals.items()}
        vals[product] = self.out[..., lo:hi, :]
        return vals, da

    def _leaf(self, n, lo: int, hi: int, keys: Optional[tuple] = None):
        """The operand's rows of the chunk (on its first keys, with ``keys``), a leaf if its gradient
        is wanted."""
        v = self.whole_values[n]
        v = v[..., lo:hi, :] if n in self.split else v
        if keys is not None and n not in self.split:
            v = first_keys(self.core, n, v, keys[1], keys[0])
        return v.detach().requires_grad_(True) if n in self.wanted else v

    def _values(self, lo: int, hi: int, keys: tuple) -> dict:
        with torch.no_grad():
            whole = self.whole_values.__getitem__
            if self.out is None:
                return evaluate_rows(self.core, whole, lo, hi, self.compute, keys=keys)
            vals = evaluate_rows(self.core, whole, lo, hi, self.compute, keys=keys, product=False)
        vals[self.core.nodes[-1]] = self.out[..., lo:hi, :]  # (the core's output, as _by_hand reads it)
        return vals

    def _add(self, n, lo: int, g: torch.Tensor) -> None:
        """The chunk's gradient ``g`` at operand ``n``: its rows, or added into the total of a whole
        operand (into its first keys where ``g`` has fewer: the chunk attends to no later key)."""
        if n in self.row_parts:
            self.row_parts[n][lo] = g
            return
        if n not in self.whole:
            self.whole[n] = g.new_zeros(self.whole_values[n].shape)  # (the chunks' gradients are added into it)
        add_on_first_keys(self.whole[n], g, f"a chunk's gradient at {n.name}")

    def rest(self, chunks: List[tuple]) -> None:
        """The gradients of the chunks of ``chunks`` not computed yet (the walk of the core took
        another path after its first chunk: :func:`relprop.engine.chunked_walk.walk_core`)."""
        for lo, hi, keys in chunks:
            if lo not in self.done:
                self(lo, hi, keys)

    def gradients(self) -> Dict[torch.fx.Node, torch.Tensor]:
        """{operand: its gradient} for each wanted operand: the rows of the split ones in order, the
        sum over the chunks for the others (zero where no chunk reached it)."""
        out = {n: torch.cat([parts[lo] for lo in sorted(parts)], -2) for n, parts in self.row_parts.items()}
        for n in self.wanted:
            if n not in out:
                out[n] = self.whole.get(n, None)
                if out[n] is None:
                    out[n] = torch.zeros_like(self.whole_values[n])
        return out


def _product_by_hand(core: AttentionCore, attention, operands, out, dout, compute) -> bool:
    """Whether :meth:`ChunkGradients._by_hand` applies: the core's output ``out`` is known, in
    ``dout``'s shape and dtype, the product is a matmul of the attention map A with V (an operand
    from outside the core that no other core node reads), of one dtype, and no half precision is
    evaluated in float32."""
    product = core.nodes[-1]
    if out is None or compute is not None or product.target not in PRODUCTS or len(product.args) != 2 \
            or product.args[0] is not attention or product.kwargs:
        return False
    vnode = product.args[1]
    if vnode not in core.whole or any(vnode in n.all_input_nodes for n in core.nodes[:-1]):
        return False
    return torch.is_tensor(out) and out.shape == dout.shape and out.dtype == dout.dtype == operands[vnode].dtype
