"""A segment's backward pass and its relevance walk in one pass over its core's chunks.

In ``memory="low"`` (:func:`relprop.engine.low_memory.run_low`) each segment is recomputed with
autograd, its gradients are propagated, then the walk visits it. With a row-chunked attention core
(:mod:`relprop.engine.chunked_walk`) each chunk of query rows was then computed three times: by the
forward pass, by the core's backward pass (:mod:`relprop.engine.chunked_core`, for ∇Q, ∇Kᵀ, ∇V) and
by the walk (for the rules' values and dA = ∂y/∂A). The walk of the nodes after the core reads no
gradient, so the order can be:

1. the segment recomputed with the core's output A·V cut from autograd (a leaf, the forward pass's
   value); the gradients propagated from the segment's outputs to that leaf (dO) and along the other
   paths (the residual) to the segment's inputs;
2. the walk of the nodes after the core, which gives the relevance at the core's output;
3. the core walked chunk by chunk, each chunk evaluated once with autograd
   (:class:`relprop.engine.chunk_gradients.ChunkGradients`): its gradients at the operands and
   at A, and the rules on the same values;
4. the gradients at the operands (Q, Kᵀ, V) propagated to the segment's inputs; the walk goes on
   below the core.

Each gradient is the same sum of the same terms as before, in another order (the two paths to the
segment's inputs are added after, not inside, autograd). The block is handed to the folds' end
(``rows_done``) after step 4, when the gradients of its records are complete. A segment is walked so
when it holds one chunked core (:func:`segment_walk`); the others take the two passes as before.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.fx

from .chunk_gradients import ChunkGradients


class SegmentWalk:
    """Steps 2–3 of the module docstring for segment ``seg`` and its core whose output is ``product``
    (called by :func:`relprop.engine.low_memory.backward_segment` once step 1 is done); ``cores``: the
    walk's :class:`relprop.engine.chunked_walk.ChunkedCores`."""

    def __init__(self, walker, cores, seg: List[torch.fx.Node], product: torch.fx.Node, compute=None):
        self.walker, self.cores, self.product, self.compute = walker, cores, product, compute
        i = seg.index(product)
        self.after, self.left = seg[i + 1:], seg[:i + 1]

    def __call__(self, senv: Dict[torch.fx.Node, object], grad: Dict[torch.fx.Node, torch.Tensor]):
        """Walk the nodes after the core and the core, its chunks giving the core's gradients;
        returns {operand: gradient at it} (the operands whose recomputed value requires grad)."""
        walker, product = self.walker, self.product
        core, block = self.cores.cores[product]
        values = walker.values
        with values.no_overwrites():  # (autograd still reads the segment's values in step 4)
            for node in reversed(self.after):
                walker.visit(node)
            dout = grad.pop(product, None)
            if dout is None:  # (no gradient reaches the core)
                dout = torch.zeros_like(values.value(product))
            nodes = list(dict.fromkeys(core.rows + core.whole))
            operands = {n: _detached(senv[n] if n in senv else values.value(n)) for n in nodes}
            needs = {n: torch.is_tensor(senv.get(n)) and senv[n].requires_grad for n in nodes}
            source = ChunkGradients(core, block.attention, operands, needs, dout, self.compute,
                                    _detached(senv.get(product)))
            self.cores.walk_with(walker, product, dout, source)
            return source.gradients()

    def done(self) -> None:
        """Step 4 is done: the segment's gradients are complete, the block is closed (its folds may
        read the gradients of its records)."""
        self.cores.done(self.product)

    def rest(self) -> List[torch.fx.Node]:
        """The segment's nodes the walk visits after the backward pass (the core's output and those
        before it)."""
        return self.left


def _detached(v):
    return v.detach() if torch.is_tensor(v) else v


def segment_walk(seg: List[torch.fx.Node], cores, walker, compute=None) -> Optional[SegmentWalk]:
    """The :class:`SegmentWalk` of segment ``seg``, or None where its backward pass and walk take two
    passes: no walk, or not exactly one row-chunked core of ``cores`` (the walk's
    :class:`relprop.engine.chunked_walk.ChunkedCores`, or None) in it."""
    if walker is None or cores is None:
        return None
    inside = set(seg)
    products = [p for p in cores.cores if p in inside]
    if len(products) != 1:
        return None
    return SegmentWalk(walker, cores, seg, products[0], compute)
