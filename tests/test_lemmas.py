"""Property tests of the conservation lemmas of Chefer, Gur & Wolf (CVPR 2021) on the rule helpers.

Random shapes come from hypothesis strategies, random tensors from hypothesis-drawn seeds (or
``hypothesis.extra.numpy`` arrays for the stabilizer). Premises of the lemmas (z ≠ 0, no
cancellation) are met by construction where possible, else filtered with ``assume``.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.fx
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from relprop.rules import rule_registry as registry
from relprop.rules.context import RuleContext
from relprop.rules.convolution import conv_alpha1_beta0, z_box
from relprop.rules.linear import alpha1_beta0, lrp_baseline
from relprop.rules.products import z_rule_matmul
from relprop.rules.residual import normalize_shares, z_rule_sum
from relprop.rules.stabilize import DEFAULT_EPS, safe_divide

aten = torch.ops.aten
EPS = 1e-9
PROPS = settings(max_examples=40, deadline=None)

seeds = st.integers(0, 2**31 - 1)
dims = st.integers(1, 4)
shapes = st.lists(dims, min_size=1, max_size=3).map(tuple)


def randn(shape, seed, dtype=torch.float64):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def away_from_zero(shape, seed, margin=0.2, dtype=torch.float64):
    """Values of random sign with magnitude in [margin, margin + 1)."""
    g = torch.Generator().manual_seed(seed)
    mag = margin + torch.rand(shape, generator=g, dtype=torch.float64)
    sign = torch.where(torch.rand(shape, generator=g, dtype=torch.float64) < 0.5, -1.0, 1.0)
    return (sign * mag).to(dtype)


def ctx_for(out, batch_dim=0, op=aten.add.Tensor, args=(), live=(), preset="chefer2021"):
    node = torch.fx.Graph().call_function(op, ())
    return RuleContext(node=node, args=tuple(args), kwargs={}, out=out, live=tuple(live), batch_dim=batch_dim,
                       batch_size=out.shape[batch_dim], eps=EPS, preset=preset)


def stab_tol(R, z, eps=EPS, rel=1e-10):
    """Error the stabilizer may introduce: R_j z_j / (z_j ± eps) differs from R_j by ≈ |R_j| eps / |z_j|,
    plus float64 rounding (outputs with z_j = 0 must have R_j = 0 or be excluded by the caller)."""
    zz = z.abs().double()
    lost = torch.where(zz > 0, R.abs().double() * eps / zz.clamp(min=1e-300), torch.zeros((), dtype=torch.float64))
    return float(lost.sum()) + rel * (1 + float(R.abs().double().sum()))


def per_sample(t, batch_dim):
    return t.movedim(batch_dim, 0).reshape(t.shape[batch_dim], -1).sum(1)


# ------------------------------------------------------------------------------------------------
# Lemma 1 (i): the z-rule on an add conserves
# ------------------------------------------------------------------------------------------------
@PROPS
@given(shape=shapes, seed=seeds, scale=st.sampled_from([1e-3, 1.0, 1e3]))
def test_lemma1_i_add_conserves(shape, seed, scale):
    """Lemma 1 (i) / Eq. 7: for z = u + v (z ≠ 0), Σ R_u + Σ R_v = Σ R under the z-rule (Eq. 6)."""
    u = randn(shape, seed) * scale
    z = away_from_zero(shape, seed + 1) * scale
    v = z - u
    R = randn(shape, seed + 2)
    ru, rv = z_rule_sum(u, v, u + v, R, EPS)
    tol = stab_tol(R, z) + 1e-12 * float(ru.abs().sum() + rv.abs().sum())
    assert abs(float(ru.sum() + rv.sum() - R.sum())) <= tol


# ------------------------------------------------------------------------------------------------
# Lemma 1 (ii): on a matmul each z-rule share carries the whole relevance
# ------------------------------------------------------------------------------------------------
@PROPS
@given(lead=st.lists(st.integers(1, 3), max_size=2).map(tuple), n=dims, k=dims, m=dims, seed=seeds)
def test_lemma1_ii_matmul_each_share_sums_to_total(lead, n, k, m, seed):
    """Lemma 1 (ii) / supp. Lemma 3: for z = ab, Σ R_a = Σ R and Σ R_b = Σ R, so together 2 Σ R."""
    a, b = randn(lead + (n, k), seed), randn(lead + (k, m), seed + 1)
    z = a @ b
    R = torch.where(z.abs() > 1e-3, randn(z.shape, seed + 2), torch.zeros(()).double())  # premise z ≠ 0
    ra, rb = z_rule_matmul(a, b, z, R, EPS)
    total = float(R.sum())
    tol = stab_tol(R, z) + 1e-12 * float(ra.abs().sum() + rb.abs().sum())
    assert abs(float(ra.sum()) - total) <= tol
    assert abs(float(rb.sum()) - total) <= tol
    assert abs(float(ra.sum() + rb.sum()) - 2 * total) <= 2 * tol


@PROPS
@given(lead=st.lists(st.integers(1, 3), max_size=2).map(tuple), n=dims, k=dims, m=dims, seed=seeds)
def test_lemma1_ii_registered_matmul_halving_conserves(lead, n, k, m, seed):
    """Lemma 1 (ii) + §3.2 (authors' Attention.relprop): after halving, Σ R_a + Σ R_b = Σ R."""
    a, b = randn(lead + (n, k), seed, torch.float32), randn(lead + (k, m), seed + 1, torch.float32)
    z = a @ b
    R = torch.where(z.abs() > 0.1, randn(z.shape, seed + 2, torch.float32), torch.zeros(()))
    fn = registry.lookup("chefer2021", aten.matmul.default)
    ra, rb = fn(ctx_for(z, 0, aten.matmul.default, (a, b), (True, True)), R)
    total = float(R.double().sum())
    tol = 1e-5 * (1 + float(ra.abs().sum() + rb.abs().sum()))
    assert abs(float(ra.double().sum()) - total / 2) <= tol
    assert abs(float(rb.double().sum()) - total / 2) <= tol
    assert abs(float(ra.double().sum() + rb.double().sum()) - total) <= tol


# ------------------------------------------------------------------------------------------------
# Lemma 2: the normalization conserves and bounds each share
# ------------------------------------------------------------------------------------------------
def _draw_shares(shape, seed, source):
    R = randn(shape, seed + 2)
    if source == "z_rule":
        u = randn(shape, seed)
        v = away_from_zero(shape, seed + 1) - u
        ru, rv = z_rule_sum(u, v, u + v, R, EPS)
    else:  # any two shares whatever produced them
        ru, rv = randn(shape, seed) * 3, randn(shape, seed + 1)
    return ru, rv, R


batched_shapes = st.tuples(st.integers(1, 4), st.lists(dims, min_size=1, max_size=2).map(tuple))


@PROPS
@given(bshape=batched_shapes, batch_dim=st.sampled_from([0, 1]), seed=seeds,
       source=st.sampled_from(["z_rule", "arbitrary"]), positive=st.booleans())
def test_lemma2_normalization_conserves_and_bounds(bshape, batch_dim, seed, source, positive):
    """Lemma 2 (i) Σ R̄_u + Σ R̄_v = Σ R and (ii) 0 ≤ Σ R̄_u, Σ R̄_v ≤ Σ R (Eq. 10), per sample."""
    B, rest = bshape
    shape = (B,) + rest
    ru, rv, R = _draw_shares(shape, seed, source)
    if positive:
        R = R.abs() + 1e-3
    if batch_dim == 1:  # e.g. sequence-first layouts [N, B, D]
        ru, rv, R = (t.movedim(0, 1) for t in (ru, rv, R))
    assert R.shape[batch_dim] == B
    su, sv = per_sample(ru, batch_dim), per_sample(rv, batch_dim)
    assume(bool(((su.abs() > 1e-6) | (sv.abs() > 1e-6)).all()))
    nu, nv = normalize_shares(ctx_for(R, batch_dim), ru, rv, R, EPS)
    tu, tv, tot = per_sample(nu, batch_dim), per_sample(nv, batch_dim), per_sample(R, batch_dim)
    tol = 1e-6 * (1 + tot.abs())
    assert bool(((tu + tv - tot).abs() <= tol).all())
    lo, hi = torch.minimum(tot, torch.zeros(())), torch.maximum(tot, torch.zeros(()))
    assert bool(((tu >= lo - tol) & (tu <= hi + tol)).all())
    assert bool(((tv >= lo - tol) & (tv <= hi + tol)).all())
    if positive:  # the lemma's statement for Σ R > 0
        assert bool(((tu >= -tol) & (tu <= tot + tol) & (tv >= -tol) & (tv <= tot + tol)).all())


@PROPS
@given(bshape=batched_shapes, seed=seeds, preset=st.sampled_from(["chefer2021", "lrp"]))
def test_registered_add_conservation(bshape, seed, preset):
    """Lemma 1 (i) (lrp: plain z-rule) and Lemma 2 (chefer2021: normalized) via the registered add rule."""
    B, rest = bshape
    shape = (B,) + rest
    u = randn(shape, seed, torch.float32)
    v = (away_from_zero(shape, seed + 1) - u.double()).float()
    out = u + v
    R = randn(shape, seed + 2, torch.float32).abs()
    fn = registry.lookup(preset, aten.add.Tensor)
    ru, rv = fn(ctx_for(out, 0, aten.add.Tensor, (u, v), (True, True), preset), R)
    tu, tv, tot = (per_sample(t.double(), 0) for t in (ru, rv, R))
    size = 1 + per_sample(ru.double().abs() + rv.double().abs(), 0)
    assert bool(((tu + tv - tot).abs() <= 1e-5 * size).all())
    if preset == "chefer2021":  # Eq. 10, R ≥ 0
        tol = 1e-5 * (1 + tot)
        assert bool(((tu >= -tol) & (tu <= tot + tol) & (tv >= -tol) & (tv <= tot + tol)).all())


# ------------------------------------------------------------------------------------------------
# per-sample independence (no statistic crosses the batch)
# ------------------------------------------------------------------------------------------------
@PROPS
@given(bshape=batched_shapes, seed=seeds, source=st.sampled_from(["z_rule", "arbitrary"]))
def test_normalize_shares_is_per_sample(bshape, seed, source):
    """Lemma 2 normalization per sample: a batch gives the same result as its samples one by one."""
    B, rest = bshape
    ru, rv, R = _draw_shares((B,) + rest, seed, source)
    nu, nv = normalize_shares(ctx_for(R), ru, rv, R, EPS)
    for b in range(B):
        sl = slice(b, b + 1)
        su, sv = normalize_shares(ctx_for(R[sl]), ru[sl], rv[sl], R[sl], EPS)
        assert float((su - nu[sl]).abs().max()) < 1e-6
        assert float((sv - nv[sl]).abs().max()) < 1e-6


@PROPS
@given(bshape=batched_shapes, seed=seeds)
def test_registered_residual_add_is_per_sample(bshape, seed):
    """Eq. 6 + Lemma 2 as registered (chefer2021): explaining a batch = explaining each sample alone."""
    B, rest = bshape
    shape = (B,) + rest
    u = randn(shape, seed, torch.float32)
    v = (away_from_zero(shape, seed + 1) - u.double()).float()
    R = randn(shape, seed + 2, torch.float32)
    fn = registry.lookup("chefer2021", aten.add.Tensor)
    ru, rv = fn(ctx_for(u + v, 0, aten.add.Tensor, (u, v), (True, True)), R)
    for b in range(B):
        sl = slice(b, b + 1)
        su, sv = fn(ctx_for(u[sl] + v[sl], 0, aten.add.Tensor, (u[sl], v[sl]), (True, True)), R[sl])
        scale = 1 + float(ru[sl].abs().max() + rv[sl].abs().max())
        assert float((su - ru[sl]).abs().max()) < 1e-6 * scale
        assert float((sv - rv[sl]).abs().max()) < 1e-6 * scale


# ------------------------------------------------------------------------------------------------
# LRP-α1β0 (Eq. 5) conserves; the LRP baseline does not
# ------------------------------------------------------------------------------------------------
@PROPS
@given(lead=st.lists(dims, max_size=2).map(tuple), n_in=dims, n_out=dims, seed=seeds,
       zero_frac=st.sampled_from([0.0, 0.3]), r_positive=st.booleans())
def test_alpha1_beta0_conserves_and_is_nonnegative(lead, n_in, n_out, seed, zero_frac, r_positive):
    """Eq. 5 (α1β0, joint z_j): Σ_i R_i = Σ_j R_j wherever z_j ≠ 0; R ≥ 0 ⇒ R_x ≥ 0; x_i = 0 ⇒ R_i = 0."""
    x = randn(lead + (n_in,), seed)
    g = torch.Generator().manual_seed(seed + 3)
    x = torch.where(torch.rand(x.shape, generator=g, dtype=torch.float64) < zero_frac, torch.zeros(()).double(), x)
    w = randn((n_in, n_out), seed + 1)
    R = randn(lead + (n_out,), seed + 2)
    if r_positive:
        R = R.abs()
    z = x.clamp(min=0) @ w.clamp(min=0) + x.clamp(max=0) @ w.clamp(max=0)
    assert bool((z >= 0).all())
    assume(bool(((z == 0) | (z > 1e-4)).all()))
    rx = alpha1_beta0(x, w, R, EPS)
    assert bool(torch.isfinite(rx).all())
    assert bool((rx[x == 0] == 0).all())
    # every term is ≥ 0, so exactly Σ_j R_j z_j / (z_j + eps) arrives (0 for z_j = 0) ...
    exact = float((R * z / (z + EPS)).sum())
    assert abs(float(rx.sum()) - exact) <= 1e-10 * (1 + float(R.abs().sum()))
    # ... which is Σ_j R_j over z_j ≠ 0 (outputs with z_j = 0 are dropped)
    passed = torch.where(z != 0, R, torch.zeros((), dtype=torch.float64))
    assert abs(float(rx.sum() - passed.sum())) <= stab_tol(passed, z)
    if bool((z != 0).all()):
        assert abs(float(rx.sum() - R.sum())) <= stab_tol(R, z)
    if r_positive:
        assert bool((rx >= 0).all())


@PROPS
@given(lead=st.lists(dims, max_size=2).map(tuple), n_in=dims, n_out=dims, seed=seeds)
def test_lrp_baseline_total_formula(lead, n_in, n_out, seed):
    """layers_lrp.Linear at c3e578f (paper's LRP baseline) is NOT conservative: with z1 = x⁺W⁺ and
    z2 = x⁻W⁻ each divided by itself, Σ_i R_i = Σ_j R_j ([z1_j ≠ 0] + [z2_j ≠ 0]): each sign part
    passes all of R_j by itself, so an output fed by both signs returns it twice."""
    x, w, R = randn(lead + (n_in,), seed), randn((n_in, n_out), seed + 1), randn(lead + (n_out,), seed + 2).abs()
    z1 = x.clamp(min=0) @ w.clamp(min=0)
    z2 = x.clamp(max=0) @ w.clamp(max=0)
    rx = lrp_baseline(x, w, R, EPS)
    factor = (z1 != 0).double() + (z2 != 0).double()
    expected = float((R * factor).sum())
    tol = stab_tol(R, z1) + stab_tol(R, z2)
    assert abs(float(rx.sum()) - expected) <= tol
    # so the total lies between 0 and 2 Σ R (R ≥ 0), and equals Σ R where exactly one part is fed
    assert float(rx.sum()) <= 2.0 * float(R.sum()) + tol
    assert bool((rx >= 0).all())


def test_lrp_baseline_is_not_conservative_examples():
    """layers_lrp.Linear at c3e578f: inputs of one sign conserve; mixed signs double the relevance."""
    w = torch.tensor([[1.0, 2.0], [-1.0, -3.0]], dtype=torch.float64)
    R = torch.tensor([1.0, 1.0], dtype=torch.float64)
    t = lambda *v: torch.tensor(v, dtype=torch.float64)  # noqa: E731
    # x = (−1, −1): z1 = (0, 0), z2 = (1, 3): only the x⁻W⁻ part, which passes Σ R = 2
    assert float(lrp_baseline(t(-1.0, -1.0), w, R, 0.0).sum()) == pytest.approx(2.0, rel=1e-12)
    # x = (2, −1): z1 = (2, 4), z2 = (1, 3): both parts pass Σ R: relevance doubles
    assert float(lrp_baseline(t(2.0, -1.0), w, R, 0.0).sum()) == pytest.approx(4.0, rel=1e-12)
    # x ≥ 0 (z2 = 0): only the x⁺W⁺ part, conservative there like α1β0
    assert float(lrp_baseline(t(1.0, 2.0), w, R, 0.0).sum()) == pytest.approx(2.0, rel=1e-12)
    # α1β0 on the same inputs conserves all three
    for x in (t(-1.0, -1.0), t(2.0, -1.0), t(1.0, 2.0)):
        assert float(alpha1_beta0(x, w, R, 0.0).sum()) == pytest.approx(2.0, rel=1e-12)


# ------------------------------------------------------------------------------------------------
# z^B (supplementary §B) conserves per sample
# ------------------------------------------------------------------------------------------------
@PROPS
@given(N=st.integers(1, 2), C=st.integers(1, 3), H=st.integers(2, 6), W=st.integers(2, 6),
       k=st.integers(1, 3), stride=st.integers(1, 3), padding=st.integers(0, 1), O=st.integers(1, 3),
       pixels=st.sampled_from(["positive", "negative", "mixed"]), r_positive=st.booleans(), seed=seeds)
@example(N=1, C=1, H=2, W=3, k=2, stride=1, padding=1, O=1, pixels="positive", r_positive=False,
         seed=27862176)  # a denominator of 1e-16: found by CI
def test_z_box_conserves(N, C, H, W, k, stride, padding, O, pixels, r_positive, seed):
    """Supp. §B z^B rule (l = min x, h = max x per sample): Σ R_x = Σ R per sample where z_j ≠ 0;
    R ≥ 0 ⇒ R_x ≥ 0."""
    assume(k <= H + 2 * padding and k <= W + 2 * padding)
    x = randn((N, C, H, W), seed)
    x = x.abs() if pixels == "positive" else (-x.abs() if pixels == "negative" else x)
    w = randn((O, C, k, k), seed + 1)
    p = ([stride, stride], [padding, padding], [1, 1], False, [0, 0], 1)
    low = x.amin(dim=(1, 2, 3), keepdim=True)
    high = x.amax(dim=(1, 2, 3), keepdim=True)
    conv = lambda t, ww: aten.convolution.default(t, ww, None, *p)  # noqa: E731
    z = conv(x, w) - conv(low.expand_as(x), w.clamp(min=0)) - conv(high.expand_as(x), w.clamp(max=0))
    assume(bool(((z.abs() < 1e-12) | (z > 1e-4)).all()))
    R = randn(z.shape, seed + 2)
    if r_positive:
        R = R.abs()
    rx = z_box(x, w, p, R, EPS, low, high)
    assert bool(torch.isfinite(rx).all())
    passed = torch.where(z > 1e-4, R, torch.zeros(()).double())
    # At a near-zero denominator the stabilizer still passes the fraction z / (z + eps) of R (all
    # z^B contributions are >= 0, so no cancellation): bound it, with room for rounding in z.
    near_zero = torch.where(z > 1e-4, torch.zeros(()).double(),
                            R.abs() * ((z.abs() + 1e-14) / EPS).clamp(max=1.0))
    for n in range(N):
        tol = stab_tol(passed[n], z[n]) + float(near_zero[n].sum()) + 1e-10 * float(R[n].abs().sum())
        assert abs(float(rx[n].sum() - passed[n].sum())) <= tol
    if r_positive:
        assert bool((rx >= -1e-12).all())


@PROPS
@given(N=st.integers(1, 2), C=st.integers(1, 3), H=st.integers(2, 5), k=st.integers(1, 3),
       stride=st.integers(1, 2), O=st.integers(1, 3), seed=seeds)
def test_conv_alpha1_beta0_conserves_and_lrp_conv_total(N, C, H, k, stride, O, seed):
    """Eq. 5 for convolutions: α1β0 (joint z) conserves; layers_lrp.Conv2d (separate z1, z2, the
    lrp preset) gives Σ_i R_i = Σ_j R_j ([z1_j ≠ 0] + [z2_j ≠ 0]): up to twice Σ R."""
    assume(k <= H)
    x, w = randn((N, C, H, H), seed), randn((O, C, k, k), seed + 1)
    p = ([stride, stride], [0, 0], [1, 1], False, [0, 0], 1)
    conv = lambda t, ww: aten.convolution.default(t, ww, None, *p)  # noqa: E731
    z1, z2 = conv(x.clamp(min=0), w.clamp(min=0)), conv(x.clamp(max=0), w.clamp(max=0))
    assume(bool((((z1 == 0) | (z1 > 1e-4)) & ((z2 == 0) | (z2 > 1e-4))).all()))
    R = randn(z1.shape, seed + 2).abs()
    joint = conv_alpha1_beta0(x, w, p, R, EPS, joint=True)
    z = z1 + z2
    passed = torch.where(z != 0, R, torch.zeros((), dtype=torch.float64))
    assert abs(float(joint.sum() - passed.sum())) <= stab_tol(passed, z)
    assert bool((joint >= 0).all())
    sep = conv_alpha1_beta0(x, w, p, R, EPS, joint=False)
    expected = float((R * ((z1 != 0).double() + (z2 != 0).double())).sum())
    assert abs(float(sep.sum()) - expected) <= stab_tol(R, z1) + stab_tol(R, z2)


# ------------------------------------------------------------------------------------------------
# the stabilizer never returns NaN/inf
# ------------------------------------------------------------------------------------------------
@settings(max_examples=50, deadline=None)
@given(data=st.data(), dtype=st.sampled_from([np.float32, np.float64]), n=st.integers(1, 16),
       eps=st.sampled_from([DEFAULT_EPS, 1e-6, 1e-3]))
def test_safe_divide_is_finite(data, dtype, n, eps):
    """The safe_divide stabilizer: safe_divide(num, den) is finite for finite num and any den (0, ±inf,
    NaN, subnormal, huge); 0 where den is 0 or not finite; num / (den ± eps) elsewhere."""
    width = 32 if dtype == np.float32 else 64
    den = data.draw(hnp.arrays(dtype, n, elements=st.one_of(
        st.floats(allow_nan=True, allow_infinity=True, width=width),
        st.sampled_from([0.0, -0.0, math.inf, -math.inf, 1e-45 if width == 32 else 5e-324, -1e-30, 1e-12]))))
    num = data.draw(hnp.arrays(dtype, n, elements=st.floats(-1e6, 1e6, width=width)))
    got = safe_divide(torch.from_numpy(num), torch.from_numpy(den), eps)
    assert got.dtype == torch.from_numpy(num).dtype
    assert bool(torch.isfinite(got).all())
    bad = (den == 0) | ~np.isfinite(den)
    assert bool((got.numpy()[bad] == 0).all())
    with np.errstate(all="ignore"):
        expected = num / (den + np.where(den >= 0, dtype(eps), dtype(-eps)).astype(dtype))
    np.testing.assert_allclose(got.numpy()[~bad], expected[~bad], rtol=1e-6, atol=0)
