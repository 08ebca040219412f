"""Shape-only ops of window attention (Swin): padding, cyclic shifts and strided views.

Swin cuts the token grid of a stage into windows (``view``/``permute``, already routed by
:mod:`relprop.rules.routing`), pads the grid to a multiple of the window size
(``constant_pad_nd``), shifts it cyclically every other block (``roll``; ``torch.export``
decomposes it into two ``index_select`` along the grid axes) and reads pooled features through
``as_strided``. These ops only move elements, so, as for every shape-only op, relevance
is routed back to the element each output element was copied from — the adjoint of the index map,
which is the op's vector-Jacobian product. Elements an op creates (the padding) come from a
constant: their relevance is booked as absorbed by the pad value. Registered in ``"base"``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .rule_registry import rule

aten = torch.ops.aten


@rule(aten.constant_pad_nd.default, preset="base")
def pad_route(ctx, relevance):
    """``constant_pad_nd(x, pad, value)``: each element of x gets back the relevance of its copy;
    the padded elements hold the constant ``value``, which absorbs their relevance. (Negative
    pads crop: cropped elements of x receive none.)"""
    x, pad = ctx.args[0], list(ctx.args[1])
    inverse = [-p for p in pad]
    rx = F.pad(relevance, inverse)
    copied = F.pad(torch.ones(x.shape, dtype=relevance.dtype, device=relevance.device), pad)
    rpad = relevance * (1 - copied)
    return (rx, None, rpad) if len(ctx.args) > 2 else (rx, None)


@rule(aten.roll.default, preset="base")
def roll_route(ctx, relevance):
    """``roll(x, shifts, dims)``: the relevance is rolled back by ``-shifts``."""
    shifts = ctx.args[1]
    dims = ctx.args[2] if len(ctx.args) > 2 else []
    shifts = [shifts] if isinstance(shifts, int) else list(shifts)
    dims = [dims] if isinstance(dims, int) else list(dims)
    if not dims:  # roll of the flattened tensor
        back = relevance.flatten().roll(-shifts[0]).reshape(relevance.shape)
    else:
        back = relevance.roll([-s for s in shifts], dims)
    return (back,) + (None,) * (len(ctx.args) - 1)


def _adjoint(ctx, relevance):
    """Vector-Jacobian product of the op w.r.t. its first argument: for an op that only copies
    elements (a linear index map) this is exactly the adjoint, which sums the relevance of every
    copy of an element and gives none to elements never read."""
    x = ctx.args[0]
    with torch.enable_grad():
        leaf = x.detach().to(relevance.dtype).requires_grad_(True)
        y = ctx.node.target(leaf, *ctx.args[1:], **ctx.kwargs)
        (back,) = torch.autograd.grad(y, leaf, relevance.to(y.dtype).reshape(y.shape))
    return (back,) + (None,) * (len(ctx.args) - 1)


@rule(aten.as_strided.default, aten.as_strided_copy.default, aten.unfold.default, aten.flip.default,
      preset="base")
def strided_view_route(ctx, relevance):
    """Strided views (``as_strided``, ``unfold``: sliding windows, overlapping or not) and
    ``flip``: relevance goes back to the element each output element views; an element seen by
    several windows collects the relevance of all of them (the adjoint of the index map)."""
    return _adjoint(ctx, relevance)
