"""Linear layers: ``aten.linear``, ``aten.addmm``, ``aten.mm`` and products with a constant matrix.

``"chefer2021"`` — LRP-alpha-beta with alpha=1, beta=0 (CVPR 2021, Eq. 5, as the authors'
``modules/layers_ours.py`` computes it): with x⁺ = max(x, 0), x⁻ = min(x, 0), W⁺ = max(W, 0),
W⁻ = min(W, 0), one joint denominator per output, bias ignored::

    z_j   = Σ_i x⁺_i W⁺_ji + x⁻_i W⁻_ji
    R_i   = Σ_j (x⁺_i W⁺_ji + x⁻_i W⁻_ji) / z_j · R_j

Every term is non-negative, so Σ_i R_i = Σ_j R_j wherever z_j ≠ 0: the rule conserves relevance.

``"lrp"`` — the linear rule of the authors' LRP *baseline* (``modules/layers_lrp.py``), kept as the
code has it because the paper's LRP and partial-LRP numbers come from it: the x⁺W⁺ part is divided
by the joint denominator z⁺ + z⁻ (z⁺ = x⁺W⁺, z⁻ = x⁻W⁻) but the x⁻W⁻ part by 2·z⁻. Its total is
Σ_j R_j (z⁺_j / (z⁺_j + z⁻_j) + 1/2): NOT conservative. (DESIGN.md describes this as "separate
denominators"; the code's denominator for the second part is ``Z2 + Z2``. We follow the code.)
"""
from __future__ import annotations

import torch

from ..errors import UnsupportedOperation
from .context import module_type
from .registry import rule
from .stabilize import safe_divide

aten = torch.ops.aten


def signed_split(w: torch.Tensor, cache: dict = None, key=None) -> torch.Tensor:
    """``cat([W⁺, W⁻], dim=-1)`` for ``w`` of shape [..., out, in] (memoized in ``cache``).

    The memo is keyed by the weight's memory (address, shape, strides, dtype, device), so all the
    captures of one model share an entry per weight, and checked against the version counter, so
    an in-place update of the parameter is seen at once. ``key`` (the graph node) only says the
    caller wants the memo used.
    """
    if cache is not None and key is not None:
        key = (w.data_ptr(), tuple(w.shape), w.stride(), w.dtype, w.device)
        stamp = w._version
        hit = cache.get(key)
        if hit is not None and hit[0] == stamp:
            return hit[1]
    wf = w.to(torch.promote_types(w.dtype, torch.float32))  # float32 at least (float64 kept)
    split = torch.cat([wf.clamp(min=0), wf.clamp(max=0)], dim=-1)
    if cache is not None and key is not None:
        cache[key] = (stamp, split)
    return split


def _signed_x(x):
    return torch.cat([x.clamp(min=0), x.clamp(max=0)], dim=-1)


def alpha1_beta0(x: torch.Tensor, w: torch.Tensor, relevance: torch.Tensor, eps: float, split=None) -> torch.Tensor:
    """Relevance of ``x`` for ``z = x @ w`` under LRP-alpha1beta0 with a joint denominator (Eq. 5).

    ``w`` is [in, out] (or batched [..., in, out]); ``x`` is [..., in]; ``relevance`` is [..., out].
    ``split`` may pass ``signed_split(wᵀ)`` precomputed. Computed as two matrix products on the
    concatenations [x⁺, x⁻] and [W⁺, W⁻]: z = [x⁺, x⁻]·[W⁺; W⁻] and the adjoint S·[W⁺, W⁻],
    exactly the terms of Eq. 5, without ever cancelling positive against negative products.
    """
    n = x.shape[-1]
    if split is None:
        split = signed_split(w.transpose(-1, -2))  # [..., out, 2 in]
    xs = _signed_x(x)
    z = xs @ split.transpose(-1, -2)
    s = safe_divide(relevance, z, eps)
    back = (s @ split) * xs  # [..., 2 in]: x⁺ (S W⁺) and x⁻ (S W⁻)
    return back[..., :n] + back[..., n:]


def lrp_baseline(x: torch.Tensor, w: torch.Tensor, relevance: torch.Tensor, eps: float, split=None) -> torch.Tensor:
    """Relevance of ``x`` for ``z = x @ w`` under the authors' LRP-baseline linear rule (not conservative)."""
    xp, xn = x.clamp(min=0), x.clamp(max=0)
    wp, wn = w.clamp(min=0), w.clamp(max=0)
    z1 = xp @ wp
    z2 = xn @ wn
    s1 = safe_divide(relevance, z1 + z2, eps)
    s2 = safe_divide(relevance, z2 + z2, eps)
    return xp * (s1 @ wp.transpose(-1, -2)) + xn * (s2 @ wn.transpose(-1, -2))


_LINEAR_RULES = {"chefer2021": alpha1_beta0, "lrp": lrp_baseline}


def _rule_for(ctx):
    return _LINEAR_RULES.get(ctx.preset, alpha1_beta0)


def _require_constant_weight(ctx, weight_pos):
    if ctx.live[weight_pos] is True:
        raise UnsupportedOperation(ctx.node.target, ctx.module_path, module_type(ctx.node), ctx.preset,
                                   detail="Its weight depends on the input, so it is not a linear layer.")


@rule(aten.linear.default, preset=("chefer2021", "lrp"))
def linear(ctx, relevance):
    """``y = x Wᵀ + b``: alpha1-beta0 (chefer2021, Eq. 5) or the LRP baseline (lrp); bias ignored."""
    _require_constant_weight(ctx, 1)
    x, w = ctx.args[0].float(), ctx.args[1]
    fn = _rule_for(ctx)
    split = None
    if fn is alpha1_beta0:
        split = signed_split(w, ctx.options.get("weight_cache"), ctx.node.name)
    rx = fn(x, w.float().t(), relevance, ctx.eps, split=split)
    return (rx,) + (None,) * (len(ctx.args) - 1)


@rule(aten.addmm.default, preset=("chefer2021", "lrp"))
def addmm(ctx, relevance):
    """``y = b + x @ W`` (GPT-2's Conv1D): same rule as :func:`linear`, bias ignored."""
    _require_constant_weight(ctx, 2)
    x, w = ctx.args[1].float(), ctx.args[2].float()
    return (None, _rule_for(ctx)(x, w, relevance, ctx.eps), None)


def constant_matrix_product(ctx, relevance):
    """``x @ W`` or ``W @ x`` with one constant operand: the linear rule on the live operand."""
    a, b = ctx.args[0], ctx.args[1]
    fn = _rule_for(ctx)
    if ctx.live[0] is True and ctx.live[1] is not True:
        if b.dim() == 1:
            return (fn(a.float(), b.float().unsqueeze(-1), relevance.unsqueeze(-1), ctx.eps), None)
        return (fn(a.float(), b.float(), relevance, ctx.eps), None)
    if ctx.live[1] is True and ctx.live[0] is not True:
        if a.dim() == 1:
            r = fn(b.float().transpose(-1, -2), a.float().unsqueeze(-1), relevance.unsqueeze(-1), ctx.eps)
            return (None, r.transpose(-1, -2))
        # (W x)^T = x^T W^T
        r = fn(b.float().transpose(-1, -2), a.float().transpose(-1, -2), relevance.transpose(-1, -2), ctx.eps)
        return (None, r.transpose(-1, -2))
    return (None, None)
