"""Linear layers: ``aten.linear``, ``aten.addmm``, ``aten.mm`` and products with a constant matrix.

``"chefer2021"`` — LRP-alpha-beta with alpha=1, beta=0 (CVPR 2021, Eq. 5, as the authors'
``modules/layers_ours.py`` computes it): with x⁺ = max(x, 0), x⁻ = min(x, 0), W⁺ = max(W, 0),
W⁻ = min(W, 0), one joint denominator per output, bias ignored::

    z_j   = Σ_i x⁺_i W⁺_ji + x⁻_i W⁻_ji
    R_i   = Σ_j (x⁺_i W⁺_ji + x⁻_i W⁻_ji) / z_j · R_j

Every term is non-negative, so Σ_i R_i = Σ_j R_j wherever z_j ≠ 0: the rule conserves relevance.
Its denominator is computed as ½(xW + |x||W|) and its adjoint as ½(x ⊙ (S Wᵀ) + |x| ⊙ (S |W|ᵀ))
(:func:`alpha1_beta0`), with xW read from the layer's forward output: three matrix products per
layer instead of four, and neither x nor W split into signed parts.

``"lrp"`` — the linear rule of the authors' LRP *baseline* (``Linear.relprop`` of
``modules/layers_lrp.py`` and ``BERT_explainability/modules/layers_lrp.py`` of
hila-chefer/Transformer-Explainability, called with alpha=1), which the paper's LRP and
partial-LRP numbers come from: the x⁺W⁺ and x⁻W⁻ parts each have their own denominator, bias
ignored::

    z⁺_j  = Σ_i x⁺_i W⁺_ji          z⁻_j = Σ_i x⁻_i W⁻_ji
    R_i   = Σ_j x⁺_i W⁺_ji / z⁺_j · R_j  +  Σ_j x⁻_i W⁻_ji / z⁻_j · R_j

Each part alone passes Σ_j R_j (over the outputs where its z is not 0), so the layer returns about
2 Σ_j R_j: NOT conservative. Both z are ≥ 0, so the authors'
stabilizer (+1e-9 on every non-zero denominator) and ours (1e-9 away from 0 in the sign's
direction, :mod:`relprop.rules.stabilize`) give the same numbers here.
"""
from __future__ import annotations

import torch

from ..errors import UnsupportedOperation
from ..graph.host_reads import expect, speculating
from ..graph.nodes import module_type
from .rule_registry import rule
from .stabilize import on_relevant_rows, promote, safe_divide, safe_divide_nonnegative, scratch, times_fresh

aten = torch.ops.aten


def weight_abs(w: torch.Tensor, cache: dict = None, node=None) -> torch.Tensor:
    """``|W|`` for ``w`` of shape [..., out, in], in the relevance's precision (float32 at least),
    memoized in ``cache``.

    The memo is keyed by the weight's memory (address, shape, strides, dtype, device), so all the
    captures of one model share an entry per weight, and checked against the version counter, so
    an in-place update of the parameter is seen at once. An entry holds the weight's storage, so no
    other tensor can be given that address while the entry lives (a parameter the user replaced,
    ``module.weight = Parameter(...)`` or ``p.data = ...``, would otherwise leave its address and
    version 0 to a new tensor, and the memo would return the old |W|); the entry of the weight a graph
    node read before is dropped when that node reads another one. ``node`` (the graph node's name)
    says the caller wants the memo used.
    """
    if cache is None or node is None:
        return promote(w).abs()  # float32 at least (float64 kept)
    key = ("abs", w.data_ptr(), tuple(w.shape), w.stride(), w.dtype, w.device)
    before = cache.get(("node", node))
    if before is not None and before != key:
        cache.pop(before, None)  # (the node reads another weight now: the old one is not kept alive)
    cache[("node", node)] = key
    hit = cache.get(key)
    if hit is not None and hit[0] == w._version:
        return hit[1]
    abs_w = promote(w).abs()
    cache[key] = (w._version, abs_w, w.untyped_storage())
    return abs_w


def alpha1_beta0(x: torch.Tensor, w: torch.Tensor, relevance: torch.Tensor, eps: float, xw=None,
                 abs_wt=None, xw_scratch: bool = False) -> torch.Tensor:
    """Relevance of ``x`` for ``z = x @ w`` under LRP-alpha1beta0 with a joint denominator (Eq. 5).

    ``w`` is [in, out] (or batched [..., in, out]); ``x`` is [..., in]; ``relevance`` is [..., out].
    ``xw`` may pass ``x @ w`` (a linear layer's own forward output less its bias) and ``abs_wt``
    ``|wᵀ|`` (:func:`weight_abs` of the layer's weight); ``xw_scratch``: ``xw`` is the caller's
    own temporary (the rule may overwrite it).

    Both halves of the rule use x⁺W⁺ + x⁻W⁻ = ½(xW + |x||W|), so neither x nor W is split:

    * the denominator z = ½(xW + |x||W|): one matrix product when ``xw`` is given;
    * the adjoint x⁺ ⊙ (S W⁺ᵀ) + x⁻ ⊙ (S W⁻ᵀ) = ½(x ⊙ (S Wᵀ) + |x| ⊙ (S |W|ᵀ)), with S = R / z:
      two matrix products, on W itself and on the |W| of the denominator.

    x_i = 0 gives R_i = 0 exactly. In floating point the identity differs from the split terms by
    rounding of the order of the unit roundoff times |x||W| (denominator) and |x| (S |W|ᵀ)
    (adjoint); so that R ≥ 0 still gives R_x ≥ 0 exactly, as Eq. 5's non-negative terms do, a
    non-negative S clamps the (rounding-sized) negative values at 0. Outputs whose z is below
    :data:`SMALL_Z` times |x||W| (cancellation) are recomputed from the split terms.
    """
    if abs_wt is None:
        abs_wt = w.transpose(-1, -2).abs()  # [..., out, in]
    if xw is None:
        xw, xw_scratch = x @ w, True
    abs_x = x.abs()
    den = abs_x @ abs_wt.transpose(-1, -2)  # Σ|x||W| >= z: the scale of the rounding error of z
    # the temporaries are overwritten where they are not read again (the same values: on long
    # inputs each new [tokens, features] tensor is memory the kernel faults in). The halves are
    # not taken: with 2z = xW + |x||W| and 2ε, S/2 = R / (2z + 2ε) and the adjoint's
    # ½(x ⊙ (S Wᵀ) + |x| ⊙ (S |W|ᵀ)) = x ⊙ ((S/2) Wᵀ) + |x| ⊙ ((S/2) |W|ᵀ) exactly (a factor 2 is exact
    # in binary floating point): two passes fewer, the same bits.
    z2 = xw.add_(den) if xw_scratch and scratch(xw, den) and xw.shape == den.shape else xw + den
    half = safe_divide_nonnegative(relevance, z2, 2 * eps)  # S/2; z < 0 (rounding) is below SMALL_Z: recomputed
    small = z2 < (den.mul_(2 * SMALL_Z) if scratch(den) else den * (2 * SMALL_Z))
    del den
    exact = None
    if speculating():  # no output cancels (checked with the call's other reads: relprop.graph.host_reads)
        expect(small.any(), "no output of a linear layer's Eq. 5 denominator cancels in float32")
    elif bool(small.any()):  # cancellation: these outputs are recomputed from the split terms
        half, exact = _exact_columns(x, w, relevance, eps, half, small)
    s = half
    rx = times_fresh(s @ w.transpose(-1, -2), x)
    rx.addcmul_(abs_x, s @ abs_wt)
    if s.numel():  # Eq. 5's terms are >= 0 for S >= 0: drop rounding below 0 (decided on the device)
        rx.clamp_(min=torch.where(s.amin() < 0, -torch.inf, 0.0).to(rx.dtype))
    return rx if exact is None else rx.add_(exact)


#: outputs whose z = ½(xW + |x||W|) is below this fraction of |x||W| lose more than ~2⁻¹² of their
#: relative precision to cancellation in float32; :func:`alpha1_beta0` recomputes them from the
#: split terms x⁺W⁺ + x⁻W⁻ (as Eq. 5 is written), which never cancel
SMALL_Z = 2.0 ** -12


def _exact_columns(x, w, relevance, eps, s, small):
    """Eq. 5 on the split terms for the outputs flagged in ``small`` (all of them for a batched
    ``w``); returns ``s`` with those outputs zeroed and their relevance for ``x``."""
    if w.dim() == 2:
        cols = small.reshape(-1, small.shape[-1]).any(0).nonzero().squeeze(1)
        wc, rc = w[:, cols], relevance[..., cols]
        s = s.index_fill(-1, cols, 0.0)
    else:
        wc, rc, s = w, relevance, torch.zeros_like(s)
    xp, xn, wp, wn = x.clamp(min=0), x.clamp(max=0), wc.clamp(min=0), wc.clamp(max=0)
    sc = safe_divide(rc, xp @ wp + xn @ wn, eps)
    return s, xp * (sc @ wp.transpose(-1, -2)) + xn * (sc @ wn.transpose(-1, -2))


def _forward_product(ctx, x):
    """``x Wᵀ`` of ``aten.linear`` read from the node's forward output (less the bias), when that
    output was computed in the relevance's precision; else None (recomputed by the rule)."""
    out, w = ctx.out, ctx.args[1]
    if not torch.is_tensor(out) or not torch.is_tensor(w) or w.dtype != x.dtype or out.dtype != x.dtype \
            or out.shape[-1] != w.shape[0]:
        return None
    bias = ctx.args[2] if len(ctx.args) > 2 else ctx.kwargs.get("bias")
    if bias is None:
        return out
    if not torch.is_tensor(bias) or (len(ctx.live) > 2 and ctx.live[2] is True):
        return None
    return out - promote(bias)  # a new tensor: alpha1_beta0 may overwrite it (xw_scratch)


def lrp_baseline(x: torch.Tensor, w: torch.Tensor, relevance: torch.Tensor, eps: float, split=None) -> torch.Tensor:
    """Relevance of ``x`` for ``z = x @ w`` under the authors' LRP-baseline linear rule
    (``layers_lrp.Linear``): the x⁺W⁺ part divided by z⁺ = x⁺W⁺, the x⁻W⁻ part by z⁻ = x⁻W⁻ (not
    conservative).

    ``w`` is [in, out] (or batched [..., in, out]); ``x`` is [..., in]; ``relevance`` is [..., out].
    """
    xp, xn = x.clamp(min=0), x.clamp(max=0)
    wp, wn = w.clamp(min=0), w.clamp(max=0)
    s_pos = safe_divide(relevance, xp @ wp, eps)
    s_neg = safe_divide(relevance, xn @ wn, eps)
    return xp * (s_pos @ wp.transpose(-1, -2)) + xn * (s_neg @ wn.transpose(-1, -2))


def require_constant_weight(ctx, weight_pos):
    """Refuse a "linear layer" whose weight depends on the input (it is a product of two live tensors)."""
    if ctx.live[weight_pos] is True:
        raise UnsupportedOperation(ctx.node.target, ctx.module_path, module_type(ctx.node), ctx.preset,
                                   detail="Its weight depends on the input, so it is not a linear layer.")


@rule(aten.linear.default, preset="chefer2021", formula=alpha1_beta0)
def linear(ctx, relevance):
    """``y = x Wᵀ + b``: LRP-alpha1beta0 with a joint denominator (CVPR 2021, Eq. 5); bias ignored."""
    require_constant_weight(ctx, 1)
    x, w = promote(ctx.args[0]), ctx.args[1]
    abs_w = weight_abs(w, ctx.options.get("weight_cache"), ctx.node.name)
    xw = _forward_product(ctx, x)
    wt = promote(w).t()

    def rule_on(r, xs, xws):  # (on the positions with relevance only: on_relevant_rows)
        return alpha1_beta0(xs, wt, r, ctx.eps, xw=xws, abs_wt=abs_w,
                            xw_scratch=xws is not None and (xws is not ctx.out or xs is not x))
    rx = on_relevant_rows(rule_on, relevance, x, xw, bound=ctx.relevant_rows)
    return (rx,) + (None,) * (len(ctx.args) - 1)


@rule(aten.linear.default, preset="lrp", formula=lrp_baseline)
def linear_lrp_baseline(ctx, relevance):
    """``y = x Wᵀ + b``: the authors' LRP-baseline linear rule, separate denominators for x⁺W⁺ and x⁻W⁻
    (``layers_lrp.Linear``; :func:`lrp_baseline`); bias ignored."""
    require_constant_weight(ctx, 1)
    wt = promote(ctx.args[1]).t()
    rx = on_relevant_rows(lambda r, xs: lrp_baseline(xs, wt, r, ctx.eps), relevance, promote(ctx.args[0]),
                          bound=ctx.relevant_rows)
    return (rx,) + (None,) * (len(ctx.args) - 1)


@rule(aten.addmm.default, preset="chefer2021", formula=alpha1_beta0)
def addmm(ctx, relevance):
    """``y = b + x @ W`` (GPT-2's Conv1D): LRP-alpha1beta0 (Eq. 5), bias ignored."""
    require_constant_weight(ctx, 2)
    return (None, alpha1_beta0(promote(ctx.args[1]), promote(ctx.args[2]), relevance, ctx.eps), None)


@rule(aten.addmm.default, preset="lrp", formula=lrp_baseline)
def addmm_lrp_baseline(ctx, relevance):
    """``y = b + x @ W`` (GPT-2's Conv1D): the authors' LRP-baseline linear rule (``layers_lrp.Linear``;
    :func:`lrp_baseline`), bias ignored."""
    require_constant_weight(ctx, 2)
    return (None, lrp_baseline(promote(ctx.args[1]), promote(ctx.args[2]), relevance, ctx.eps), None)


def linear_formula(ctx):
    """The formula the active preset's rule for ``aten.linear`` declares (``@rule(..., formula=...)``,
    :attr:`relprop.rules.spec.RuleSpec.formula`)."""
    spec = ctx.rule_for(aten.linear.default)
    fn = spec.formula if spec is not None else None
    if fn is None:
        raise UnsupportedOperation(ctx.node.target, ctx.module_path, module_type(ctx.node), ctx.preset,
                                   detail="It multiplies by a constant matrix, and the preset's rule for "
                                          "aten.linear.default declares no formula (x, w, relevance, eps) -> R_x to "
                                          "apply to it (@relprop.rule(..., formula=...)).")
    return fn


def constant_matrix_product(ctx, relevance):
    """``x @ W`` or ``W @ x`` with one constant operand: a linear layer, so the active preset's
    linear formula (:func:`linear_formula`) on the live operand."""
    a, b = ctx.args[0], ctx.args[1]
    if ctx.live[0] is True and ctx.live[1] is not True:
        fn = linear_formula(ctx)
        if b.dim() == 1:
            return (fn(promote(a), promote(b).unsqueeze(-1), relevance.unsqueeze(-1), ctx.eps), None)
        return (fn(promote(a), promote(b), relevance, ctx.eps), None)
    if ctx.live[1] is True and ctx.live[0] is not True:
        fn = linear_formula(ctx)
        if a.dim() == 1:
            r = fn(promote(b).transpose(-1, -2), promote(a).unsqueeze(-1), relevance.unsqueeze(-1), ctx.eps)
            return (None, r.transpose(-1, -2))
        # (W x)^T = x^T W^T
        r = fn(promote(b).transpose(-1, -2), promote(a).transpose(-1, -2), relevance.transpose(-1, -2), ctx.eps)
        return (None, r.transpose(-1, -2))
    return (None, None)
