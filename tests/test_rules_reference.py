"""Every relevance rule against a slow reference written straight from its formula.

The references below never call the fast paths in ``relprop.rules`` or ``torch.autograd``: they
enumerate, with Python loops, every elementary contribution ``x_i w_ij`` of every output ``j`` and
distribute ``R_j`` over them by the rule's formula (CVPR 2021 Eq. 5, Eq. 6 + Lemma 2, Lemma 1,
supplementary §B), using the safe_divide stabilizer (denominator pushed ``eps`` away from 0 in the
direction of its sign; exactly 0 relevance where the denominator is 0 or not finite).
Helpers that take tensors as they are (``alpha1_beta0``, ``z_box``, ...) are checked in float64;
the registered rules cast to float32, so they are checked in float32 with atol ~1e-5.
"""
from __future__ import annotations

import itertools
import math
import sys

import numpy as np
import pytest
import torch
import torch.fx

from relprop.rules import rule_registry as registry
from relprop.rules.context import RuleContext
from relprop.rules.convolution import from_patches, is_patchify, to_patches, z_box
from relprop.rules.linear import alpha1_beta0, lrp_baseline
from relprop.rules.products import z_rule_matmul
from relprop.rules.residual import normalize_shares, z_rule_sum
from relprop.rules.stabilize import safe_divide

from rule_helpers import make_ctx, np64, rand, sdiv

aten = torch.ops.aten
EPS = 1e-9
F64 = dict(rtol=1e-9, atol=1e-12)
F32 = dict(rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------------------------------
# reference building blocks (plain Python floats)
# ------------------------------------------------------------------------------------------------
def pos(t: float) -> float:
    return t if t > 0 else 0.0


def neg(t: float) -> float:
    return t if t < 0 else 0.0


def distribute(pairs, r_j, eps, rule, low=0.0, high=0.0):
    """Relevance of every contribution (x_i, w_ij) to one output j that received r_j.

    ``pairs`` is the list of (x_i, w_ij) feeding output j; returns one relevance per pair.
      z        : t_i = x_i w_ij;                        R_i = t_i / Σ t · r_j        (z-rule, Eq. 1)
      ab       : t_i = x⁺w⁺ + x⁻w⁻;                     R_i = t_i / Σ t · r_j        (Eq. 5, α1β0)
      lrp      : p_i = x⁺w⁺, n_i = x⁻w⁻;  R_i = p_i/Σp · r_j + n_i/Σn · r_j          (layers_lrp Linear
                 and Conv2d at the authors' HEAD c3e578f, alpha=1: each part has its own denominator.
                 The reference encoded the reverted commit 07d8c72 before, p_i/(Σp+Σn) + n_i/(2Σn).)
      zbox     : t_i = x_i w_ij − l w⁺_ij − h w⁻_ij;    R_i = t_i / Σ t · r_j        (supp. §B, z^B)
    """
    if rule in ("z", "ab", "zbox"):
        if rule == "z":
            t = [x * w for x, w in pairs]
        elif rule == "ab":
            t = [pos(x) * pos(w) + neg(x) * neg(w) for x, w in pairs]
        else:
            t = [x * w - low * pos(w) - high * neg(w) for x, w in pairs]
        s = sdiv(r_j, sum(t), eps)
        return [ti * s for ti in t]
    p = [pos(x) * pos(w) for x, w in pairs]
    n = [neg(x) * neg(w) for x, w in pairs]
    if rule != "lrp":
        raise ValueError(rule)
    s1, s2 = sdiv(r_j, sum(p), eps), sdiv(r_j, sum(n), eps)
    return [pi * s1 + ni * s2 for pi, ni in zip(p, n)]


def ref_product(a, b, R, eps, rule):
    """Shares of a and b for z = a @ b, a [..., n, k], b [..., k, m] with equal leading dims.

    Every output (r, c) is fed by the k contributions a[r, t] * b[t, c]; each contribution's
    relevance goes to both a[r, t] and b[t, c] (for the z-rule these are the two shares of Lemma 1).
    """
    A, B, RR = np64(a), np64(b), np64(R)
    ra, rb = np.zeros(A.shape), np.zeros(B.shape)
    n, k = A.shape[-2:]
    m = B.shape[-1]
    for lead in np.ndindex(*A.shape[:-2]):
        for r in range(n):
            for c in range(m):
                pairs = [(A[lead + (r, t)], B[lead + (t, c)]) for t in range(k)]
                rel = distribute(pairs, RR[lead + (r, c)], eps, rule)
                for t in range(k):
                    ra[lead + (r, t)] += rel[t]
                    rb[lead + (t, c)] += rel[t]
    return torch.from_numpy(ra), torch.from_numpy(rb)


def ref_linear(x, w, R, eps, rule):
    """R_x for z = x @ w with w [in, out] (or [..., in, out] matching x's leading dims)."""
    xx = x.unsqueeze(-2)  # [..., 1, in]: one output row per leading index
    ww = w.expand(*x.shape[:-1], *w.shape[-2:]) if w.dim() == 2 else w.unsqueeze(-3).expand(
        *x.shape[:-1], *w.shape[-2:])
    ra, _ = ref_product(xx, ww, R.unsqueeze(-2), eps, rule)
    return ra.squeeze(-2)


def conv_connections(x_shape, w_shape, p):
    """Explicit index map of a 2-D aten.convolution: {output index: [(input index, weight index)]}."""
    stride, padding, dilation, transposed, output_padding, groups = p
    N, C, H, W = x_shape
    (sh, sw), (ph, pw), (dh, dw) = stride, padding, dilation
    conns = {}
    if not transposed:
        O, Cg, KH, KW = w_shape
        OH = (H + 2 * ph - dh * (KH - 1) - 1) // sh + 1
        OW = (W + 2 * pw - dw * (KW - 1) - 1) // sw + 1
        Og = O // groups
        for n, o, oy, ox in itertools.product(range(N), range(O), range(OH), range(OW)):
            g = o // Og
            lst = conns.setdefault((n, o, oy, ox), [])
            for c, ky, kx in itertools.product(range(Cg), range(KH), range(KW)):
                iy, ix = oy * sh - ph + ky * dh, ox * sw - pw + kx * dw
                if 0 <= iy < H and 0 <= ix < W:
                    lst.append(((n, g * Cg + c, iy, ix), (o, c, ky, kx)))
        return conns, (N, O, OH, OW)
    Cin, Og, KH, KW = w_shape
    Cg = C // groups
    OH = (H - 1) * sh - 2 * ph + dh * (KH - 1) + output_padding[0] + 1
    OW = (W - 1) * sw - 2 * pw + dw * (KW - 1) + output_padding[1] + 1
    for n, o, oy, ox in itertools.product(range(N), range(Og * groups), range(OH), range(OW)):
        conns[(n, o, oy, ox)] = []
    for n, c, iy, ix in itertools.product(range(N), range(C), range(H), range(W)):
        g = c // Cg
        for og, ky, kx in itertools.product(range(Og), range(KH), range(KW)):
            oy, ox = iy * sh - ph + ky * dh, ix * sw - pw + kx * dw
            if 0 <= oy < OH and 0 <= ox < OW:
                conns[(n, g * Og + og, oy, ox)].append(((n, c, iy, ix), (c, og, ky, kx)))
    return conns, (N, Og * groups, OH, OW)


def ref_conv(x, w, p, R, eps, rule, low=None, high=None):
    """R_x of a convolution by the rule's formula over the explicit connections."""
    X, Wt, RR = np64(x), np64(w), np64(R)
    conns, _ = conv_connections(x.shape, w.shape, p)
    out = np.zeros(X.shape)
    for j, lst in conns.items():
        n = j[0]
        pairs = [(X[i], Wt[k]) for i, k in lst]
        lo = float(low[n]) if low is not None else 0.0
        hi = float(high[n]) if high is not None else 0.0
        rel = distribute(pairs, RR[j], eps, rule, lo, hi)
        for (i, _), r in zip(lst, rel):
            out[i] += r
    return torch.from_numpy(out)


def reduce_to(rel, shape):
    """Sum a relevance computed in a broadcast shape onto an operand's shape (explicit loops)."""
    shape = tuple(shape)
    R = np64(rel)
    out = np.zeros(shape)
    pad = R.ndim - len(shape)
    for idx in np.ndindex(*R.shape):
        tgt = tuple(0 if shape[d] == 1 else idx[d + pad] for d in range(len(shape)))
        out[tgt] += R[idx]
    return torch.from_numpy(out)


def assert_clean(*ts):
    for t in ts:
        assert torch.isfinite(t).all(), "relevance contains NaN/inf"


# ------------------------------------------------------------------------------------------------
# the reference itself
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("p, xs, ws", [
    (([1, 1], [0, 0], [1, 1], False, [0, 0], 1), (2, 3, 5, 5), (4, 3, 3, 3)),
    (([2, 1], [1, 2], [1, 2], False, [0, 0], 2), (1, 4, 5, 6), (6, 2, 3, 2)),
    (([2, 2], [1, 1], [1, 1], True, [1, 0], 1), (1, 2, 3, 3), (2, 3, 3, 2)),
])
def test_reference_conv_index_map_is_the_convolution(p, xs, ws):
    """Sanity of the reference: Σ over the explicit connections reproduces aten.convolution."""
    x, w = rand(xs, 0), rand(ws, 1)
    conns, oshape = conv_connections(xs, ws, p)
    X, Wt = np64(x), np64(w)
    y = np.zeros(oshape)
    for j, lst in conns.items():
        y[j] = sum(X[i] * Wt[k] for i, k in lst)
    torch.testing.assert_close(torch.from_numpy(y), aten.convolution.default(x, w, None, *p), **F64)


# ------------------------------------------------------------------------------------------------
# safe_divide
# ------------------------------------------------------------------------------------------------
def test_safe_divide_matches_reference_elementwise():
    """The safe_divide stabilizer: num/(den ± eps), 0 where den is 0, ±inf or NaN."""
    den = torch.tensor([2.0, -2.0, 0.0, -0.0, 1e-300, -1e-300, math.inf, -math.inf, math.nan, 1e-9, -1e-9],
                       dtype=torch.float64)
    num = torch.linspace(-3, 3, den.numel(), dtype=torch.float64)
    got = safe_divide(num, den, 1e-9)
    ref = torch.tensor([sdiv(a, b, 1e-9) for a, b in zip(num.tolist(), den.tolist())], dtype=torch.float64)
    assert_clean(got)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=0)


# ------------------------------------------------------------------------------------------------
# linear layers: alpha1_beta0 (Eq. 5) and lrp_baseline (layers_lrp.Linear at c3e578f)
# ------------------------------------------------------------------------------------------------
LINEAR_SHAPES = [((4,), (4, 5)), ((3, 4), (4, 5)), ((2, 3, 4), (4, 2)), ((1, 1), (1, 1)),
                 ((2, 3, 4), (2, 4, 5))]


@pytest.mark.parametrize("xs, ws", LINEAR_SHAPES)
@pytest.mark.parametrize("seed", [0, 1])
def test_alpha1_beta0_matches_reference(xs, ws, seed):
    """CVPR 2021 Eq. 5 (LRP-α1β0, joint denominator z_j = Σ x⁺w⁺ + x⁻w⁻) vs explicit loops."""
    x, w = rand(xs, seed), rand(ws, seed + 10)
    R = rand(xs[:-1] + ws[-1:], seed + 20)
    got = alpha1_beta0(x, w, R, EPS)
    torch.testing.assert_close(got, ref_linear(x, w, R, EPS, "ab"), **F64)


@pytest.mark.parametrize("xs, ws", LINEAR_SHAPES)
@pytest.mark.parametrize("seed", [0, 1])
def test_lrp_baseline_matches_reference(xs, ws, seed):
    """layers_lrp.Linear at c3e578f (LRP baseline): x⁺w⁺/z⁺ + x⁻w⁻/z⁻, separate denominators, vs loops."""
    x, w = rand(xs, seed), rand(ws, seed + 10)
    R = rand(xs[:-1] + ws[-1:], seed + 20)
    got = lrp_baseline(x, w, R, EPS)
    torch.testing.assert_close(got, ref_linear(x, w, R, EPS, "lrp"), **F64)


@pytest.mark.parametrize("fn, rule", [(alpha1_beta0, "ab"), (lrp_baseline, "lrp")])
def test_linear_edge_cases_zero_inputs_and_zero_denominators(fn, rule):
    """Eq. 5 + the safe_divide stabilizer: x_i = 0 gets exactly 0; z_j = 0 gives 0 (never NaN/inf)."""
    x = torch.tensor([[0.0, 1.0, -1.0, 0.0], [0.0, 0.0, 0.0, 0.0], [-2.0, -1.0, -0.5, -3.0]],
                     dtype=torch.float64)
    # column 0: x⁺ meets only w⁻ and x⁻ only w⁺ for row 0 -> z = 0; column 2: all-zero weights
    w = torch.tensor([[1.0, 2.0, 0.0], [-1.0, 0.5, 0.0], [1.0, -3.0, 0.0], [4.0, 1.0, 0.0]], dtype=torch.float64)
    R = torch.tensor([[1.0, -2.0, 5.0], [1.0, 1.0, 1.0], [0.5, 2.0, 3.0]], dtype=torch.float64)
    got = fn(x, w, R, EPS)
    assert_clean(got)
    assert (got[x == 0] == 0).all()
    assert (got[1] == 0).all()
    torch.testing.assert_close(got, ref_linear(x, w, R, EPS, rule), **F64)
    # row 0: z_0 = 0 and z_2 = 0 (dropped); z_1 = 1·0.5 + (−1)(−3) = 3.5 passes R_01 = −2 (α1β0)
    if rule == "ab":
        torch.testing.assert_close(got[0].sum(), torch.tensor(-2.0 * 3.5 / (3.5 + EPS), dtype=torch.float64),
                                   rtol=1e-12, atol=0)


@pytest.mark.parametrize("preset, rule", [("chefer2021", "ab"), ("lrp", "lrp")])
@pytest.mark.parametrize("xs, out", [((3, 4), 5), ((2, 3, 4), 2)])
def test_registered_linear_and_addmm_match_reference(preset, rule, xs, out):
    """aten.linear / aten.addmm rules: Eq. 5 (chefer2021) or layers_lrp.Linear (lrp); bias ignored."""
    x = rand(xs, 3, torch.float32)
    W = rand((out, xs[-1]), 4, torch.float32)
    b = rand((out,), 5, torch.float32)
    y = aten.linear.default(x, W, b)
    R = rand(y.shape, 6, torch.float32)
    fn = registry.lookup(preset, aten.linear.default)
    rx, rw, rb = fn(make_ctx(aten.linear.default, (x, W, b), y, (True, False, False), preset=preset), R)
    assert rw is None and rb is None
    torch.testing.assert_close(rx.double(), ref_linear(x, W.t(), R, EPS, rule), **F32)
    if x.dim() == 2:
        y2 = aten.addmm.default(b, x, W.t())
        fn2 = registry.lookup(preset, aten.addmm.default)
        r = fn2(make_ctx(aten.addmm.default, (b, x, W.t()), y2, (False, True, False), preset=preset), R)
        assert r[0] is None and r[2] is None
        torch.testing.assert_close(r[1].double(), ref_linear(x, W.t(), R, EPS, rule), **F32)


# ------------------------------------------------------------------------------------------------
# products: z_rule_matmul (Lemma 1 ii) and the registered matmul rule (halved shares)
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("as_, bs", [((1, 1), (1, 1)), ((3, 4), (4, 5)), ((2, 3, 4), (2, 4, 2)),
                                     ((2, 2, 3, 4), (2, 2, 4, 3))])
@pytest.mark.parametrize("seed", [0, 1])
def test_z_rule_matmul_matches_reference(as_, bs, seed):
    """Lemma 1 / supp. Eq. 5-6: R_a[k,m] = Σ_l a_km b_ml / z_kl R_kl and R_b[m,l] = Σ_k (same)."""
    a, b = rand(as_, seed), rand(bs, seed + 1)
    z = a @ b
    R = rand(z.shape, seed + 2)
    ra, rb = z_rule_matmul(a, b, z, R, EPS)
    ref_a, ref_b = ref_product(a, b, R, EPS, "z")
    torch.testing.assert_close(ra, ref_a, **F64)
    torch.testing.assert_close(rb, ref_b, **F64)


def test_z_rule_matmul_zero_denominator_and_zero_entries():
    """Lemma 1 z-rule with the safe_divide stabilizer: z_kl = 0 gives 0; zero entries get 0; no NaN."""
    a = torch.tensor([[1.0, -1.0, 0.0], [0.0, 0.0, 0.0], [2.0, 0.5, -1.0]], dtype=torch.float64)
    b = torch.tensor([[2.0, 1.0], [2.0, -3.0], [5.0, 0.0]], dtype=torch.float64)
    z = a @ b  # z[0, 0] == 0 exactly, row 1 all zero
    assert z[0, 0] == 0
    R = torch.tensor([[7.0, 1.0], [3.0, -2.0], [1.0, 1.0]], dtype=torch.float64)
    ra, rb = z_rule_matmul(a, b, z, R, EPS)
    assert_clean(ra, rb)
    assert (ra[a == 0] == 0).all()
    ref_a, ref_b = ref_product(a, b, R, EPS, "z")
    torch.testing.assert_close(ra, ref_a, **F64)
    torch.testing.assert_close(rb, ref_b, **F64)


def _promote(a, b):
    """torch.matmul's promotion of vectors and broadcasting of batch dims, done explicitly."""
    a2 = a.unsqueeze(0) if a.dim() == 1 else a
    b2 = b.unsqueeze(-1) if b.dim() == 1 else b
    lead = torch.broadcast_shapes(a2.shape[:-2], b2.shape[:-2])
    return a2.expand(*lead, *a2.shape[-2:]), b2.expand(*lead, *b2.shape[-2:])


def _unpromote(ref_a, ref_b, a, b):
    """Undo the vector promotion of :func:`_promote` on reference shares (still batch-broadcast)."""
    return (ref_a.squeeze(-2) if a.dim() == 1 else ref_a), (ref_b.squeeze(-1) if b.dim() == 1 else ref_b)


MATMUL_SHAPES = [((3, 4), (4, 5)), ((2, 3, 4), (2, 4, 3)), ((2, 2, 3, 4), (2, 2, 4, 3)),
                 ((2, 3, 4), (4, 5)), ((4,), (4, 5)), ((3, 4), (4,)), ((4,), (4,)),
                 ((4,), (2, 4, 3)), ((2, 3, 4), (4,))]


MATMUL_CASES = ([(aten.matmul.default, a, b) for a, b in MATMUL_SHAPES]
                + [(aten.bmm.default, a, b) for a, b in MATMUL_SHAPES if len(a) == len(b) == 3]
                + [(aten.mm.default, a, b) for a, b in MATMUL_SHAPES if len(a) == len(b) == 2])


@pytest.mark.parametrize("op, as_, bs", MATMUL_CASES,
                         ids=[f"{op.__name__}-" + "x".join(map(str, a)) + "@" + "x".join(map(str, b))
                              for op, a, b in MATMUL_CASES])
def test_registered_matmul_halves_z_rule(op, as_, bs):
    """Lemma 1 (ii) + §3.2: attention product A·V / Q·Kᵀ: z-rule on each operand, both halved.

    Shares may come back in the broadcast shape; they are summed onto the operand as the
    engine's walk (``relprop.engine.walk._fit``) does before comparing.
    """
    a, b = rand(as_, 7, torch.float32), rand(bs, 8, torch.float32)
    out = torch.matmul(a, b)
    R = rand(out.shape, 9, torch.float32)
    fn = registry.lookup("chefer2021", op)
    assert fn is registry.lookup("lrp", op)
    ra, rb = fn(make_ctx(op, (a, b), out, (True, True)), R)
    a2, b2 = _promote(a, b)
    ref_a, ref_b = _unpromote(*ref_product(a2, b2, R.reshape(torch.matmul(a2, b2).shape), EPS, "z"), a, b)
    torch.testing.assert_close(reduce_to(ra, a.shape), reduce_to(ref_a / 2, a.shape), **F32)
    torch.testing.assert_close(reduce_to(rb, b.shape), reduce_to(ref_b / 2, b.shape), **F32)


def test_registered_elementwise_product_of_two_live_tensors_is_halved_z_rule():
    """Lemma 1 (ii) for a gate a ⊙ b: z-rule gives each factor a·b/z·R = R, halved → R/2 each."""
    a = torch.tensor([[1.0, 0.0, -2.0], [3.0, 0.5, 4.0]])
    b = torch.tensor([[2.0, 5.0, 1.0], [0.0, -1.0, 0.25]])
    out = a * b
    R = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    ra, rb = registry.lookup("chefer2021", aten.mul.Tensor)(make_ctx(aten.mul.Tensor, (a, b), out, (True, True)), R)
    ref = torch.tensor([[sdiv(x * y * r, x * y, EPS) / 2 for x, y, r in zip(*rows)]
                        for rows in zip(a.tolist(), b.tolist(), R.tolist())])
    assert_clean(ra, rb)
    torch.testing.assert_close(ra, ref, rtol=1e-6, atol=0)
    torch.testing.assert_close(rb, ref, rtol=1e-6, atol=0)
    assert ra[0, 1] == 0 and ra[1, 0] == 0  # z = 0 there


@pytest.mark.parametrize("preset, rule", [("chefer2021", "ab"), ("lrp", "lrp")])
@pytest.mark.parametrize("as_, bs, live", [
    ((3, 4), (4, 5), (True, False)),     # x @ W
    ((2, 3, 4), (4, 5), (True, False)),
    ((5, 3), (3, 4), (False, True)),     # W @ x
    ((2, 3, 4), (4,), (True, False)),    # x @ w (vector weight)
    ((4,), (4, 3), (False, True)),       # w @ x (vector weight)
    ((4,), (2, 4, 3), (False, True)),    # w @ x (vector weight, batched x)
])
def test_registered_matmul_with_constant_operand_is_linear_rule(preset, rule, as_, bs, live):
    """A product with one constant operand is a linear layer: Eq. 5 (chefer2021) / layers_lrp (lrp)."""
    a, b = rand(as_, 11, torch.float32), rand(bs, 12, torch.float32)
    out = torch.matmul(a, b)
    R = rand(out.shape, 13, torch.float32)
    ra, rb = registry.lookup(preset, aten.matmul.default)(
        make_ctx(aten.matmul.default, (a, b), out, live, preset=preset), R)
    a2, b2 = _promote(a, b)
    ref_a, ref_b = _unpromote(*ref_product(a2, b2, R.reshape(torch.matmul(a2, b2).shape), EPS, rule), a, b)
    if live[0]:
        assert rb is None
        torch.testing.assert_close(reduce_to(ra, a.shape), reduce_to(ref_a, a.shape), **F32)
    else:
        assert ra is None
        torch.testing.assert_close(reduce_to(rb, b.shape), reduce_to(ref_b, b.shape), **F32)


# ------------------------------------------------------------------------------------------------
# sums: z_rule_sum (Eq. 6), normalize_shares (Lemma 2), residual_add / add_z_rule
# ------------------------------------------------------------------------------------------------
def ref_sum_shares(u, v, R, eps):
    """Eq. 6 z-rule on z = u + v, element by element (u, v already broadcast to z's shape)."""
    U, V, RR = np64(u), np64(v), np64(R)
    ru, rv = np.zeros(U.shape), np.zeros(V.shape)
    for idx in np.ndindex(*U.shape):
        z = U[idx] + V[idx]
        ru[idx] = U[idx] * sdiv(RR[idx], z, eps)
        rv[idx] = V[idx] * sdiv(RR[idx], z, eps)
    return torch.from_numpy(ru), torch.from_numpy(rv)


def ref_normalize(ru, rv, R, eps, batch_dim=0):
    """The normalization after Eq. 9, per sample b:
    R̄_u = R_u · |ΣR_u| / (|ΣR_u| + |ΣR_v|) · ΣR / ΣR_u (and the same for v)."""
    RU, RV, RR = np64(ru), np64(rv), np64(R)
    out_u, out_v = RU.copy(), RV.copy()
    for b in range(RU.shape[batch_dim]):
        sl = (slice(None),) * batch_dim + (b,)
        su, sv, tot = RU[sl].sum(), RV[sl].sum(), RR[sl].sum()
        fu = sdiv(abs(su) * tot, abs(su) + abs(sv), 0.0)
        fv = sdiv(abs(sv) * tot, abs(su) + abs(sv), 0.0)
        out_u[sl] = RU[sl] * sdiv(fu, su, eps)
        out_v[sl] = RV[sl] * sdiv(fv, sv, eps)
    return torch.from_numpy(out_u), torch.from_numpy(out_v)


def away_from_zero(shape, seed, margin=0.2):
    """Random float64 values of random sign whose magnitude is at least ``margin``."""
    g = torch.Generator().manual_seed(seed)
    mag = margin + torch.rand(shape, generator=g, dtype=torch.float64)
    sign = torch.where(torch.rand(shape, generator=g, dtype=torch.float64) < 0.5, -1.0, 1.0)
    return sign * mag


@pytest.mark.parametrize("shape", [(1,), (2, 3), (2, 3, 4)])
@pytest.mark.parametrize("seed", [0, 1])
def test_z_rule_sum_matches_reference(shape, seed):
    """Eq. 6: R_u = u ⊙ R / (u + v), R_v = v ⊙ R / (u + v), vs an element loop."""
    u = rand(shape, seed)
    v = rand(shape, seed + 1)
    z = u + v
    R = rand(shape, seed + 2)
    ru, rv = z_rule_sum(u, v, z, R, EPS)
    ref_u, ref_v = ref_sum_shares(u, v, R, EPS)
    torch.testing.assert_close(ru, ref_u, **F64)
    torch.testing.assert_close(rv, ref_v, **F64)


def test_z_rule_sum_zero_denominator():
    """Eq. 6: z = u + v = 0 gives 0 relevance to both operands (no NaN/inf)."""
    u = torch.tensor([[0.0, 1.0, -1.0, 2.0, -math.inf]], dtype=torch.float64)
    v = torch.tensor([[0.0, -1.0, 1.0, 1.0, 0.0]], dtype=torch.float64)
    z = u + v
    R = torch.tensor([[1.0, 2.0, 3.0, 3.0, 4.0]], dtype=torch.float64)
    ru, rv = z_rule_sum(u, v, z, R, EPS)
    assert_clean(ru, rv)
    assert (ru[0, :3] == 0).all() and (rv[0, :3] == 0).all() and ru[0, 4] == 0 and rv[0, 4] == 0
    torch.testing.assert_close(ru[0, 3], torch.tensor(2.0 * 3.0 / (3.0 + EPS), dtype=torch.float64))


@pytest.mark.parametrize("shape, batch_dim", [((1, 3), 0), ((3, 4), 0), ((2, 3, 4), 0), ((3, 2, 4), 1)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_normalize_shares_matches_reference(shape, batch_dim, seed):
    """Lemma 2 normalization (after Eq. 9), per sample, vs the formula evaluated sample by sample."""
    ru, rv, R = rand(shape, seed), rand(shape, seed + 1), rand(shape, seed + 2)
    out = torch.zeros(shape, dtype=torch.float64)
    ctx = RuleContext(node=None, args=(), kwargs={}, out=out, live=(), batch_dim=batch_dim,
                      batch_size=shape[batch_dim])
    nu, nv = normalize_shares(ctx, ru, rv, R, EPS)
    ref_u, ref_v = ref_normalize(ru, rv, R, EPS, batch_dim)
    torch.testing.assert_close(nu, ref_u, **F64)
    torch.testing.assert_close(nv, ref_v, **F64)


def test_normalize_shares_zero_share_and_zero_total():
    """Lemma 2: an all-zero share stays 0, the other gets ΣR; all-zero → 0, no NaN."""
    ru = torch.tensor([[0.0, 0.0], [0.0, 0.0], [1.0, -1.0]], dtype=torch.float64)
    rv = torch.tensor([[2.0, 1.0], [0.0, 0.0], [3.0, 0.0]], dtype=torch.float64)
    R = torch.tensor([[0.5, 0.5], [1.0, 1.0], [2.0, 0.0]], dtype=torch.float64)
    ctx = RuleContext(node=None, args=(), kwargs={}, out=R, live=(), batch_dim=0, batch_size=3)
    nu, nv = normalize_shares(ctx, ru, rv, R, EPS)
    assert_clean(nu, nv)
    assert (nu[:2] == 0).all() and (nv[1] == 0).all()
    torch.testing.assert_close(nv[0].sum(), torch.tensor(1.0, dtype=torch.float64), rtol=1e-8, atol=0)
    assert (nu[2] == 0).all()  # Σ R_u = 0 for sample 2: it gets none, v gets everything
    torch.testing.assert_close(nv[2].sum(), torch.tensor(2.0, dtype=torch.float64), rtol=1e-8, atol=0)
    ref_u, ref_v = ref_normalize(ru, rv, R, EPS)
    torch.testing.assert_close(nu, ref_u, **F64)
    torch.testing.assert_close(nv, ref_v, **F64)


SUM_CASES = [  # (u shape, v shape, live)
    ((2, 3, 4), (2, 3, 4), (True, True)),
    ((2, 3, 4), (4,), (True, False)),      # bias / constant: broadcast, absorbs its share
    ((2, 3, 4), (1, 3, 4), (True, False)), # position embedding
    ((3, 5), (3, 5), (True, True)),
    ((1, 2), (1, 2), (True, True)),
]


@pytest.mark.parametrize("us, vs, live", SUM_CASES)
@pytest.mark.parametrize("op, sign, alpha", [(aten.add.Tensor, 1.0, None), (aten.add.Tensor, 1.0, 2.0),
                                             (aten.sub.Tensor, -1.0, None)])
@pytest.mark.parametrize("preset", ["chefer2021", "lrp"])
def test_registered_sums_match_reference(us, vs, live, op, sign, alpha, preset):
    """residual_add/sub (chefer2021: Eq. 6 + Lemma 2 per sample) and add/sub_z_rule (lrp: Eq. 6 only)."""
    k = sign * (alpha or 1.0)
    v = rand(vs, 22, torch.float32)
    # choose u so that z = u + k·v stays away from 0 (no catastrophic cancellation in float32)
    u = (away_from_zero(us, 23) - k * v.double()).float()
    assert u.shape == us
    kwargs = {"alpha": alpha} if alpha is not None else {}
    out = op(u, v, **kwargs)
    R = rand(out.shape, 24, torch.float32)
    fn = registry.lookup(preset, op)
    ru, rv = fn(make_ctx(op, (u, v), out, live, preset=preset, kwargs=kwargs), R)
    uu = u.double().expand(out.shape)
    vv = (k * v.double()).expand(out.shape)
    ref_u, ref_v = ref_sum_shares(uu, vv, R, EPS)
    if preset == "chefer2021":
        ref_u, ref_v = ref_normalize(ref_u, ref_v, R, EPS)
    assert ru.shape == out.shape and rv.shape == out.shape
    scale = 1.0 + float(ref_u.abs().max() + ref_v.abs().max())
    torch.testing.assert_close(ru.double(), ref_u, rtol=1e-4, atol=1e-5 * scale)
    torch.testing.assert_close(rv.double(), ref_v, rtol=1e-4, atol=1e-5 * scale)


@pytest.mark.parametrize("preset", ["chefer2021", "lrp"])
def test_registered_add_zero_denominator_and_zero_operand(preset):
    """Eq. 6 (+ Lemma 2): z = 0 gives 0; u = 0 gets 0 relevance; never NaN/inf."""
    u = torch.tensor([[0.0, 1.0, -1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    v = torch.tensor([[0.0, -1.0, 1.0, 2.0], [1.0, 2.0, -1.0, 3.0]])
    out = u + v
    R = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 2.0, 3.0, 4.0]])
    op = aten.add.Tensor
    ru, rv = registry.lookup(preset, op)(make_ctx(op, (u, v), out, (True, True), preset=preset), R)
    assert_clean(ru, rv)
    assert (ru == 0).all()
    assert (rv[0, :3] == 0).all()
    # lrp: only z_3 = 2 passes its R = 1. chefer2021: Lemma 2 rescales v's share to the whole
    # per-sample total Σ R = 4 (|ΣR_u| = 0, so v's fraction is 1), the formula after Eq. 9.
    expected = 1.0 if preset == "lrp" else 4.0
    torch.testing.assert_close(rv[0, 3], torch.tensor(expected), rtol=1e-6, atol=0)
    torch.testing.assert_close(rv[1], R[1], rtol=1e-6, atol=0)


def test_registered_add_of_python_number_passes_relevance():
    """x + c for a Python number c (add.Tensor with a scalar operand, add.Scalar): R_x = R."""
    x = rand((2, 3), 0, torch.float32)
    R = rand((2, 3), 1, torch.float32)
    for op in (aten.add.Tensor, aten.add.Scalar):
        for preset in ("chefer2021", "lrp"):
            r = registry.lookup(preset, op)(make_ctx(op, (x, 1e-6), x + 1e-6, (True, False), preset=preset), R)
            assert torch.equal(r[0], R) and r[1] is None


# ------------------------------------------------------------------------------------------------
# convolutions: z_box (supplementary §B) and the registered convolution rule
# ------------------------------------------------------------------------------------------------
CONV_CASES = [
    (([1, 1], [0, 0], [1, 1], False, [0, 0], 1), (2, 3, 5, 5), (4, 3, 3, 3)),
    (([4, 4], [0, 0], [1, 1], False, [0, 0], 1), (2, 3, 8, 8), (5, 3, 4, 4)),   # patch embedding
    (([4, 4], [0, 0], [1, 1], False, [0, 0], 1), (1, 3, 10, 9), (2, 3, 4, 4)),  # patches, unread edge
    (([3, 3], [1, 1], [1, 1], False, [0, 0], 1), (1, 2, 7, 7), (3, 2, 2, 2)),   # unread pixels
    (([2, 1], [1, 2], [1, 2], False, [0, 0], 2), (1, 4, 5, 6), (6, 2, 3, 2)),   # groups, dilation
    (([2, 2], [1, 1], [1, 1], True, [1, 0], 1), (1, 2, 3, 3), (2, 3, 3, 2)),    # transposed
]


@pytest.mark.parametrize("p, xs, ws", CONV_CASES)
@pytest.mark.parametrize("pixels", ["mixed", "positive", "negative"])
def test_z_box_matches_reference(p, xs, ws, pixels):
    """Supp. §B z^B rule: R_i = Σ_j (x_i w_ji − l w⁺_ji − h w⁻_ji) / z_j · R_j, per-sample l, h."""
    x = rand(xs, 31)
    if pixels == "positive":
        x = x.abs()
    elif pixels == "negative":
        x = -x.abs()
    w = rand(ws, 32)
    y = aten.convolution.default(x, w, None, *p)
    R = rand(y.shape, 33)
    low = x.amin(dim=(1, 2, 3), keepdim=True)
    high = x.amax(dim=(1, 2, 3), keepdim=True)
    got = z_box(x, w, p, R, EPS, low, high)
    ref = ref_conv(x, w, p, R, EPS, "zbox", low.flatten().tolist(), high.flatten().tolist())
    torch.testing.assert_close(got, ref, **F64)


def test_patchify_detection():
    """The patch-matrix path of z_box is taken exactly for kernel = stride, no padding, dilation or groups."""
    w = torch.zeros(4, 3, 4, 4)
    assert is_patchify(w, ([4, 4], [0, 0], [1, 1], False, [0, 0], 1))
    for p in (([2, 2], [0, 0], [1, 1], False, [0, 0], 1), ([4, 4], [1, 1], [1, 1], False, [0, 0], 1),
              ([4, 4], [0, 0], [2, 2], False, [0, 0], 1), ([4, 4], [0, 0], [1, 1], True, [0, 0], 1)):
        assert not is_patchify(w, p)
    assert not is_patchify(torch.zeros(4, 1, 4, 4), ([4, 4], [0, 0], [1, 1], False, [0, 0], 3))
    x = rand((2, 3, 9, 10), 5)
    assert torch.equal(from_patches(to_patches(x, (4, 4)), x.shape, (4, 4))[..., :8, :8], x[..., :8, :8])


def test_z_box_constant_image_and_fixed_bounds():
    """Supp. §B z^B: a constant image has z_j = 0 (→ 0 relevance, no NaN); fixed bounds l, h work."""
    p = ([2, 2], [0, 0], [1, 1], False, [0, 0], 1)
    w = rand((2, 3, 2, 2), 1)
    x = torch.full((1, 3, 4, 4), 0.7, dtype=torch.float64)
    R = torch.ones(1, 2, 2, 2, dtype=torch.float64)
    got = z_box(x, w, p, R, EPS, x.amin().reshape(1, 1, 1, 1), x.amax().reshape(1, 1, 1, 1))
    assert_clean(got)
    assert (got == 0).all()
    x = rand((2, 3, 4, 4), 2).clamp(-1.5, 1.5)
    R = rand((2, 2, 2, 2), 3)
    lo, hi = torch.tensor(-1.5, dtype=torch.float64), torch.tensor(1.5, dtype=torch.float64)
    got = z_box(x, w, p, R, EPS, lo, hi)
    torch.testing.assert_close(got, ref_conv(x, w, p, R, EPS, "zbox", [-1.5] * 2, [1.5] * 2), **F64)


def _conv_args(x, w, p):
    return (x, w, None) + tuple(p)


@pytest.mark.parametrize("p, xs, ws", CONV_CASES)
@pytest.mark.parametrize("preset, rule", [("chefer2021", "ab"), ("lrp", "lrp")])
@pytest.mark.parametrize("zeros", [False, True])
def test_registered_convolution_non_pixel_is_alpha1_beta0(p, xs, ws, preset, rule, zeros):
    """aten.convolution not reading pixels: Eq. 5 α1β0 (chefer2021) / layers_lrp.Conv2d (lrp);
    zero inputs (e.g. after a ReLU) get exactly 0."""
    x, w = rand(xs, 41, torch.float32), rand(ws, 42, torch.float32)
    if zeros:
        x[..., ::2, :] = 0.0
    args = _conv_args(x, w, p)
    y = aten.convolution.default(*args)
    R = rand(y.shape, 43, torch.float32)
    r = registry.lookup(preset, aten.convolution.default)(
        make_ctx(aten.convolution.default, args, y, (True,) + (False,) * 8, preset=preset), R)
    assert len(r) == 9 and all(t is None for t in r[1:])
    assert_clean(r[0])
    assert (r[0][x == 0] == 0).all()
    torch.testing.assert_close(r[0].double(), ref_conv(x, w, p, R, EPS, rule), **F32)


@pytest.mark.parametrize("p, xs, ws", CONV_CASES)
@pytest.mark.parametrize("preset", ["chefer2021", "lrp"])
def test_registered_convolution_reading_pixels_is_z_box(p, xs, ws, preset):
    """aten.convolution with options reads_pixels={node: True}: supp. §B z^B, per-sample min/max."""
    x, w = rand(xs, 51, torch.float32), rand(ws, 52, torch.float32)
    args = _conv_args(x, w, p)
    y = aten.convolution.default(*args)
    R = rand(y.shape, 53, torch.float32)
    ctx = make_ctx(aten.convolution.default, args, y, (True,) + (False,) * 8, preset=preset)
    ctx.options = {"reads_pixels": {ctx.node.name: True}}
    r = registry.lookup(preset, aten.convolution.default)(ctx, R)
    X = np64(x)
    low = [float(X[n].min()) for n in range(xs[0])]
    high = [float(X[n].max()) for n in range(xs[0])]
    torch.testing.assert_close(r[0].double(), ref_conv(x, w, p, R, EPS, "zbox", low, high), **F32)
    # another node's name in the option does not switch the rule
    ctx.options = {"reads_pixels": {ctx.node.name + "_other": True}}
    r2 = registry.lookup(preset, aten.convolution.default)(ctx, R)
    other = "ab" if preset == "chefer2021" else "lrp"
    torch.testing.assert_close(r2[0].double(), ref_conv(x, w, p, R, EPS, other), **F32)


# ------------------------------------------------------------------------------------------------
# pass-through rules: activations, softmax, LayerNorm, scaling (CVPR 2021 code: R_in = R_out)
# ------------------------------------------------------------------------------------------------
PASS_CASES = [
    (aten.gelu.default, lambda x: (x,)),
    (aten.tanh.default, lambda x: (x,)),
    (aten.relu.default, lambda x: (x,)),
    (aten.softmax.int, lambda x: (x, -1)),
    (aten._softmax.default, lambda x: (x, -1, False)),
    (aten.layer_norm.default, lambda x: (x, [x.shape[-1]], torch.ones(x.shape[-1]), torch.zeros(x.shape[-1]), 1e-5)),
    (aten.mul.Scalar, lambda x: (x, 0.125)),
    (aten.div.Scalar, lambda x: (x, 8.0)),
    (aten.div.Tensor, lambda x: (x, torch.tensor(8.0))),
    (aten.mul.Tensor, lambda x: (x, torch.tensor(0.125))),
]


@pytest.mark.parametrize("op, make_args", PASS_CASES, ids=[str(c[0]) for c in PASS_CASES])
@pytest.mark.parametrize("preset", ["chefer2021", "lrp"])
def test_pass_through_rules_are_identity(op, make_args, preset):
    """§3.2 / supp. §B (authors' RelProp.relprop): GELU, softmax, LayerNorm, scaling: R_in = R_out."""
    x = rand((2, 3, 4), 61, torch.float32)
    args = make_args(x)
    out = op(*args)
    R = rand(out.shape, 62, torch.float32)
    live = (True,) + (False,) * (len(args) - 1)
    r = registry.lookup(preset, op)(make_ctx(op, args, out, live, preset=preset), R)
    assert len(r) == len(args)
    assert torch.equal(r[0], R)
    assert all(t is None for t in r[1:])


@pytest.mark.parametrize("as_tuple", [True, False])
def test_native_layer_norm_is_identity(as_tuple):
    """LayerNorm (native_layer_norm returns (y, mean, rstd)): R_x = R_y, gain/bias get none."""
    x = rand((2, 3, 4), 63, torch.float32)
    args = (x, [4], torch.ones(4), torch.zeros(4), 1e-5)
    out = aten.native_layer_norm.default(*args)
    R = rand((2, 3, 4), 64, torch.float32)
    rel = (R, None, None) if as_tuple else R
    r = registry.lookup("chefer2021", aten.native_layer_norm.default)(
        make_ctx(aten.native_layer_norm.default, args, out[0], (True, False, False, False, False)), rel)
    assert torch.equal(r[0], R) and all(t is None for t in r[1:])


def test_division_by_live_statistic_passes_relevance_to_numerator():
    """x / f(x) (a norm, a std): relevance goes to x unchanged, the statistic gets none (the
    LayerNorm convention of the CVPR 2021 code); the rule declares the divisor blocked."""
    x = rand((2, 3), 65, torch.float32)
    d = x.abs() + 1
    R = rand((2, 3), 66, torch.float32)
    fn = registry.lookup("chefer2021", aten.div.Tensor)
    out = fn(make_ctx(aten.div.Tensor, (x, d), x / d, (True, True)), R)
    assert torch.equal(out[0], R) and out[1] is None
    assert 1 in fn.no_relevance_to


# ------------------------------------------------------------------------------------------------
# routing rules: relevance of an input element = Σ relevance of the output elements that copied it
# ------------------------------------------------------------------------------------------------
def ref_route(op, args, tensor_pos, R):
    """Label every element of every input tensor with a unique integer, run the op's *forward* on
    the labels, then walk the output: each output element hands its relevance to the input
    element whose label it carries (constants of other dtypes are labelled too)."""
    labelled = list(args)
    owners = {}
    offset = 0
    for k in tensor_pos:
        t = args[k]
        lab = torch.arange(offset, offset + t.numel(), dtype=torch.int64).reshape(t.shape)
        for flat, idx in enumerate(np.ndindex(*t.shape)):
            owners[offset + flat] = (k, idx)
        offset += t.numel()
        labelled[k] = lab
    out_labels = op(*labelled).numpy()
    RR = np64(R)
    out = {k: np.zeros(args[k].shape) for k in tensor_pos}
    for o in np.ndindex(*out_labels.shape):
        k, idx = owners[int(out_labels[o])]
        out[k][idx] += RR[o]
    return {k: torch.from_numpy(v) for k, v in out.items()}


def _route_case(op, args, tensor_pos):
    out = op(*args)
    R = rand(out.shape, 71, torch.float32)
    live = tuple(True if i in tensor_pos else False for i in range(len(args)))
    r = registry.lookup("chefer2021", op)(make_ctx(op, args, out, live), R)
    assert registry.lookup("lrp", op) is registry.lookup("chefer2021", op)
    return r, ref_route(op, args, tensor_pos, R)


X234 = rand((2, 3, 4), 70, torch.float32)
ROUTE_CASES = [
    ("permute", aten.permute.default, (X234, [2, 0, 1])),
    ("permute_neg", aten.permute.default, (X234, [-1, 0, -2])),
    ("transpose", aten.transpose.int, (X234, 0, 2)),
    ("transpose_neg", aten.transpose.int, (X234, -1, -2)),
    ("t", aten.t.default, (X234[0],)),
    ("expand_lead", aten.expand.default, (X234[0, :, :1], [2, 3, 5])),
    ("expand_minus1", aten.expand.default, (X234[:1, :1], [3, -1, 4])),
    ("expand_vec", aten.expand.default, (X234[0, 0], [2, 3, 4])),
    ("slice_step", aten.slice.Tensor, (X234, 2, 1, 4, 2)),
    ("slice_negstart_maxend", aten.slice.Tensor, (X234, 1, -2, sys.maxsize, 1)),
    ("slice_past_end", aten.slice.Tensor, (X234, 0, 1, 100)),
    ("slice_default", aten.slice.Tensor, (X234,)),
    ("select", aten.select.int, (X234, 1, 2)),
    ("select_neg", aten.select.int, (X234, 2, -1)),
    ("select_dim0", aten.select.int, (X234, 0, 0)),
    ("reshape", aten.view.default, (X234, [6, 4])),
    ("index_select_repeat", aten.index_select.default, (X234, 2, torch.tensor([3, 0, 3, 3]))),
    ("gather_repeat", aten.gather.default, (X234, 1, torch.tensor([[[0, 2, 2, 1]], [[1, 1, 0, 0]]]))),
    ("index_first_dim", aten.index.Tensor, (X234, [torch.tensor([1, 0, 1])])),
    ("index_none_then_repeat", aten.index.Tensor, (X234, [None, torch.tensor([2, 0, 2])])),  # x[:, idx] (Falcon)
]


@pytest.mark.parametrize("name, op, args", ROUTE_CASES, ids=[c[0] for c in ROUTE_CASES])
def test_routing_rules_match_index_bookkeeping(name, op, args):
    """Shape-only ops: R_in[i] = Σ_{o copied from i} R_out[o] (dropped elements get 0)."""
    r, ref = _route_case(op, args, [0])
    assert r[0].shape == args[0].shape
    torch.testing.assert_close(r[0].double(), ref[0], rtol=1e-6, atol=1e-6)
    assert all(t is None for t in r[1:])


CAT_CASES = [
    ("cat_lastdim",
     [rand((2, 3), 1, torch.float32), rand((2, 1), 2, torch.float32), rand((2, 4), 3, torch.float32)], -1),
    ("cat_dim0", [rand((1, 3), 1, torch.float32), rand((2, 3), 2, torch.float32)], 0),
    ("cat_zero_size", [rand((2, 0), 1, torch.float32), rand((2, 3), 2, torch.float32)], 1),
    ("cat_legacy_empty", [torch.empty(0), rand((2, 3), 2, torch.float32)], 0),
]


@pytest.mark.parametrize("name, tensors, dim", CAT_CASES, ids=[c[0] for c in CAT_CASES])
def test_cat_rule_matches_index_bookkeeping(name, tensors, dim):
    """(cat, e.g. [CLS]; patches): each piece gets back its slice of the relevance."""
    out = aten.cat.default(tensors, dim)
    R = rand(out.shape, 72, torch.float32)
    r = registry.lookup("chefer2021", aten.cat.default)(
        make_ctx(aten.cat.default, (tensors, dim), out, ([True] * len(tensors), False)), R)
    pieces = r[0]
    assert len(pieces) == len(tensors) and r[1] is None
    # reference: label every piece, cat the labels, hand each output element back
    offset, labels, owners = 0, [], {}
    for k, t in enumerate(tensors):
        labels.append(torch.arange(offset, offset + t.numel()).reshape(t.shape))
        for flat, idx in enumerate(np.ndindex(*t.shape)):
            owners[offset + flat] = (k, idx)
        offset += t.numel()
    out_labels = torch.cat(labels, dim).numpy()
    ref = [np.zeros(t.shape) for t in tensors]
    RR = np64(R)
    for o in np.ndindex(*out_labels.shape):
        k, idx = owners[int(out_labels[o])]
        ref[k][idx] += RR[o]
    for t, piece, rr in zip(tensors, pieces, ref):
        if t.dim() == 1 and t.numel() == 0:
            assert piece is None
            continue
        assert piece.shape == t.shape
        torch.testing.assert_close(piece.double(), torch.from_numpy(rr), rtol=0, atol=0)


WHERE_CASES = [
    ("same_shape", (3, 4), (3, 4), (3, 4)),
    ("broadcast", (3, 4), (3, 1), (4,)),
    ("scalar_other", (3, 4), (3, 4), ()),
    ("broadcast_cond", (1, 4), (3, 4), (3, 4)),
]


@pytest.mark.parametrize("name, cs, as_, bs", WHERE_CASES, ids=[c[0] for c in WHERE_CASES])
def test_where_rule_matches_index_bookkeeping(name, cs, as_, bs):
    """(where, e.g. SDPA's masked rows): each element's R goes to the operand it came from."""
    g = torch.Generator().manual_seed(5)
    cond = torch.rand(cs, generator=g) < 0.5
    a, b = rand(as_, 73, torch.float32), rand(bs, 74, torch.float32)
    out = aten.where.self(cond, a, b)
    R = rand(out.shape, 75, torch.float32)
    r = registry.lookup("chefer2021", aten.where.self)(
        make_ctx(aten.where.self, (cond, a, b), out, (False, True, False)), R)
    assert r[0] is None
    ref = ref_route(aten.where.self, (cond, a, b), [1, 2], R)
    torch.testing.assert_close(reduce_to(r[1], a.shape), ref[1], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(reduce_to(r[2], b.shape), ref[2], rtol=1e-6, atol=1e-6)
    # nothing is created or lost: where only routes
    torch.testing.assert_close(r[1].sum() + r[2].sum(), R.sum(), rtol=1e-5, atol=1e-5)
