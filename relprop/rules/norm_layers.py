"""Normalization layers of convolutional and hybrid models: BatchNorm in inference, GroupNorm.

**BatchNorm in eval mode** (``aten._native_batch_norm_legit_no_training``, what ``torch.export``
makes of ``nn.BatchNorm1d/2d/3d`` in eval mode; returns ``(y, mean, invstd)``, the graph reads y)
is an affine map per channel with the running statistics μ, σ² as constants::

    y = a ⊙ x + c,    a = γ / √(σ² + ε_bn),    c = β − a ⊙ μ

* ``"chefer2021"`` and ``"lrp"``: the authors' ``layers_ours.BatchNorm2d.relprop`` (the same in
  ``layers_lrp.py``) is a z-rule on the scaling alone, the shift left out:
  ``R_x = x ⊙ a ⊙ R / (x ⊙ a)`` (stabilized), so relevance passes through unchanged wherever
  x ⊙ a ≠ 0. (Their code scales by γ / √((σ²)² + ε), squaring the variance; a per-channel factor
  that cancels here, so we use the layer's own a.)
* ``"attnlrp"`` (and ``"cp_lrp"``): the ε-rule of AttnLRP Eq. 8 on the affine map, the shift in
  the denominator: ``R_x = a ⊙ x ⊙ R / y``; the shift absorbs its share ``c ⊙ R / y``, booked as
  β ⊙ R / y on the bias and −a ⊙ μ ⊙ R / y on the running mean. Gradient form: the op's own
  gradient (a ⊙ g) with the ε-rule's stabilizer.

**GroupNorm** (``aten.native_group_norm``, returns ``(y, mean, rstd)``; MobileViTv2 normalizes
with one group): y = γ_c (x − μ_g) / σ_g + β_c, statistics per sample and group.

* ``"chefer2021"`` and ``"lrp"``: the identity, as the authors' code treats LayerNorm (the
  statistics are constants, gain and bias get nothing): ``R_x = R``.
* ``"attnlrp"``: AttnLRP Prop. 3.4 (σ_g constant) and the ε-rule (Eq. 8) on the linear rest,
  exactly as for LayerNorm: ``R_x,i = x_i Σ_j (γ_j / σ_g)(δ_ij − 1/N_g) R_j / y_j`` within each
  group of N_g elements; β absorbs ``β ⊙ R / y``.
"""
from __future__ import annotations

import torch

from .attnlrp import ATTNLRP
from .gradient_forms import epsilon_stabilized, group_norm_const_std
from .rule_registry import rule
from .stabilize import promote, safe_divide

aten = torch.ops.aten
PAPER_PRESETS = ("chefer2021", "lrp")
BATCH_NORMS = (aten._native_batch_norm_legit_no_training.default, aten.native_batch_norm.default)


def _first(relevance):
    """The relevance of the normalized output (element 0 of the op's tuple of outputs)."""
    return relevance[0] if isinstance(relevance, (list, tuple)) else relevance


def _channels(v, like):
    """A per-channel vector [C] shaped to broadcast along dimension 1 of ``like`` [N, C, ...]."""
    return promote(v).reshape((1, -1) + (1,) * (like.dim() - 2))


def batch_norm_parts(ctx):
    """(x, a, β or None, μ) of an inference batch norm, a = γ / √(σ² + ε_bn) and μ shaped to
    broadcast over x; None when the op normalizes with batch statistics (training mode)."""
    args = list(ctx.args)
    if ctx.node.target is aten.native_batch_norm.default:
        if args[5]:  # training: batch statistics, not an affine map with constant coefficients
            return None
        eps_bn = args[7]
    else:
        eps_bn = args[6]
    x, weight, bias, mean, var = promote(args[0]), args[1], args[2], args[3], args[4]
    if not torch.is_tensor(mean) or not torch.is_tensor(var):
        return None
    a = torch.rsqrt(_channels(var, x) + eps_bn)
    if torch.is_tensor(weight):
        a = a * _channels(weight, x)
    beta = _channels(bias, x) if torch.is_tensor(bias) else None
    return x, a, beta, _channels(mean, x)


@rule(*BATCH_NORMS, preset=PAPER_PRESETS)
def batch_norm_scaling_z(ctx, relevance):
    """BatchNorm in inference: the z-rule on the scaling a ⊙ x with the shift left out, as the
    authors' ``layers_ours.BatchNorm2d.relprop``: R_x = x ⊙ a ⊙ R / (x ⊙ a) (module docstring)."""
    parts = batch_norm_parts(ctx)
    if parts is None:
        return None
    x, a, _, _ = parts
    z = x * a
    rx = z * safe_divide(_first(relevance), z, ctx.eps)
    return (rx,) + (None,) * (len(ctx.args) - 1)


@rule(*BATCH_NORMS, preset=ATTNLRP, gradient_form=epsilon_stabilized())
def batch_norm_epsilon(ctx, relevance):
    """BatchNorm in inference, y = a ⊙ x + c: the ε-rule (AttnLRP Eq. 8), R_x = a ⊙ x ⊙ R / y; the
    shift c = β − a ⊙ μ absorbs c ⊙ R / y (β's part on the bias, −a ⊙ μ's on the running mean)."""
    parts = batch_norm_parts(ctx)
    if parts is None:
        return None
    x, a, beta, mean = parts
    y = promote(ctx.out[0])
    s = safe_divide(_first(relevance), y, ctx.eps)
    out = [a * x * s, None, beta * s if beta is not None else None, -a * mean * s]
    return tuple(out) + (None,) * (len(ctx.args) - 4)


@rule(aten.native_group_norm.default, preset=PAPER_PRESETS)
def group_norm_identity(ctx, relevance):
    """GroupNorm: relevance passes to the normalized input unchanged, as the authors' code treats
    LayerNorm (CVPR 2021, ``layers_ours.LayerNorm``): the statistics, gain and bias get none."""
    return (_first(relevance),) + (None,) * (len(ctx.args) - 1)


def group_norm_shares(x, weight, bias, groups, eps_gn, out, relevance, eps):
    """GroupNorm with σ_g constant (AttnLRP Prop. 3.4), so y = γ ⊙ (x − μ_g) / σ_g + β is linear in
    x; its ε-rule (Eq. 8): R_x,i = x_i Σ_j (γ_j/σ_g)(δ_ij − 1/N_g) R_j / y_j; β absorbs β ⊙ R / y."""
    n = x.shape[0]
    xg = x.reshape(n, groups, -1)
    rstd = torch.rsqrt(xg.var(-1, unbiased=False, keepdim=True) + eps_gn)
    s = safe_divide(relevance, out, eps)
    u = s * _channels(weight, x) if weight is not None else s
    ug = u.reshape(n, groups, -1)
    rx = (xg * (ug - ug.mean(-1, keepdim=True)) * rstd).reshape(x.shape)
    rb = _channels(bias, x) * s if bias is not None else None
    return rx, rb


@rule(aten.native_group_norm.default, preset=ATTNLRP, gradient_form=epsilon_stabilized(group_norm_const_std))
def group_norm(ctx, relevance):
    """``native_group_norm``: AttnLRP Prop. 3.4 (each group's σ constant) with the ε-rule on the
    remaining linear map (Eq. 8), as for LayerNorm; β absorbs β ⊙ R / y. See
    :func:`group_norm_shares`."""
    x, weight, bias, _, _, _, groups, eps_gn = ctx.args
    weight = weight if torch.is_tensor(weight) else None
    bias = bias if torch.is_tensor(bias) else None
    rx, rb = group_norm_shares(promote(x), weight, bias, groups, eps_gn, promote(ctx.out[0]), _first(relevance),
                               ctx.eps)
    return (rx, None, rb) + (None,) * (len(ctx.args) - 3)
