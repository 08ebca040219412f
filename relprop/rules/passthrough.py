"""Ops whose relevance passes through unchanged, and masks that route it.

Chefer et al. (CVPR 2021, §3.2 and supplementary §B) propagate relevance through the non-linear
element-wise and normalization layers of a transformer unchanged: their code gives GELU, softmax,
LayerNorm, dropout and tanh the identity rule (``RelProp.relprop`` returns ``R``). Multiplication
or division by a constant (the attention scale 1/sqrt(d), a LayerNorm gain) is treated the same
way, as in the authors' ViT where ``dots = matmul1([q, k]) * scale`` has no rule of its own.
Registered for both the ``"chefer2021"`` and ``"lrp"`` presets.
"""
from __future__ import annotations

import torch

from ..graph.torch_fixes import selects_everywhere
from .rule_registry import rule

aten = torch.ops.aten
PAPER_PRESETS = ("chefer2021", "lrp")


@rule(aten.gelu.default, aten.tanh.default, aten.relu.default, aten.silu.default, aten.sigmoid.default,
      aten.erf.default, aten.softmax.int, aten._softmax.default, aten._safe_softmax.default,
      aten.log_softmax.int, aten._log_softmax.default, aten.hardtanh.default, aten.leaky_relu.default,
      aten.elu.default, aten.quick_gelu.default if hasattr(aten, "quick_gelu") else aten.gelu.default,
      aten.hardswish.default, aten.hardsigmoid.default, aten.mish.default, aten.clamp.default,
      aten.clamp_min.default, aten.clamp_max.default, preset=PAPER_PRESETS)
def identity(ctx, relevance):
    """Element-wise activations and softmax: R_in = R_out (CVPR 2021 code, ``RelProp.relprop``).
    Hardswish, hardsigmoid, mish and clamps (ReLU6-like bounds) are element-wise functions of one
    input like GELU: the identity rule too (the bounds of a clamp are numbers and get none)."""
    return (relevance,) + (None,) * (len(ctx.args) - 1)


@rule(aten.layer_norm.default, aten.rms_norm.default, preset=PAPER_PRESETS)
def layer_norm_identity(ctx, relevance):
    """LayerNorm: relevance passes to the normalized input unchanged; gain and bias get none.

    (CVPR 2021 code: ``LayerNorm(nn.LayerNorm, RelProp)`` has the identity rule.)
    """
    return (relevance,) + (None,) * (len(ctx.args) - 1)


@rule(aten.native_layer_norm.default, preset=PAPER_PRESETS)
def native_layer_norm_identity(ctx, relevance):
    """``native_layer_norm`` returns (y, mean, rstd); only y carries relevance, unchanged (the CVPR 2021
    code's identity rule on LayerNorm)."""
    r = relevance[0] if isinstance(relevance, (list, tuple)) else relevance
    return (r,) + (None,) * (len(ctx.args) - 1)


@rule(aten.mul.Scalar, aten.div.Scalar, preset=PAPER_PRESETS)
def scale_identity(ctx, relevance):
    """Scaling by a Python number (e.g. the attention scale d^-1/2): R_in = R_out (the authors' code
    scales outside its modules, ``dots = self.matmul1([q, k]) * self.scale``, so R passes unchanged)."""
    return (relevance, None)


@rule(aten.where.self, preset=("base",))
def where_route(ctx, relevance):
    """``where(cond, a, b)``: each element's relevance goes to the operand it was taken from.

    The condition is boolean and receives none; a constant operand (e.g. the zeros that SDPA puts
    in fully masked rows) absorbs what lands on it.
    """
    cond, a, b = ctx.args[:3]
    gets = selects_everywhere(cond) if torch.is_tensor(cond) and torch.broadcast_shapes(
        cond.shape, relevance.shape) == relevance.shape else None
    if gets is not None:
        # one operand gives every element (SDPA's zeros for fully masked rows, in a batch with no
        # such row): it gets R as it is, and the other, a constant, would absorb zeros
        other = 3 - gets
        if torch.is_tensor(ctx.args[gets]) and not (torch.is_tensor(ctx.args[other]) and ctx.live[other] is True):
            shares = [None, None, None]
            shares[gets] = relevance
            return tuple(shares)
    zero = torch.zeros((), dtype=relevance.dtype, device=relevance.device)
    ra = torch.where(cond, relevance, zero) if torch.is_tensor(a) else None
    rb = torch.where(cond, zero, relevance) if torch.is_tensor(b) else None
    return (None, ra, rb)


@rule(aten.masked_fill.Scalar, aten.masked_fill.Tensor, preset=("base",))
def masked_fill_route(ctx, relevance):
    """Filled positions come from the fill value: it absorbs their relevance, the rest goes to x."""
    x, mask = ctx.args[:2]
    zero = torch.zeros((), dtype=relevance.dtype, device=relevance.device)
    return (torch.where(mask, zero, relevance), None, torch.where(mask, relevance, zero))
