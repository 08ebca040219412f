"""The rules for the ops of hybrid (convolution + attention) models against slow references written
from their formulas with Python loops, in float64: BatchNorm in inference, GroupNorm, pooling and
upsampling, the element-wise activations kept whole (hardswish, hardsigmoid, mish) and clamps;
their gradient forms; and the generic z-rule of ``unsupported="z_rule"`` on awkward ops (tuple
outputs, integer/boolean and list arguments, keyword arguments).

References use the safe_divide stabilizer on Python floats (:func:`sdiv`): num / (den ± ε), 0
where den is 0 or not finite.
"""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
import torch.fx

from relprop.rules.generic import gradient_times_input
from relprop.rules.gradient_forms import _GroupNormConstStd, stabilize

from rule_helpers import make_ctx, np64, rand, rule_of, sdiv

aten = torch.ops.aten
EPS = 1e-9
F64 = dict(rtol=1e-9, atol=1e-12)
ALL_PRESETS = ["chefer2021", "lrp", "attnlrp", "cp_lrp"]
PAPER = ["chefer2021", "lrp"]
EPSILON = ["attnlrp", "cp_lrp"]


# ------------------------------------------------------------------------------------------------
# BatchNorm in inference
# ------------------------------------------------------------------------------------------------
BN = aten._native_batch_norm_legit_no_training.default


def _bn_case(shape, seed, affine=True):
    c = shape[1]
    x = rand(shape, seed)
    gamma = 1 + 0.3 * rand((c,), seed + 1) if affine else None
    beta = 0.5 * rand((c,), seed + 2) if affine else None
    mean, var = 0.5 * rand((c,), seed + 3), 0.5 + rand((c,), seed + 4).abs()
    args = (x, gamma, beta, mean, var, 0.1, 1e-5)
    out = BN(*args)
    R = rand(out[0].shape, seed + 5)
    return args, out, R


def _per_element(shape):
    return np.ndindex(*shape)


@pytest.mark.parametrize("preset", PAPER)
@pytest.mark.parametrize("shape", [(2, 3, 4, 5), (6, 4), (2, 3, 5)])
def test_batch_norm_paper_presets_match_reference(preset, shape):
    """chefer2021/lrp (authors' layers_ours.BatchNorm2d.relprop): z-rule on the scaling alone,
    R_x = x a R / (x a), a = γ / √(σ² + ε_bn); the shift gets nothing."""
    args, out, R = _bn_case(shape, 1)
    x, gamma, _, _, var = (np64(a) if torch.is_tensor(a) else a for a in args[:5])
    Rn = np64(R)
    ref = np.zeros(x.shape)
    for idx in _per_element(x.shape):
        c = idx[1]
        z = x[idx] * gamma[c] / math.sqrt(var[c] + 1e-5)
        ref[idx] = z * sdiv(Rn[idx], z)
    shares = rule_of(BN, preset)(make_ctx(BN, args, out, (True,) + (False,) * 6, preset=preset), [R, None, None])
    torch.testing.assert_close(shares[0], torch.from_numpy(ref), **F64)
    assert all(s is None for s in shares[1:])


@pytest.mark.parametrize("preset", EPSILON)
@pytest.mark.parametrize("shape, affine", [((2, 3, 4, 5), True), ((6, 4), True), ((2, 3, 4, 5), False)])
def test_batch_norm_epsilon_rule_matches_reference(preset, shape, affine):
    """attnlrp/cp_lrp: ε-rule on y = a x + c (AttnLRP Eq. 8): R_x = a x R / y; the shift absorbs
    c R / y, booked as β R / y (bias) and −a μ R / y (running mean)."""
    args, out, R = _bn_case(shape, 2, affine)
    x, mean, var = np64(args[0]), np64(args[3]), np64(args[4])
    gamma = np64(args[1]) if affine else np.ones(shape[1])
    beta = np64(args[2]) if affine else np.zeros(shape[1])
    Rn, Y = np64(R), np64(out[0])
    rx, rb, rm = np.zeros(x.shape), np.zeros(x.shape), np.zeros(x.shape)
    for idx in _per_element(x.shape):
        c = idx[1]
        a = gamma[c] / math.sqrt(var[c] + 1e-5)
        y = a * x[idx] + beta[c] - a * mean[c]
        assert abs(y - Y[idx]) < 1e-12
        rx[idx] = sdiv(a * x[idx] * Rn[idx], y)
        rb[idx] = sdiv(beta[c] * Rn[idx], y)
        rm[idx] = sdiv(-a * mean[c] * Rn[idx], y)
    shares = rule_of(BN, preset)(make_ctx(BN, args, out, (True,) + (False,) * 6, preset=preset),
                                 [R, torch.zeros(0), torch.zeros(0)])
    torch.testing.assert_close(shares[0], torch.from_numpy(rx), **F64)
    if affine:
        torch.testing.assert_close(shares[2], torch.from_numpy(rb), **F64)
    else:
        assert shares[2] is None
    torch.testing.assert_close(shares[3], torch.from_numpy(rm), **F64)
    total = sum(float(s.sum()) for s in shares if s is not None)
    assert abs(total - float(R.sum())) < 1e-6  # conservative up to ε
    assert shares[1] is None and all(s is None for s in shares[4:])


def test_batch_norm_in_training_mode_is_refused():
    """``native_batch_norm`` with training=True normalizes with batch statistics: not an affine map
    with constant coefficients, so the rule does not apply (the engine then raises)."""
    op = aten.native_batch_norm.default
    x = rand((4, 3), 3)
    args = (x, None, None, torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64), True, 0.1, 1e-5)
    out = op(*args)
    for preset in ALL_PRESETS:
        assert rule_of(op, preset)(make_ctx(op, args, out, (True,) + (False,) * 7, preset=preset),
                                   [rand((4, 3), 4), None, None]) is None


# ------------------------------------------------------------------------------------------------
# GroupNorm
# ------------------------------------------------------------------------------------------------
GN = aten.native_group_norm.default


def _gn_case(seed, groups=2, affine=True):
    n, c, h, w = 2, 4, 2, 3
    x = rand((n, c, h, w), seed)
    gamma = 1 + 0.3 * rand((c,), seed + 1) if affine else None
    beta = 0.5 * rand((c,), seed + 2) if affine else None
    args = (x, gamma, beta, n, c, h * w, groups, 1e-5)
    return args, GN(*args), rand((n, c, h, w), seed + 3)


@pytest.mark.parametrize("preset", PAPER)
def test_group_norm_paper_presets_identity(preset):
    """chefer2021/lrp: GroupNorm passes relevance unchanged, as the authors' LayerNorm."""
    args, out, R = _gn_case(5)
    shares = rule_of(GN, preset)(make_ctx(GN, args, out, (True,) + (False,) * 7, preset=preset), [R, None, None])
    assert torch.equal(shares[0], R) and all(s is None for s in shares[1:])


@pytest.mark.parametrize("preset", EPSILON)
@pytest.mark.parametrize("groups, affine", [(2, True), (1, True), (4, False)])
def test_group_norm_epsilon_rule_matches_reference(preset, groups, affine):
    """attnlrp (Prop. 3.4 + Eq. 8): within a group g of N elements, σ_g constant,
    R_i = Σ_j x_i (γ_j/σ_g)(δ_ij − 1/N) R_j / y_j; β's share β_j R_j / y_j is absorbed."""
    args, out, R = _gn_case(6, groups, affine)
    x, Rn, Y = np64(args[0]), np64(R), np64(out[0])
    n, c = x.shape[:2]
    gamma = np64(args[1]) if affine else np.ones(c)
    beta = np64(args[2]) if affine else np.zeros(c)
    rx, rb = np.zeros(x.shape), np.zeros(x.shape)
    per = c // groups
    for s, g in itertools.product(range(n), range(groups)):
        idx = [(s, ch, i, j) for ch in range(g * per, (g + 1) * per) for i in range(x.shape[2])
               for j in range(x.shape[3])]
        vals = [x[k] for k in idx]
        mu = sum(vals) / len(vals)
        sigma = math.sqrt(sum((v - mu) ** 2 for v in vals) / len(vals) + 1e-5)
        for ki in idx:
            for kj in idx:
                rx[ki] += sdiv(x[ki] * gamma[kj[1]] / sigma * ((ki == kj) - 1 / len(idx)) * Rn[kj], Y[kj])
        for kj in idx:
            rb[kj] = sdiv(beta[kj[1]] * Rn[kj], Y[kj])
    shares = rule_of(GN, preset)(make_ctx(GN, args, out, (True,) + (False,) * 7, preset=preset), [R, None, None])
    torch.testing.assert_close(shares[0], torch.from_numpy(rx), rtol=1e-8, atol=1e-10)
    if affine:
        torch.testing.assert_close(shares[2], torch.from_numpy(rb), rtol=1e-8, atol=1e-10)
    else:
        assert shares[2] is None
    assert shares[1] is None and all(s is None for s in shares[3:])


def test_group_norm_gradient_form_holds_the_std_constant():
    """The fast path's GroupNorm backward equals autograd through GroupNorm written out with each
    group's standard deviation detached (AttnLRP Prop. 3.4); the forward values are the op's."""
    x = rand((2, 4, 2, 3), 7).requires_grad_(True)
    gamma, beta, g = rand((4,), 8), rand((4,), 9), rand((2, 4, 2, 3), 10)
    y, mean, rstd = _GroupNormConstStd.apply(x, gamma, beta, 2, 4, 6, 2, 1e-5)
    ref_out = GN(x.detach(), gamma, beta, 2, 4, 6, 2, 1e-5)
    for got, ref in zip((y, mean, rstd), ref_out):
        torch.testing.assert_close(got, ref, **F64)
    (got,) = torch.autograd.grad(y, x, g)
    xg = x.reshape(2, 2, -1)
    mu = xg.mean(-1, keepdim=True)
    sd = (xg.var(-1, unbiased=False, keepdim=True) + 1e-5).sqrt().detach()
    ref_y = ((xg - mu) / sd).reshape(x.shape) * gamma.reshape(1, -1, 1, 1) + beta.reshape(1, -1, 1, 1)
    (ref,) = torch.autograd.grad(ref_y, x, g)
    torch.testing.assert_close(got, ref, **F64)


def test_stabilizer_gradient_form():
    """The ε-rule's stabilizer in gradient form: identity forward, backward g·z/(z + ε·sign z),
    0 where z is 0 or not finite (the interpreter's safe_divide)."""
    z = torch.tensor([2.0, -3.0, 0.0, 1e-7, -1e-7, math.inf, -math.inf], dtype=torch.float64, requires_grad=True)
    g = torch.linspace(1, 2, 7, dtype=torch.float64)
    eps = 1e-6
    y = stabilize(z, eps)
    assert torch.equal(y, z)
    (got,) = torch.autograd.grad(y, z, g)
    ref = torch.tensor([gi * sdiv(zi, zi, eps) for gi, zi in zip(g.tolist(), z.tolist())], dtype=torch.float64)
    torch.testing.assert_close(got, ref, rtol=1e-15, atol=0)
    (got,) = torch.autograd.grad(stabilize(z, eps, 3.0), z, g)  # a mean: the denominator is 3 z
    ref = torch.tensor([gi * sdiv(3 * zi, 3 * zi, eps) for gi, zi in zip(g.tolist(), z.tolist())],
                       dtype=torch.float64)
    torch.testing.assert_close(got, ref, rtol=1e-15, atol=0)


# ------------------------------------------------------------------------------------------------
# pooling and upsampling: R_x = x ⊙ Jᵀ (R / y) over explicit index maps
# ------------------------------------------------------------------------------------------------
def _out_size(n, k, s, p, d, ceil_mode):
    span = n + 2 * p - d * (k - 1) - 1
    out = (span + (s - 1 if ceil_mode else 0)) // s + 1
    if ceil_mode and (out - 1) * s >= n + p:
        out -= 1
    return out


def avg_pool_connections(shape, k, s, p, ceil_mode, count_include_pad, divisor):
    """{output index: [(input index, weight)]} of avg_pool{1,2,3}d over the last len(k) dims."""
    lead, spatial = shape[:-len(k)], shape[-len(k):]
    outs = [_out_size(n, kk, ss, pp, 1, ceil_mode) for n, kk, ss, pp in zip(spatial, k, s, p)]
    conns = {}
    for pre in np.ndindex(*lead):
        for o in itertools.product(*[range(m) for m in outs]):
            ranges, full = [], 1
            for oi, n, kk, ss, pp in zip(o, spatial, k, s, p):
                start = oi * ss - pp
                end = min(start + kk, n + pp)
                full *= end - start
                ranges.append(range(max(start, 0), min(end, n)))
            cells = list(itertools.product(*ranges))
            div = divisor if divisor else (full if count_include_pad else len(cells))
            conns[pre + o] = [(pre + c, 1.0 / div) for c in cells]
    return conns, tuple(lead) + tuple(outs)


def adaptive_windows(n, out):
    return [range(math.floor(i * n / out), math.ceil((i + 1) * n / out)) for i in range(out)]


def adaptive_connections(shape, out_hw, reduce):
    lead, (h, w) = shape[:-2], shape[-2:]
    conns = {}
    for pre in np.ndindex(*lead):
        for i, ri in enumerate(adaptive_windows(h, out_hw[0])):
            for j, rj in enumerate(adaptive_windows(w, out_hw[1])):
                cells = [pre + (a, b) for a in ri for b in rj]
                conns[pre + (i, j)] = reduce(cells)
    return conns


def max_pool_connections(X, k, s, p, d, ceil_mode):
    lead, (h, w) = X.shape[:-2], X.shape[-2:]
    oh, ow = (_out_size(n, kk, ss, pp, dd, ceil_mode) for n, kk, ss, pp, dd in zip((h, w), k, s, p, d))
    conns = {}
    for pre in np.ndindex(*lead):
        for i, j in itertools.product(range(oh), range(ow)):
            cells = [pre + (i * s[0] - p[0] + a * d[0], j * s[1] - p[1] + b * d[1])
                     for a in range(k[0]) for b in range(k[1])]
            cells = [c for c in cells if 0 <= c[-2] < h and 0 <= c[-1] < w]
            best = max(cells, key=lambda c: X[c])
            conns[pre + (i, j)] = [(best, 1.0)]
    return conns


def upsample_connections(shape, out_hw, mode, align_corners=False):
    lead, (h, w) = shape[:-2], shape[-2:]

    def taps(o, n_in, n_out):
        if mode == "nearest":
            return [(min(math.floor(o * n_in / n_out), n_in - 1), 1.0)]
        if align_corners:
            src = o * (n_in - 1) / (n_out - 1) if n_out > 1 else 0.0
        else:
            src = max((o + 0.5) * n_in / n_out - 0.5, 0.0)
        i0 = min(math.floor(src), n_in - 1)
        i1 = min(i0 + 1, n_in - 1)
        lam = src - i0
        return [(i0, 1 - lam), (i1, lam)]

    conns = {}
    for pre in np.ndindex(*lead):
        for i, j in itertools.product(range(out_hw[0]), range(out_hw[1])):
            conns[pre + (i, j)] = [(pre + (a, b), wa * wb) for a, wa in taps(i, h, out_hw[0])
                                   for b, wb in taps(j, w, out_hw[1])]
    return conns


def ref_z_rule(conns, x, y, R, eps=EPS):
    """R_i = Σ_j x_i w_ji R_j / y_j over the explicit connections; checks Σ_i w_ji x_i = y_j."""
    X, Y, Rn = np64(x), np64(y), np64(R)
    out = np.zeros(X.shape)
    for j, lst in conns.items():
        z = sum(w * X[i] for i, w in lst)
        assert abs(z - Y[j]) < 1e-10 * max(1.0, abs(z)), (j, z, Y[j])
        for i, w in lst:
            out[i] += sdiv(X[i] * w * Rn[j], Y[j], eps)
    return torch.from_numpy(out)


def _check_pool_rule(op, args, conns, out):
    y = out[0] if isinstance(out, tuple) else out
    R = rand(y.shape, 20)
    ref = ref_z_rule(conns, args[0], y, R)
    relevance = [R, torch.zeros(out[1].shape)] if isinstance(out, tuple) else R
    for preset in ALL_PRESETS:
        shares = rule_of(op, preset)(make_ctx(op, args, out, (True,) + (False,) * (len(args) - 1), preset=preset),
                                     relevance)
        torch.testing.assert_close(shares[0], ref, **F64)
        assert all(s is None for s in shares[1:])


AVG_CASES = [
    ((2, 3, 5, 6), [3, 3], [1, 1], [1, 1], False, False, None),  # PoolFormer's token mixer
    ((2, 3, 5, 6), [3, 3], [1, 1], [1, 1], False, True, None),
    ((1, 2, 5, 7), [2, 3], [2, 2], [1, 1], True, True, None),
    ((1, 2, 5, 7), [2, 2], [2, 2], [0, 0], True, False, None),
    ((2, 2, 4, 4), [2, 2], [2, 2], [0, 0], False, True, 3),
]


@pytest.mark.parametrize("shape, k, s, p, ceil_mode, include_pad, divisor", AVG_CASES)
def test_avg_pool2d_matches_reference(shape, k, s, p, ceil_mode, include_pad, divisor):
    """avg_pool2d (every padding/ceil/divisor variant): z-rule (chefer2021/lrp, authors'
    RelPropSimple) and ε-rule (attnlrp), the same formula R_i = Σ_j x_i w_ji R_j / y_j."""
    op = aten.avg_pool2d.default
    x = rand(shape, 11)
    args = (x, k, s, p, ceil_mode, include_pad, divisor)
    conns, _ = avg_pool_connections(shape, k, s, p, ceil_mode, include_pad, divisor)
    _check_pool_rule(op, args, conns, op(*args))


def test_avg_pool3d_and_adaptive_avg_pool2d_match_reference():
    """avg_pool3d and adaptive average pooling (uneven windows): z-rule / ε-rule."""
    x = rand((1, 2, 3, 4, 5), 12)
    args = (x, [2, 2, 3], [1, 2, 2], [0, 1, 1], False, False, None)
    conns, _ = avg_pool_connections(x.shape, [2, 2, 3], [1, 2, 2], [0, 1, 1], False, False, None)
    _check_pool_rule(aten.avg_pool3d.default, args, conns, aten.avg_pool3d.default(*args))
    x = rand((2, 3, 5, 7), 13)
    conns = adaptive_connections(x.shape, (2, 3), lambda cells: [(c, 1.0 / len(cells)) for c in cells])
    op = aten._adaptive_avg_pool2d.default
    _check_pool_rule(op, (x, [2, 3]), conns, op(x, [2, 3]))


def test_max_pooling_gives_each_window_to_its_maximum():
    """max_pool2d_with_indices and adaptive_max_pool2d (values, indices): the z-rule gives each
    window's relevance to its maximum (x_max R / y = R, stabilized); the indices get none."""
    x = rand((2, 3, 6, 5), 14)
    op = aten.max_pool2d_with_indices.default
    args = (x, [3, 2], [2, 2], [1, 0], [1, 1], False)
    conns = max_pool_connections(np64(x), [3, 2], [2, 2], [1, 0], [1, 1], False)
    _check_pool_rule(op, args, conns, op(*args))
    op = aten.adaptive_max_pool2d.default
    X = np64(x)
    conns = adaptive_connections(x.shape, (2, 3), lambda cells: [(max(cells, key=lambda c: X[c]), 1.0)])
    _check_pool_rule(op, (x, [2, 3]), conns, op(x, [2, 3]))


@pytest.mark.parametrize("mode, align_corners", [("nearest", None), ("bilinear", False), ("bilinear", True)])
def test_upsampling_matches_reference(mode, align_corners):
    """upsample_nearest2d / upsample_bilinear2d (linear maps without bias): z-rule / ε-rule over
    the interpolation weights."""
    x = rand((2, 3, 3, 4), 15)
    size = [5, 8]
    if mode == "nearest":
        op, args = aten.upsample_nearest2d.vec, (x, size, None)
    else:
        op, args = aten.upsample_bilinear2d.vec, (x, size, align_corners, None)
    conns = upsample_connections(x.shape, size, mode, bool(align_corners))
    _check_pool_rule(op, args, conns, op(*args))


# ------------------------------------------------------------------------------------------------
# activations of hybrid models: identity rule
# ------------------------------------------------------------------------------------------------
ONE_INPUT = [(aten.hardswish.default, ()), (aten.hardsigmoid.default, ()), (aten.mish.default, ()),
             (aten.clamp.default, (-0.5, 0.7)), (aten.clamp.default, (0.0,)), (aten.clamp_min.default, (0.1,)),
             (aten.clamp_max.default, (0.2,))]


@pytest.mark.parametrize("op, extra", ONE_INPUT, ids=[f"{o}{e}" for o, e in ONE_INPUT])
@pytest.mark.parametrize("preset", ALL_PRESETS)
def test_activations_pass_relevance(op, extra, preset):
    """Hardswish, hardsigmoid, mish, clamps: element-wise functions of one input, the identity rule
    (CVPR 2021 code's non-linearities; AttnLRP Eq. 9): R_x = R_y, the bounds get none."""
    x = rand((2, 3, 4), 16)
    y = op(x, *extra)
    R = rand(y.shape, 17)
    out = rule_of(op, preset)(make_ctx(op, (x,) + extra, y, (True,) + (False,) * len(extra), preset=preset), R)
    assert torch.equal(out[0], R) and all(t is None for t in out[1:])


# ------------------------------------------------------------------------------------------------
# the generic z-rule (unsupported="z_rule") on awkward ops
# ------------------------------------------------------------------------------------------------
def _z_ctx(op, args, out, live, kwargs=None):
    return make_ctx(op, args, out, live, kwargs=kwargs)


def test_generic_rule_on_tuple_output_with_numbers():
    """``_native_batch_norm_legit_no_training`` returns (y, mean, invstd) and takes floats
    (momentum, eps): relevance arrives for y only (zeros for the rest); R_x = x a R / y."""
    args, out, R = _bn_case((2, 3, 4), 18)
    shares = gradient_times_input(_z_ctx(BN, args, out, (True,) + (False,) * 6),
                                  [R, torch.zeros_like(out[1]), torch.zeros_like(out[2])])
    a = (args[1] / (args[4] + 1e-5).sqrt()).reshape(1, -1, 1)
    torch.testing.assert_close(shares[0], args[0] * a * R / (out[0] + EPS * out[0].sign()), **F64)
    assert all(s is None for s in shares[1:])
    # a tuple output whose second element is an integer tensor (max pooling's indices)
    x = rand((1, 2, 4, 4), 19)
    op = aten.max_pool2d_with_indices.default
    out = op(x, [2, 2], [2, 2])
    shares = gradient_times_input(_z_ctx(op, (x, [2, 2], [2, 2]), out, (True, False, False)),
                                  [rand(out[0].shape, 20), torch.zeros(out[1].shape)])
    assert shares[0].shape == x.shape and (shares[0] != 0).sum() == out[0].numel()


def test_generic_rule_on_integer_boolean_and_list_arguments():
    """Integer and boolean live arguments (indices, masks) get no share; list arguments get a list
    of shares (each element's z-rule share)."""
    x = rand((4, 3), 21)
    idx = torch.tensor([2, 0, 2])
    op = aten.index_select.default
    y = op(x, 0, idx)
    R = rand(y.shape, 22)
    shares = gradient_times_input(_z_ctx(op, (x, 0, idx), y, (True, False, True)), R)
    ref = torch.zeros_like(x)
    for row, i in enumerate(idx.tolist()):
        ref[i] += x[i] * R[row] / (y[row] + EPS * y[row].sign())
    torch.testing.assert_close(shares[0], ref, **F64)
    assert shares[1] is None and shares[2] is None
    cond = x > 0
    op = aten.where.self
    y = op(cond, x, -x)
    shares = gradient_times_input(_z_ctx(op, (cond, x, -x), y, (True, True, True)), R.new_ones(y.shape))
    assert shares[0] is None and shares[1] is not None and shares[2] is not None
    a, b = rand((2, 3), 23), rand((2, 2), 24)
    op = aten.cat.default
    y = op([a, b], 1)
    R = rand(y.shape, 25)
    shares = gradient_times_input(_z_ctx(op, ([a, b], 1), y, ([True, True], False)), R)
    torch.testing.assert_close(shares[0][0], a * R[:, :3] / (a + EPS * a.sign()), **F64)
    torch.testing.assert_close(shares[0][1], b * R[:, 3:] / (b + EPS * b.sign()), **F64)
    assert shares[1] is None


def test_generic_rule_passes_keyword_arguments():
    """Keyword arguments reach the op: addmm with beta and alpha, R_x = α x (R / y) Wᵀ."""
    b, x, w = rand((3,), 26), rand((2, 4), 27), rand((4, 3), 28)
    op = aten.addmm.default
    y = op(b, x, w, beta=0.5, alpha=2.0)
    R = rand(y.shape, 29)
    shares = gradient_times_input(_z_ctx(op, (b, x, w), y, (False, True, False), {"beta": 0.5, "alpha": 2.0}), R)
    s = R / (y + EPS * y.sign())
    torch.testing.assert_close(shares[1], 2.0 * x * (s @ w.t()), **F64)
    assert shares[0] is None and shares[2] is None
