"""Convolutions: the patch embedding of vision transformers.

The first layer sees pixels, which are bounded, so the authors' code (``layers_ours.Conv2d`` when
the input has 3 channels) uses the z^B ("box") rule of Montavon et al. (2017), as in the CVPR 2021
supplementary §B, with per-sample bounds l = min(x), h = max(x)::

    z_j = Σ_i x_i w_ji − l w⁺_ji − h w⁻_ji        (bias ignored, z_j ≥ 0)
    R_i = Σ_j (x_i w_ji − l w⁺_ji − h w⁻_ji) / z_j · R_j

We apply z^B whenever the convolution reads the model's pixel input directly or through a
rearrangement of it (reshape, permute, expand: Qwen2-VL's rows of patches), whatever the number of
channels; where its first axis holds the patches of one image instead of samples, the bounds are
those of the whole input (``reads_pixels`` value ``"whole"``). Any other convolution gets the
preset's linear rule: alpha1-beta0 with a joint denominator for chefer2021 (``layers_ours.Conv2d``),
and for lrp the separate denominators of ``layers_lrp.Conv2d`` (x⁺W⁺ / z⁺ + x⁻W⁻ / z⁻, as
:func:`relprop.rules.linear.lrp_baseline`).
Both presets share z^B. Its denominator is ≥ 0; the authors add 1e-9 to it, as ``safe_divide`` does
where it is > 0 (where it is 0, a constant image, we give 0 and they divide by 1e-9).
"""
from __future__ import annotations

import torch

from .rule_registry import rule
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


def is_patchify(w, p) -> bool:
    """Whether a 2-d convolution with weight ``w`` and parameters ``p`` (stride, padding, dilation,
    transposed, output_padding, groups) cuts its input into non-overlapping patches, as a vision
    transformer's patch embedding does: kernel = stride, no padding, no dilation, one group."""
    stride, padding, dilation, transposed, output_padding, groups = p
    return (w.dim() == 4 and not transposed and groups == 1 and list(stride) == list(w.shape[2:])
            and all(q == 0 for q in padding) and all(d == 1 for d in dilation))


def to_patches(x, k):
    """[B, C, H, W] → [B, H/k₀·W/k₁, C·k₀·k₁]: the patches a patchifying convolution reads (the
    rows and columns past the last whole patch are left out, as the convolution leaves them)."""
    b, c, h, w = x.shape
    hp, wp = h // k[0], w // k[1]
    x = x[:, :, :hp * k[0], :wp * k[1]].reshape(b, c, hp, k[0], wp, k[1])
    return x.permute(0, 2, 4, 1, 3, 5).reshape(b, hp * wp, c * k[0] * k[1])


def from_patches(t, x_shape, k):
    """The inverse of :func:`to_patches`: [B, L, C·k₀·k₁] → [B, C, H, W], 0 on the left-out edge."""
    b, c, h, w = x_shape
    hp, wp = h // k[0], w // k[1]
    img = t.reshape(b, hp, wp, c, k[0], k[1]).permute(0, 3, 1, 4, 2, 5).reshape(b, c, hp * k[0], wp * k[1])
    if (hp * k[0], wp * k[1]) != (h, w):
        img = torch.nn.functional.pad(img, (0, w - wp * k[1], 0, h - hp * k[0]))
    return img


def z_box(x, w, p, relevance, eps, low, high):
    """z^B rule with per-sample lower/upper bounds ``low``, ``high`` (broadcastable to x)."""
    if is_patchify(w, p) and low.shape[1:] == high.shape[1:] == (1,) * (x.dim() - 1):
        return _z_box_patches(x, w, relevance, eps, low, high)
    wp, wn = w.clamp(min=0), w.clamp(max=0)
    lo = low.expand_as(x)
    hi = high.expand_as(x)
    z = _conv(x, w, p) - _conv(lo, wp, p) - _conv(hi, wn, p)
    z = _rounding_zeros(z, _conv(x.abs(), w.abs(), p) + _conv(lo.abs(), wp, p) - _conv(hi.abs(), wn, p))
    s = safe_divide(relevance, z, eps)
    return (x * conv_input_adjoint(s, w, x.shape, p) - lo * conv_input_adjoint(s, wp, x.shape, p)
            - hi * conv_input_adjoint(s, wn, x.shape, p))


def _rounding_zeros(z: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``z`` with 0 where it is within float rounding of 0: smaller than 16 units in the last place of
    ``scale``, the sum of its terms' magnitudes. z^B's z = Σ x w − l Σ w⁺ − h Σ w⁻ is exactly 0 for an
    image at its bounds (a constant image), but its float sum leaves a residue of rounding that depends
    on the order of the sum (the CPU's vector width), and ε-stabilized relevance divided by that
    residue is noise; at 0 the share is 0, as :func:`relprop.rules.stabilize.safe_divide` gives."""
    return z.masked_fill(z.abs() <= 16 * torch.finfo(z.dtype).eps * scale, 0.0)


def _z_box_patches(x, w, relevance, eps, low, high):
    """:func:`z_box` for a patchifying convolution with per-sample scalar bounds, as matrix products
    over the patches (same formula; the convolution's input adjoint is the transposed product).

    With P the patches, W the weight as [out, C·k·k] and l, h the bounds:
    z = P Wᵀ − l Σ W⁺ − h Σ W⁻ per output channel, and R_P = P ⊙ (S W) − l (S W⁺) − h (S W⁻)."""
    k = tuple(w.shape[2:])
    wm = w.reshape(w.shape[0], -1)  # [out, C·k·k]
    wp, wn = wm.clamp(min=0), wm.clamp(max=0)
    patches = to_patches(x, k)  # [B, L, C·k·k]
    lo, hi = low.reshape(-1, 1, 1), high.reshape(-1, 1, 1)
    z = patches @ wm.t() - lo * wp.sum(1) - hi * wn.sum(1)  # [B, L, out]
    z = _rounding_zeros(z, patches.abs() @ wm.abs().t() + lo.abs() * wp.sum(1) - hi.abs() * wn.sum(1))
    s = safe_divide(relevance.flatten(2).transpose(1, 2), z, eps)
    r = patches * (s @ wm) - lo * (s @ wp) - hi * (s @ wn)
    return from_patches(r, x.shape, k)


def conv_alpha1_beta0(x, w, p, relevance, eps, joint=True):
    """alpha1-beta0 for a convolution (CVPR 2021 Eq. 5, ``layers_ours.Conv2d``); ``joint=False`` gives the
    LRP baseline's separate denominators (``layers_lrp.Conv2d``)."""
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
    pixels = ctx.options.get("reads_pixels", {}).get(ctx.node.name, False)
    if pixels:
        dims = list(range(1 if pixels != "whole" else 0, x.dim()))  # "whole": patches of one image on axis 0
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
    baseline's separate denominators for x⁺W⁺ and x⁻W⁻ (``layers_lrp.Conv2d``)."""
    return _convolution(ctx, relevance, joint=False)
