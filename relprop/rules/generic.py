"""The generic z-rule (gradient × input), used only when the user opts in with
``explain(..., unsupported="z_rule")`` for ops that have no rule in the active preset.

For ``y = f(x_1, ..., x_n)``: ``R_i = x_i ⊙ (∂f/∂x_i)ᵀ (R / y)``. It is exact (conservative) for
ops that are linear and homogeneous in their live inputs and only a first-order approximation
otherwise; that is why it is never applied silently.

It takes any op the walk meets: ops that return a list or tuple (``native_batch_norm`` returns the
output and two statistics; relevance arrives for the elements the graph reads, zeros for the
others), live arguments that are lists of tensors (each element gets its share), live arguments
that are integer or boolean tensors (indices, masks: not differentiable, they get none), Python
numbers and keyword arguments (passed to the op as they are).
"""
from __future__ import annotations

import torch

from ..graph.torch_fixes import safe_target
from .stabilize import finite, promote, safe_divide


def _leaf(value):
    """A differentiable stand-in for one live argument (None when it cannot carry relevance):
    (leaf in at least float32, the value cast back to the op's dtype)."""
    if not torch.is_tensor(value) or not value.is_floating_point():
        return None
    leaf = promote(value.detach()).requires_grad_(True)
    return leaf, leaf.to(value.dtype)


def gradient_times_input(ctx, relevance):
    """Generic z-rule for any differentiable op (see module docstring)."""
    args = list(ctx.args)
    leaves = []  # (position, index in a list argument or None, leaf)
    for i, (value, live) in enumerate(zip(ctx.args, ctx.live)):
        if live is True:
            made = _leaf(value)
            if made is not None:
                leaves.append((i, None, made[0]))
                args[i] = made[1]
        elif isinstance(live, (list, tuple)) and isinstance(value, (list, tuple)):
            elements = list(value)
            for j, (el, el_live) in enumerate(zip(value, live)):
                made = _leaf(el) if el_live is True else None
                if made is not None:
                    leaves.append((i, j, made[0]))
                    elements[j] = made[1]
            args[i] = type(value)(elements) if isinstance(value, tuple) else elements
    out = [None] * len(ctx.args)
    if not leaves:
        return tuple(out)
    with torch.enable_grad():
        y = safe_target(ctx.node.target)(*args, **ctx.kwargs)
        outs = list(y) if isinstance(y, (list, tuple)) else [y]
        rels = list(relevance) if isinstance(relevance, (list, tuple)) else [relevance]
        roots, seeds = [], []
        for yk, rk in zip(outs, rels):
            if not torch.is_tensor(yk) or not torch.is_tensor(rk) or not yk.requires_grad:
                continue
            roots.append(yk)
            s = safe_divide(rk, promote(yk.detach()), ctx.eps)
            seeds.append(s.reshape(yk.shape).to(yk.dtype))
        if not roots:
            return tuple(out)
        grads = torch.autograd.grad(roots, [leaf for _, _, leaf in leaves], seeds, allow_unused=True)
    for (i, j, leaf), g in zip(leaves, grads):
        share = finite(leaf.detach() * promote(g)) if g is not None else None
        if j is None:
            out[i] = share
        else:
            if out[i] is None:
                out[i] = [None] * len(ctx.args[i])
            out[i][j] = share
    return tuple(out)
