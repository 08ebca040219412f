"""Convolutions: the patch embedding of vision transformers.

The first layer sees pixels, which are bounded, so the authors' code (``layers_ours.Conv2d`` when
the input has 3 channels) uses the z^B ("box") rule of Montavon et al. (2017), as in the CVPR 2021
supplementary §B, with per-sample bounds l = min(x), h = max(x)::

    z_j = Σ_i x_i w_ji − l w⁺_ji − h w⁻_ji        (bias ignored, z_j ≥ 0)
    R_i = Σ_j (x_i w_ji − l w⁺_ji − h w⁻_ji) / z_j · R_j

We apply z^B whenever the convolution reads the model's pixel input directly (whatever the number
of channels). Any other convolution gets the preset's linear rule: alpha1-beta0 with a joint
denominator for chefer2021 (``layers_ours.Conv2d``), and for lrp the separate denominators of
``layers_lrp.Conv2d`` at c3e578f (x⁺W⁺ / z⁺ + x⁻W⁻ / z⁻, as :func:`relprop.rules.linear.lrp_baseline`).
Both presets share z^B. Its denominator is ≥ 0; the authors add 1e-9 to it, as ``safe_divide`` does
where it is > 0 (where it is 0, a constant image, we give 0 and they divide by 1e-9).
"""
from __future__ import annotations

import torch

from .registry import rule
from .stabilize import promote, safe_divide

aten = torch.ops.aten


def _conv(x, w, p):
    return aten.convolution.default(x, w, None, *p)


def conv_input_adjoint(s, w, x_shape, p):
    """Adjoint of the convolution w.r.t. its input (the gradient with ``s`` as output gradient)."""
    stride, padding, dilation, transposed, output_padding, groups = p
    x = torch.empty(x_shape, dtype=s.dtype, device=s.device)
    return aten.convolution_backward.default(s, x, w, None, stride, padding, dilation, transposed,
                                             output_padding, groups, [True, False, False])[0]


def z_box(x, w, p, relevance, eps, low, high):
    """z^B rule with per-sample lower/upper bounds ``low``, ``high`` (broadcastable to x)."""
    wp, wn = w.clamp(min=0), w.clamp(max=0)
    lo = low.expand_as(x)
    hi = high.expand_as(x)
    z = _conv(x, w, p) - _conv(lo, wp, p) - _conv(hi, wn, p)
    s = safe_divide(relevance, z, eps)
    return (x * conv_input_adjoint(s, w, x.shape, p) - lo * conv_input_adjoint(s, wp, x.shape, p)
            - hi * conv_input_adjoint(s, wn, x.shape, p))


def conv_alpha1_beta0(x, w, p, relevance, eps, joint=True):
    """alpha1-beta0 for a convolution (CVPR 2021 Eq. 5, ``layers_ours.Conv2d``); ``joint=False`` gives the
    LRP baseline's separate denominators (``layers_lrp.Conv2d`` at c3e578f)."""
    xp, xn = x.clamp(min=0), x.clamp(max=0)
    wp, wn = w.clamp(min=0), w.clamp(max=0)
    z1, z2 = _conv(xp, wp, p), _conv(xn, wn, p)
    s1 = safe_divide(relevance, z1 + z2 if joint else z1, eps)
    s2 = safe_divide(relevance, z1 + z2 if joint else z2, eps)
    return xp * conv_input_adjoint(s1, wp, x.shape, p) + xn * conv_input_adjoint(s2, wn, x.shape, p)


def _convolution(ctx, relevance, joint: bool):
    """z^B on a convolution that reads the pixels (per-sample bounds), else alpha1-beta0."""
    x, w = promote(ctx.args[0]), promote(ctx.args[1])
    p = tuple(ctx.args[3:9])
    if ctx.options.get("reads_pixels", {}).get(ctx.node.name, False):
        dims = list(range(1, x.dim()))
        low = x.amin(dim=dims, keepdim=True)
        high = x.amax(dim=dims, keepdim=True)
        rx = z_box(x, w, p, relevance, ctx.eps, low, high)
    else:
        rx = conv_alpha1_beta0(x, w, p, relevance, ctx.eps, joint=joint)
    return (rx,) + (None,) * (len(ctx.args) - 1)


@rule(aten.convolution.default, preset="chefer2021")
def convolution(ctx, relevance):
    """Patch embedding: z^B on pixels (supplementary §B); any other convolution: alpha1-beta0 with
    a joint denominator (Eq. 5)."""
    return _convolution(ctx, relevance, joint=True)


@rule(aten.convolution.default, preset="lrp")
def convolution_lrp_baseline(ctx, relevance):
    """Patch embedding: z^B on pixels (supplementary §B); any other convolution: the LRP
    baseline's separate denominators for x⁺W⁺ and x⁻W⁻ (``layers_lrp.Conv2d`` at c3e578f)."""
    return _convolution(ctx, relevance, joint=False)
