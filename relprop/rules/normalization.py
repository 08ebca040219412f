"""Normalizations written out op by op: multiplying a tensor by a statistic of itself.

LLaMA's RMSNorm computes ``x · rsqrt(mean(x², -1, keepdim=True) + ε)`` and then multiplies by its
gain. Both factors of the first product depend on the input, but one of them is a *normalizing
statistic*: a per-token scale, reduced over the dimension it is broadcast along. Chefer, Gur &
Wolf (CVPR 2021) and their code treat LayerNorm as the identity (``layers_ours.LayerNorm``: the
mean and standard deviation are constants for the relevance); :func:`relprop.rules.reductions.
divide_by_statistic` does the same for ``x / ‖x‖``. We apply that convention to products: the
statistic receives no relevance and the normalized tensor receives all of it, so RMSNorm as a
whole passes relevance unchanged, exactly like LayerNorm (and like ``aten.rms_norm`` when a model
calls the fused op).

A factor is taken to be a statistic when (a) it is broadcast in the product (size 1 in a
dimension where the output is larger) and (b) walking back from it through element-wise ops (at
most :data:`MAX_HOPS` of them) reaches a reduction (mean, sum, variance, norm, max) whose reduced
dimensions include every dimension it is broadcast along. A gate of the same shape as the other
factor (LLaMA's ``silu(x W₁) ⊙ x W₃``) is not a statistic: it gets the halved z-rule of
:func:`relprop.rules.products.multiply`.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.fx

aten = torch.ops.aten

#: reductions that produce a statistic: op -> position of the ``dim`` argument
REDUCTIONS = {
    aten.mean.dim: 1, aten.sum.dim_IntList: 1, aten.var.correction: 1, aten.var.dim: 1, aten.std.correction: 1,
    aten.std.dim: 1, aten.linalg_vector_norm.default: 2, aten.amax.default: 1, aten.norm.ScalarOpt_dim: 2,
}
#: element-wise ops a statistic may pass through on its way to the product (eps, rsqrt, casts, ...)
ELEMENTWISE = {
    aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar, aten.mul.Tensor, aten.mul.Scalar,
    aten.div.Tensor, aten.div.Scalar, aten.rsqrt.default, aten.sqrt.default, aten.pow.Tensor_Scalar,
    aten.reciprocal.default, aten.clamp.default, aten.clamp_min.default, aten._to_copy.default,
    aten.to.dtype, aten.clone.default, aten.alias.default, aten.expand.default, aten.detach.default,
}
MAX_HOPS = 8


def _shape(node) -> Optional[tuple]:
    v = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def broadcast_dims(factor: torch.Tensor, out: torch.Tensor) -> set:
    """Dimensions of ``out`` (counted from the end, negative) along which ``factor`` is broadcast."""
    dims = set()
    for i in range(1, out.dim() + 1):
        size = factor.shape[-i] if i <= factor.dim() else 1
        if size == 1 and out.shape[-i] != 1:
            dims.add(-i)
    return dims


def _reduced_dims(node: torch.fx.Node, ndim: int) -> set:
    pos = REDUCTIONS[node.target]
    dims = node.args[pos] if len(node.args) > pos else node.kwargs.get("dim")
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return {d - ndim for d in range(ndim)}
    if isinstance(dims, int):
        dims = [dims]
    return {(d % ndim) - ndim for d in dims}


def reaches_reduction(node, over: set, hops: int = MAX_HOPS) -> bool:
    """True if ``node`` is, within ``hops`` element-wise ops, a reduction over (at least) ``over``
    (dimensions counted from the end)."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function" or hops < 0:
        return False
    if node.target in REDUCTIONS:
        src = node.args[0]
        shape = _shape(src)
        return shape is not None and over <= _reduced_dims(node, len(shape))
    if node.target not in ELEMENTWISE:
        return False
    return any(reaches_reduction(a, over, hops - 1) for a in node.all_input_nodes)


def is_statistic(ctx, position: int) -> bool:
    """Whether argument ``position`` of the product ``ctx.node`` is a normalizing statistic of the
    input (see the module docstring): broadcast in the product and reduced along those dimensions."""
    factor, out = ctx.args[position], ctx.out
    if not torch.is_tensor(factor) or not torch.is_tensor(out) or factor.numel() >= out.numel():
        return False
    over = broadcast_dims(factor, out)
    if not over:
        return False
    node_args = ctx.node.args
    arg = node_args[position] if position < len(node_args) else None
    return reaches_reduction(arg, over)
