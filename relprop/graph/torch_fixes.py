"""Workarounds for torch kernels whose gradient is wrong, or that are slow, in cases relprop meets.

**Inference BatchNorm, batch of one.** On CPU (torch 2.x), the backward of
``aten._native_batch_norm_legit_no_training`` returns wrong values when the batch has one sample and
the incoming gradient is strided unusually (batch stride smaller than the sample's size, as after a
``flatten(2).transpose(1, 2)`` of the tokens, e.g. EfficientFormer, LeViT): up to the whole gradient's
scale, so without this a single image would be explained unlike the same image in a batch. Computing the op as it is and
handing its backward a contiguous gradient gives the exact gradient, a ⊙ g per channel.

**Safe softmax.** ``aten._safe_softmax`` (what ``torch.export`` makes of a fused attention's softmax)
gives 0 instead of NaN on rows that are entirely −inf. Its CPU kernel spends three passes over the
scores to find them (``eq``, ``all``, ``where``: 4× the time of the softmax on a ViT-B/16 block).
:func:`_safe_softmax` finds them with one reduction (the row maximum is −inf) and runs the plain
softmax when there is none; the values and the gradient are the same bit for bit (the backward of
both is the softmax's own), and where there is such a row it runs ``_safe_softmax`` itself.

**Decomposed safe softmax.** An exported SDPA of HuggingFace models computes the same thing as
``where(row all masked, full_like(A, 0), A)``: two more tensors of heads × tokens² per block and
evaluation, which on long inputs are fresh memory the kernel faults in page by page.
:func:`broadcast_fill` evaluates a ``full_like`` that only element-wise ops read as one broadcast
element, and :func:`_where` / :func:`where_selecting` return the operand a ``where`` selects
everywhere (A, in a batch without a fully masked row) instead of a copy; the rows are found by
``any(logical_not(eq(scores, c)), -1)``, which :class:`PendingEqual` and :func:`any_pending` run as
one min-max reduction without the two boolean tensors. The graph evaluator picks these per node
(:func:`relprop.graph.nodes.evaluate`). The values are the same bit for bit.

:func:`safe_target` returns, for an op of the graph, the callable relprop evaluates it with: the op
itself, or the op with such a fix. Every evaluation of a graph node goes through it
(:func:`relprop.graph.nodes.evaluate`, the rules' gradient forms).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch.autograd import Function

from .broadcasting import broadcast_shape
from .host_reads import deferring
from .run_memo import about_tensor

aten = torch.ops.aten


class _ContiguousGradient(Function):
    """Identity forward; backward hands on the incoming gradient made contiguous."""

    @staticmethod
    def forward(ctx, z):
        return z.view_as(z)

    @staticmethod
    def backward(ctx, g):
        return g.contiguous()


def contiguous_gradient(z: torch.Tensor) -> torch.Tensor:
    """``z`` unchanged; the gradient that reaches the op that made ``z`` is contiguous."""
    return _ContiguousGradient.apply(z) if z.requires_grad else z


def _batch_norm_no_training(*args, **kwargs):
    out = aten._native_batch_norm_legit_no_training.default(*args, **kwargs)
    return (contiguous_gradient(out[0]),) + tuple(out[1:])


def _native_batch_norm(*args, **kwargs):
    out = aten.native_batch_norm.default(*args, **kwargs)
    return (contiguous_gradient(out[0]),) + tuple(out[1:])


def _safe_softmax(x, dim, dtype=None):
    """``aten._safe_softmax`` with one reduction to find the rows that are entirely −inf (module
    docstring); the op itself within a call that reads nothing on the host
    (:func:`relprop.graph.host_reads.deferring`)."""
    if x.numel() == 0 or deferring() or bool((x.amax(dim) == float("-inf")).any()):
        return aten._safe_softmax.default(x, dim, dtype)
    return aten._softmax.default(x if dtype is None else x.to(dtype), dim, False)


#: ops whose output has the broadcast shape of their tensor operands and reads each element once:
#: a constant fill feeding only these may be a broadcast scalar (:func:`broadcast_fill`)
ELEMENTWISE = frozenset({
    aten.where.self, aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor,
    aten.masked_fill.Scalar, aten.masked_fill.Tensor, aten.maximum.default, aten.minimum.default,
})


def broadcast_fill(x, fill_value, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    """``aten.full_like(x, fill_value)`` as one element expanded to ``x``'s shape (no tensor-sized
    buffer), for a node whose every user is in :data:`ELEMENTWISE`: the values are the same, and an
    element-wise op reads a broadcast operand like a materialized one. Falls back to the op itself
    for options a broadcast cannot honour.

    Why: the decomposed safe softmax of an exported SDPA (``where(all masked, full_like(A, 0), A)``)
    makes one such tensor per attention block and evaluation; on long inputs each is fresh memory
    that the kernel faults in page by page."""
    if (layout in (None, torch.strided) and not pin_memory and memory_format in (None, torch.preserve_format)
            and isinstance(fill_value, (int, float, bool)) and torch.is_tensor(x)):
        one = torch.full((), fill_value, dtype=dtype or x.dtype, device=device or x.device)
        return one.expand(x.shape)
    return aten.full_like.default(x, fill_value, dtype=dtype, layout=layout, device=device, pin_memory=pin_memory,
                                  memory_format=memory_format)


def selects_everywhere(cond) -> Optional[int]:
    """For ``where(cond, a, b)``: 1 when the boolean ``cond`` is True everywhere (every element comes
    from ``a``, argument 1), 2 when it is False everywhere (from ``b``), else None. Read once per
    engine run for each ``cond`` tensor (:func:`relprop.graph.run_memo.about_tensor`: the blocks of a
    decoder each turn the same boolean mask into their own float mask). None within a call that reads
    nothing on the host (:func:`relprop.graph.host_reads.deferring`): the ``where`` is computed."""
    if not (torch.is_tensor(cond) and cond.dtype == torch.bool) or deferring():
        return None
    return about_tensor("selects_everywhere", cond, _selects_everywhere)


def _selects_everywhere(cond: torch.Tensor) -> Optional[int]:
    if not bool(cond.any()):
        return 2
    return 1 if bool(cond.all()) else None


def _selected(cond, a, b):
    """The operand of ``where(cond, a, b)`` that ``cond`` selects everywhere when it already has the
    result's shape and dtype, else None."""
    if not (torch.is_tensor(a) and torch.is_tensor(b)):
        return None
    pick = selects_everywhere(cond)
    if pick is None:
        return None
    chosen = a if pick == 1 else b
    shape = broadcast_shape(cond.shape, a.shape, b.shape)
    return chosen if tuple(chosen.shape) == shape and chosen.dtype == torch.result_type(a, b) else None


def _where(cond, a, b):
    """``aten.where(cond, a, b)``; without autograd, when ``cond`` selects one operand everywhere and
    that operand already has the result's shape and dtype, that operand itself (the same values, no
    new tensor). The safe softmax of an exported SDPA is ``where(row all masked, 0, softmax)``: in a
    batch without such a row this is the softmax, and the attention-sized copy is saved."""
    if not (torch.is_grad_enabled() and any(torch.is_tensor(t) and t.requires_grad for t in (a, b))):
        chosen = _selected(cond, a, b)
        if chosen is not None:
            return chosen
    return aten.where.self(cond, a, b)


def where_selecting(cond, a, b):
    """:func:`_where` also under autograd, for a ``where`` node whose operands feed no other
    differentiable op (:func:`relprop.graph.nodes.evaluate` decides): the gradient reaching the
    selected tensor is then the one that reaches the ``where``, as its backward would pass it on
    (the other operand's would be 0), and the backward's copy is saved too."""
    chosen = _selected(cond, a, b)
    return chosen if chosen is not None else aten.where.self(cond, a, b)


class PendingEqual:
    """``eq(x, c)`` (or its ``logical_not`` when ``negated``) not computed yet: the value of a node
    whose only reader is the row test :func:`any_pending`. The safe softmax of an exported SDPA
    tests each row for being entirely masked as ``any(logical_not(eq(scores, c)), -1)``, two
    boolean tensors as large as the attention map before the reduction; deferred, the test is one
    min-max reduction and no attention-sized tensor."""

    __slots__ = ("x", "c", "negated")

    def __init__(self, x: torch.Tensor, c, negated: bool = False):
        self.x, self.c, self.negated = x, c, negated

    def tensor(self) -> torch.Tensor:
        """The boolean tensor itself (for a reader other than the row test)."""
        eq = aten.eq.Scalar(self.x, self.c)
        return aten.logical_not.default(eq) if self.negated else eq


def pending_eq(x, c):
    """``aten.eq.Scalar(x, c)`` deferred (:class:`PendingEqual`) for a floating ``x``."""
    if torch.is_tensor(x) and x.is_floating_point() and isinstance(c, (int, float)):
        return PendingEqual(x, c)
    return aten.eq.Scalar(x, c)


def pending_not(b):
    """``aten.logical_not(b)``, deferred when ``b`` is a deferred comparison."""
    if isinstance(b, PendingEqual):
        return PendingEqual(b.x, b.c, not b.negated)
    return aten.logical_not.default(b)


def any_pending(b, dim, keepdim=False):
    """``aten.any.dim(b, dim, keepdim)``; for ``b`` = ``logical_not(eq(x, c))`` deferred, computed as
    "not every element of the row equals c" = not (min = c and max = c), one reduction over x, after
    a look at each row's first element (a row whose first element is not c passes). The same
    booleans: a NaN makes min or max NaN, which equals nothing (as eq gives False there), and a NaN
    first element differs from c as ``ne`` says; −0 = +0 in both. A row that is empty along ``dim``
    takes the explicit path."""
    if not isinstance(b, PendingEqual):
        return aten.any.dim(b, dim, keepdim)
    if not b.negated or not isinstance(dim, int) or b.x.dim() == 0 or b.x.shape[dim] == 0:
        return aten.any.dim(b.tensor(), dim, keepdim)
    # a row whose first element differs from c passes: where every row's does (a causal mask opens
    # each row's first key), that is the answer, from one element per row (read on the host: not within
    # a call that reads nothing there, relprop.graph.host_reads)
    if not deferring():
        first = b.x.select(dim, 0) != b.c
        if bool(first.all()):
            return first.unsqueeze(dim) if keepdim else first
    # (two reductions, or one when c is an infinity, cost a quarter of torch.aminmax on CPU:
    # 2048-token maps, 1 thread; every x >= -inf, so max = -inf says every element is -inf, NaN aside,
    # and a NaN makes max NaN, which equals nothing, as eq gives False there)
    if b.c == float("-inf"):
        return torch.amax(b.x, dim=dim, keepdim=keepdim) != b.c
    if b.c == float("inf"):
        return torch.amin(b.x, dim=dim, keepdim=keepdim) != b.c
    lo = torch.amin(b.x, dim=dim, keepdim=keepdim)
    hi = torch.amax(b.x, dim=dim, keepdim=keepdim)
    return torch.logical_not((lo == b.c) & (hi == b.c))


_FIXED = {
    aten.where.self: _where,
    aten._safe_softmax.default: _safe_softmax,
    aten._native_batch_norm_legit_no_training.default: _batch_norm_no_training,
    aten.native_batch_norm.default: _native_batch_norm,
}


def safe_target(target: Callable) -> Callable:
    """The callable to evaluate a graph op ``target`` with: ``target``, or ``target`` with a fix for
    a wrong gradient or a slow kernel of torch (module docstring)."""
    return _FIXED.get(target, target)
