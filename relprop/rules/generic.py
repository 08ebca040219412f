"""The generic z-rule (gradient × input), used only when the user opts in with
``explain(..., unsupported="z_rule")`` for ops that have no rule in the active preset.

For ``y = f(x_1, ..., x_n)``: ``R_i = x_i ⊙ (∂f/∂x_i)ᵀ (R / y)``. It is exact (conservative) for
ops that are linear and homogeneous in their live inputs and only a first-order approximation
otherwise; that is why it is never applied silently.
"""
from __future__ import annotations

import torch

from .stabilize import finite, safe_divide, upcast


def gradient_times_input(ctx, relevance):
    """Generic z-rule for any differentiable op (see module docstring)."""
    live = ctx.live_tensor_args()
    if not live:
        return (None,) * len(ctx.args)
    with torch.enable_grad():
        args = list(ctx.args)
        leaves = []
        for i in live:
            leaf = upcast(args[i].detach()).requires_grad_(True)
            args[i] = leaf.to(ctx.args[i].dtype)
            leaves.append(leaf)
        y = ctx.node.target(*args, **ctx.kwargs)
        if isinstance(y, (list, tuple)):
            y = y[0]
        s = safe_divide(relevance, upcast(y.detach()), ctx.eps)
        grads = torch.autograd.grad(y, leaves, s.to(y.dtype), allow_unused=True)
    out = [None] * len(ctx.args)
    for i, leaf, g in zip(live, leaves, grads):
        if g is not None:
            out[i] = finite(leaf.detach() * upcast(g))
    return tuple(out)
