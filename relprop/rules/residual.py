"""Sums: the residual connections (and adds of constants such as position embeddings or masks).

``"chefer2021"`` (CVPR 2021, Eq. 6 and the normalization after Eq. 9, Lemma 2): the z-rule gives
each operand u, v its share ``R_u = u ⊙ R / (u + v)``; then each share is rescaled so that its total
is ``|Σ R_u| / (|Σ R_u| + |Σ R_v|) · Σ R``. The rescaled shares sum to Σ R (conservation) and each
lies between 0 and Σ R. The authors' code takes the sums over the whole tensor, batch included;
we take them per sample, so a batch explains like its samples one by one.
A constant operand (position embedding, class-token bias, attention mask) keeps its share: it is
reported as absorbed.

``"lrp"`` (the authors' LRP baseline: ``Add`` of ``modules/layers_lrp.py``, a
``RelPropSimple``, i.e. gradient × input): the z-rule alone, not normalized. The authors'
stabilizer adds +1e-9 to every non-zero z, also a negative one; ours moves z 1e-9 away from 0 in the
direction of its sign (:mod:`relprop.rules.stabilize`), which differs only where |z| is within a few
1e-9 of 0 (``benchmarks/authors_reference.py`` measures what this changes).
Adding a Python number (``x + 1e-6``) passes the relevance to x unchanged in both presets.
"""
from __future__ import annotations

import torch

from ..graph.aliasing import shares_memory
from .rule_registry import rule
from .stabilize import finite, promote, safe_divide, scratch, times_fresh

aten = torch.ops.aten


def z_rule_sum(u, v, z, relevance, eps, z_writable: bool = False):
    """Z-rule shares of a sum ``z = u + v`` (Eq. 6), both shaped like ``z``. ``z_writable``: ``z``
    is dead after this rule (:attr:`relprop.rules.context.RuleContext.out_writable`), and u ⊙ S
    goes into its buffer once S = R / z is computed."""
    s = safe_divide(relevance, z, eps)
    if not (scratch(u, v, s) and s.shape == z.shape and s.dtype == torch.promote_types(s.dtype, v.dtype)):
        return finite(u * s), finite(v * s)
    # the same values with two tensor-sized allocations instead of four (one, when z is writable):
    # S's buffer takes v ⊙ S, z's takes u ⊙ S
    if z_writable and z.dtype == torch.promote_types(u.dtype, s.dtype) and z.is_contiguous() \
            and not shares_memory(z, u, v):
        ru = torch.mul(u, s, out=z)
    else:
        ru = u * s
    ru = torch.nan_to_num_(ru, nan=0.0, posinf=0.0, neginf=0.0)
    return ru, torch.nan_to_num_(s.mul_(v), nan=0.0, posinf=0.0, neginf=0.0)


def lemma2_factors(sums, total: torch.Tensor, eps: float):
    """The per-sample factors (gu, gv) of :func:`normalize_shares` from the per-sample sums
    ``sums`` = (Σ R_u, Σ R_v) of the z-rule's shares and ``total`` = Σ R ([batch] each): gu · Σ R_u =
    |Σ R_u| / (|Σ R_u| + |Σ R_v|) · Σ R, and the same for v (CVPR 2021 after Eq. 9; Lemma 2)."""
    su, sv = sums
    den = su.abs() + sv.abs()
    fu = safe_divide(su.abs() * total, den, 0.0)
    fv = safe_divide(sv.abs() * total, den, 0.0)
    return safe_divide(fu, su, eps), safe_divide(fv, sv, eps)


def normalize_shares(ctx, ru, rv, relevance, eps, fresh: bool = False):
    """Rescale two shares per sample so they conserve Σ R (CVPR 2021 after Eq. 9; Lemma 2), by the
    factors :func:`lemma2_factors` gives from the sums over the whole tensors, which the rule's context
    provides (:meth:`relprop.rules.context.RuleContext.share_factors`). A context that defers them
    (a chunk of query rows: the sums are over all the chunks) gets ``ru`` and ``rv`` back unscaled and
    scales them itself. ``fresh``: ``ru`` and ``rv`` are the caller's own temporaries and are
    rescaled in place."""
    g = ctx.share_factors((ru, rv), relevance, lambda sums, total: lemma2_factors(sums, total, eps))
    if g is None:
        return ru, rv
    gu, gv = ctx.per_sample(g[0], ru), ctx.per_sample(g[1], rv)
    if fresh:
        return times_fresh(ru, gu), times_fresh(rv, gv)
    return ru * gu, rv * gv


def _sum_rule(ctx, relevance, sign: float, normalize: bool):
    u, v = ctx.args[0], ctx.args[1]
    alpha = ctx.kwargs.get("alpha", ctx.args[2] if len(ctx.args) > 2 else 1)
    if not torch.is_tensor(v):
        return (relevance,) + (None,) * (len(ctx.args) - 1)
    if not torch.is_tensor(u):
        return (None, relevance) + (None,) * (len(ctx.args) - 2)
    z = promote(ctx.out)
    uu = promote(u).expand_as(z)
    vv = (sign * alpha * promote(v)).expand_as(z)
    ru, rv = z_rule_sum(uu, vv, z, relevance, ctx.eps, z_writable=ctx.out_writable and z is ctx.out)
    if normalize:
        ru, rv = normalize_shares(ctx, ru, rv, relevance, ctx.eps, fresh=True)
    return (ru, rv) + (None,) * (len(ctx.args) - 2)


@rule(aten.add.Tensor, preset="chefer2021", writes_out=True)  # _sum_rule computes u ⊙ S into z when allowed
def residual_add(ctx, relevance):
    """u + v: z-rule shares, normalized per sample (Eq. 6 + Lemma 2)."""
    return _sum_rule(ctx, relevance, 1.0, normalize=True)


@rule(aten.sub.Tensor, preset="chefer2021", writes_out=True)  # _sum_rule computes u ⊙ S into z when allowed
def residual_sub(ctx, relevance):
    """u - v, as u + (-v): z-rule shares, normalized per sample (Eq. 6 + Lemma 2)."""
    return _sum_rule(ctx, relevance, -1.0, normalize=True)


@rule(aten.add.Tensor, preset="lrp", writes_out=True)  # _sum_rule computes u ⊙ S into z when allowed
def add_z_rule(ctx, relevance):
    """u + v: plain z-rule shares, not normalized (CVPR 2021 Eq. 6 alone; the authors' LRP baseline,
    ``layers_lrp.Add``)."""
    return _sum_rule(ctx, relevance, 1.0, normalize=False)


@rule(aten.sub.Tensor, preset="lrp", writes_out=True)  # _sum_rule computes u ⊙ S into z when allowed
def sub_z_rule(ctx, relevance):
    """u - v, as u + (-v): plain z-rule shares, not normalized (as ``layers_lrp.Add``)."""
    return _sum_rule(ctx, relevance, -1.0, normalize=False)


@rule(aten.add.Scalar, aten.sub.Scalar, preset=("chefer2021", "lrp"))
def add_number(ctx, relevance):
    """x + c for a Python number c: R passes to x unchanged (the authors' code adds such numbers
    outside its modules, e.g. LayerNorm's ε, so they have no rule there)."""
    return (relevance, None, None)[: len(ctx.args)]
