"""The ``"attnlrp"`` (Achtibat et al., ICML 2024) and ``"cp_lrp"`` (Ali et al., ICML 2022) presets
and their one-backward fast path.

* every rule against a slow reference written from its formula with Python loops (float64);
* the gradient forms against independent autograd implementations;
* the fast path (modified gradient) equals the interpreter (rule by rule) on tiny ViTs and BERT;
* conservation on bias-free random models: input + absorbed = injected (relative error < 1e-4);
* batch invariance, the preset choice of ``method="lrp"``, and the model left untouched.
"""
from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch
import torch.fx

import models
import relprop
from relprop.errors import MethodError
from relprop.graph.capture import CACHE
from relprop.graph.inputs import bind_inputs
from relprop.engine import supports
from relprop.engine.walk import STABILIZER
from relprop.rules.gradient_forms import _LayerNormConstStd, _RMSNormConstRMS
from snapshot import assert_same, snapshot
import rule_helpers
from rule_helpers import np64, rand, sdiv

aten = torch.ops.aten
EPS = 1e-9
F64 = dict(rtol=1e-9, atol=1e-12)
PRESETS = ["attnlrp", "cp_lrp"]


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------
make_ctx = functools.partial(rule_helpers.make_ctx, preset="attnlrp")


def rule_of(op, preset="attnlrp"):
    return rule_helpers.rule_of(op, preset)



# ------------------------------------------------------------------------------------------------
# ε-rule on linear maps (AttnLRP Eq. 8)
# ------------------------------------------------------------------------------------------------
def ref_epsilon_linear(x, W, b, R):
    """y_j = Σ_i x_i W_ji + b_j; R_i = Σ_j x_i W_ji R_j / y_j; bias share b_j R_j / y_j (loops)."""
    X, Wn, B, Rn = np64(x), np64(W), np64(b), np64(R)
    rx, rb = np.zeros(X.shape), np.zeros(Rn.shape)
    for lead in np.ndindex(*X.shape[:-1]):
        for j in range(Wn.shape[0]):
            y = sum(X[lead + (i,)] * Wn[j, i] for i in range(Wn.shape[1])) + B[j]
            for i in range(Wn.shape[1]):
                rx[lead + (i,)] += sdiv(X[lead + (i,)] * Wn[j, i] * Rn[lead + (j,)], y)
            rb[lead + (j,)] = sdiv(B[j] * Rn[lead + (j,)], y)
    return torch.from_numpy(rx), torch.from_numpy(rb)


@pytest.mark.parametrize("xs", [(3, 4), (2, 3, 4)])
def test_epsilon_linear_and_addmm_match_reference(xs):
    """aten.linear / aten.addmm: ε-rule with the bias in the denominator; the bias absorbs its share."""
    x, W, b = rand(xs, 1), rand((5, xs[-1]), 2), rand((5,), 3)
    y = aten.linear.default(x, W, b)
    R = rand(y.shape, 4)
    rx, rw, rb = rule_of(aten.linear.default)(make_ctx(aten.linear.default, (x, W, b), y, (True, False, False)), R)
    ref_x, ref_b = ref_epsilon_linear(x, W, b, R)
    assert rw is None
    torch.testing.assert_close(rx, ref_x, **F64)
    torch.testing.assert_close(rb, ref_b, **F64)
    torch.testing.assert_close(rx.sum() + rb.sum(), R.sum(), rtol=1e-7, atol=1e-9)
    if x.dim() == 2:
        y2 = aten.addmm.default(b, x, W.t())
        r = rule_of(aten.addmm.default)(make_ctx(aten.addmm.default, (b, x, W.t()), y2, (False, True, False)), R)
        assert r[2] is None
        torch.testing.assert_close(r[1], ref_x, **F64)
        torch.testing.assert_close(r[0], ref_b, **F64)


def test_epsilon_convolution_matches_reference():
    """Patch embedding (kernel = stride): ε-rule on every output position, bias absorbed."""
    x, w, b = rand((2, 3, 4, 4), 5), rand((4, 3, 2, 2), 6), rand((4,), 7)
    p = ([2, 2], [0, 0], [1, 1], False, [0, 0], 1)
    args = (x, w, b) + p
    y = aten.convolution.default(*args)
    R = rand(y.shape, 8)
    r = rule_of(aten.convolution.default)(make_ctx(aten.convolution.default, args, y, (True,) + (False,) * 8), R)
    X, Wn, B, Rn, Y = np64(x), np64(w), np64(b), np64(R), np64(y)
    rx, rb = np.zeros(X.shape), np.zeros(Y.shape)
    for n, o, h, v in np.ndindex(*Y.shape):
        z = B[o] + sum(X[n, c, 2 * h + i, 2 * v + k] * Wn[o, c, i, k]
                       for c in range(3) for i in range(2) for k in range(2))
        for c, i, k in np.ndindex(3, 2, 2):
            rx[n, c, 2 * h + i, 2 * v + k] += sdiv(X[n, c, 2 * h + i, 2 * v + k] * Wn[o, c, i, k] * Rn[n, o, h, v], z)
        rb[n, o, h, v] = sdiv(B[o] * Rn[n, o, h, v], z)
    torch.testing.assert_close(r[0], torch.from_numpy(rx), **F64)
    torch.testing.assert_close(r[2], torch.from_numpy(rb), **F64)
    assert all(t is None for t in (r[1],) + tuple(r[3:]))


# ------------------------------------------------------------------------------------------------
# products: uniform rule (Eq. 7, Props. 3.2–3.3) and CP-LRP's constant attention
# ------------------------------------------------------------------------------------------------
def ref_matmul(a, b, R, share_a=0.5, share_b=0.5):
    """z_jp = Σ_i a_ji b_ip; every term's ε-share R_jp a_ji b_ip / z_jp split share_a : share_b."""
    A, Bm, Rn = np64(a), np64(b), np64(R)
    ra, rb = np.zeros(A.shape), np.zeros(Bm.shape)
    for lead in np.ndindex(*A.shape[:-2]):
        for j, p in np.ndindex(A.shape[-2], Bm.shape[-1]):
            z = sum(A[lead + (j, i)] * Bm[lead + (i, p)] for i in range(A.shape[-1]))
            for i in range(A.shape[-1]):
                t = sdiv(A[lead + (j, i)] * Bm[lead + (i, p)] * Rn[lead + (j, p)], z)
                ra[lead + (j, i)] += share_a * t
                rb[lead + (i, p)] += share_b * t
    return torch.from_numpy(ra), torch.from_numpy(rb)


@pytest.mark.parametrize("op", [aten.matmul.default, aten.bmm.default])
def test_uniform_matmul_matches_reference(op):
    """Two live operands (A·V, Q·Kᵀ): ε-rule per term, then half to each operand (Prop. 3.3)."""
    a, b = rand((2, 3, 4), 9), rand((2, 4, 5), 10)
    z = op(a, b)
    R = rand(z.shape, 11)
    ra, rb = rule_of(op)(make_ctx(op, (a, b), z, (True, True)), R)
    ref_a, ref_b = ref_matmul(a, b, R)
    torch.testing.assert_close(ra, ref_a, **F64)
    torch.testing.assert_close(rb, ref_b, **F64)


@pytest.mark.parametrize("live", [(True, False), (False, True)])
def test_matmul_with_constant_operand_is_epsilon_rule(live):
    """One constant operand: a linear map without bias, the live operand gets the whole ε-share."""
    a, b = rand((2, 3, 4), 12), rand((4, 5), 13)
    z = a @ b
    R = rand(z.shape, 14)
    ra, rb = rule_of(aten.matmul.default)(make_ctx(aten.matmul.default, (a, b), z, live), R)
    ref_a, ref_b = ref_matmul(a, b.expand(2, 4, 5), R, 1.0, 1.0)
    if live[0]:
        assert rb is None
        torch.testing.assert_close(ra, ref_a, **F64)
    else:
        assert ra is None
        torch.testing.assert_close(rb.sum(0) if rb.dim() == 3 else rb, ref_b.sum(0), **F64)


def _graph(*specs):
    """A tiny fx graph: specs are (name, op, arg names, meta value); returns the nodes by name."""
    g, nodes = torch.fx.Graph(), {}
    for name, op, args, val in specs:
        if op is None:
            n = g.placeholder(name)
        else:
            n = g.call_function(op, tuple(nodes.get(x, x) if isinstance(x, str) else x for x in args))
        n.meta["val"] = val
        nodes[name] = n
    return nodes


def test_cp_lrp_attention_is_constant():
    """CP-LRP (Ali et al. 2022, LRP-AH): in A·V with A a softmax output, V gets the whole ε-share
    R_ip = Σ_j A_ji V_ip R_jp / z_jp and A gets none; any other product keeps the uniform rule."""
    s, v = rand((2, 3, 3), 15), rand((2, 3, 4), 16)
    A = torch.softmax(s, -1)
    nodes = _graph(("s", None, (), s), ("v", None, (), v), ("A", aten.softmax.int, ("s", -1), A),
                   ("z", aten.matmul.default, ("A", "v"), A @ v))
    R = rand((2, 3, 4), 17)
    ctx = make_ctx(aten.matmul.default, (A, v), A @ v, (True, True), preset="cp_lrp", node=nodes["z"])
    ra, rv = rule_of(aten.matmul.default, "cp_lrp")(ctx, R)
    assert ra is None
    torch.testing.assert_close(rv, ref_matmul(A, v, R, 1.0, 1.0)[1], **F64)
    # not attention (Q·Kᵀ): the uniform rule of "attnlrp"
    q = rand((2, 3, 4), 18)
    ctx2 = make_ctx(aten.matmul.default, (q, v.transpose(1, 2)), q @ v.transpose(1, 2), (True, True), preset="cp_lrp")
    R2 = rand((2, 3, 3), 19)
    got = rule_of(aten.matmul.default, "cp_lrp")(ctx2, R2)
    for g, r in zip(got, ref_matmul(q, v.transpose(1, 2), R2)):
        torch.testing.assert_close(g, r, **F64)


def test_products_uniform_constant_gate_and_statistic():
    """Element-wise products: two live factors R/2 each (Prop. 3.2); one constant factor R; a
    normalizing statistic (RMSNorm written out) gets none (Prop. 3.4); CP-LRP: a gate gets none."""
    x, u = rand((2, 3, 4), 20), rand((2, 3, 4), 21)
    R = rand((2, 3, 4), 22)
    mul = aten.mul.Tensor
    r = rule_of(mul)(make_ctx(mul, (x, u), x * u, (True, True)), R)
    assert torch.equal(r[0], R / 2) and torch.equal(r[1], R / 2)
    r = rule_of(mul)(make_ctx(mul, (x, u), x * u, (True, False)), R)
    assert torch.equal(r[0], R) and r[1] is None
    # x * rsqrt(mean(x²) + ε): the statistic is constant
    stat = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    nodes = _graph(("x", None, (), x), ("p", aten.pow.Tensor_Scalar, ("x", 2), x.pow(2)),
                   ("m", aten.mean.dim, ("p", [-1], True), x.pow(2).mean(-1, keepdim=True)),
                   ("e", aten.add.Tensor, ("m", 1e-6), None), ("r", aten.rsqrt.default, ("e",), stat),
                   ("y", mul, ("x", "r"), x * stat))
    r = rule_of(mul)(make_ctx(mul, (x, stat), x * stat, (True, True), node=nodes["y"]), R)
    assert torch.equal(r[0], R) and r[1] is None
    # CP-LRP: gelu(g) * u, the gate is constant
    g = rand((2, 3, 4), 23)
    nodes = _graph(("g", None, (), g), ("u", None, (), u),
                   ("a", aten.gelu.default, ("g",), torch.nn.functional.gelu(g)),
                   ("y", mul, ("a", "u"), None))
    gate = torch.nn.functional.gelu(g)
    r = rule_of(mul, "cp_lrp")(make_ctx(mul, (gate, u), gate * u, (True, True), preset="cp_lrp", node=nodes["y"]), R)
    assert r[0] is None and torch.equal(r[1], R)
    r = rule_of(mul, "attnlrp")(make_ctx(mul, (gate, u), gate * u, (True, True), node=nodes["y"]), R)
    assert torch.equal(r[0], R / 2) and torch.equal(r[1], R / 2)


# ------------------------------------------------------------------------------------------------
# sums (Eq. 8), softmax (Prop. 3.1), LayerNorm (Prop. 3.4), identity rule (Eq. 9)
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("op, sign", [(aten.add.Tensor, 1.0), (aten.sub.Tensor, -1.0)])
@pytest.mark.parametrize("live", [(True, True), (True, False)])
def test_epsilon_sum_matches_reference(op, sign, live):
    """u ± v (v broadcast, like a position embedding): R_u = u R / z, R_v = ±v R / z elementwise."""
    u, v = rand((2, 3, 4), 24), rand((3, 4), 25)
    z = op(u, v)
    R = rand(z.shape, 26)
    ru, rv = rule_of(op)(make_ctx(op, (u, v), z, live), R)
    U, V, Z, Rn = np64(u), np64(v.expand(2, 3, 4)), np64(z), np64(R)
    ref_u = np.vectorize(lambda a, zz, r: sdiv(a * r, zz))(U, Z, Rn)
    ref_v = np.vectorize(lambda a, zz, r: sdiv(sign * a * r, zz))(V, Z, Rn)
    torch.testing.assert_close(ru, torch.from_numpy(ref_u), **F64)
    torch.testing.assert_close(rv, torch.from_numpy(ref_v), **F64)


def test_epsilon_add_of_number_books_its_share():
    """x + c for a Python number c: R_x = x R / (x + c); c's share c R / (x + c) is returned so that
    the engine books it as absorbed (the plain gradient gives exactly x R / (x + c))."""
    x = rand((2, 5), 27)
    R = rand((2, 5), 28)
    rx, rc = rule_of(aten.add.Scalar)(make_ctx(aten.add.Scalar, (x, 0.5), x + 0.5, (True, False)), R)
    torch.testing.assert_close(rx, x * R / (x + 0.5 + EPS * torch.sign(x + 0.5)), **F64)
    torch.testing.assert_close(rx + rc, R, rtol=1e-6, atol=1e-8)  # up to the ε of the denominator


def test_pooling_matches_reference():
    """Sum/mean pooling: ε-rule on a sum, R_i = x_i R / Σ_k x_k."""
    x = rand((2, 3, 4), 29)
    for op, fn in [(aten.sum.dim_IntList, torch.sum), (aten.mean.dim, torch.mean)]:
        y = fn(x, 1)
        R = rand(y.shape, 30)
        r = rule_of(op)(make_ctx(op, (x, [1]), y, (True, False)), R)[0]
        X, Rn = np64(x), np64(R)
        ref = np.zeros(X.shape)
        for n, t, c in np.ndindex(*X.shape):
            ref[n, t, c] = sdiv(X[n, t, c] * Rn[n, c], X[n, :, c].sum())
        torch.testing.assert_close(r.double(), torch.from_numpy(ref), rtol=1e-5, atol=1e-6)  # computed in float32


@pytest.mark.parametrize("op, extra", [(aten.softmax.int, (-1,)), (aten._softmax.default, (-1, False)),
                                       (aten._safe_softmax.default, (-1,))])
def test_softmax_rule_matches_reference(op, extra):
    """AttnLRP Prop. 3.1: R_x,i = x_i (R_i − s_i Σ_j R_j); the bias term R − R_x goes to the op's
    constant ``dim`` argument (absorbed). Masked scores (most negative float) get 0, finitely."""
    x = rand((2, 3, 5), 31)
    x[0, 1, 3] = torch.finfo(torch.float64).min
    s = torch.softmax(x, -1)
    R = s * rand(s.shape, 32)  # relevance of a probability is zero where it is zero
    out = rule_of(op)(make_ctx(op, (x,) + extra, s, (True,) + (False,) * len(extra)), R)
    X, S, Rn = np64(x), np64(s), np64(R)
    ref = np.zeros(X.shape)
    for n, t in np.ndindex(2, 3):
        tot = sum(Rn[n, t, j] for j in range(5))
        for i in range(5):
            zero = S[n, t, i] == 0 and Rn[n, t, i] == 0
            ref[n, t, i] = 0.0 if zero else X[n, t, i] * (Rn[n, t, i] - S[n, t, i] * tot)
    torch.testing.assert_close(out[0], torch.from_numpy(ref), **F64)
    torch.testing.assert_close(out[0] + out[1], R, **F64)
    assert torch.isfinite(out[0]).all() and out[0][0, 1, 3] == 0
    assert all(t is None for t in out[2:])


@pytest.mark.parametrize("affine", [True, False])
def test_layer_norm_rule_matches_reference(affine):
    """AttnLRP Prop. 3.4: σ constant, ε-rule on the linear rest:
    R_i = Σ_j x_i (γ_j/σ)(δ_ij − 1/N) R_j / y_j; β's share β_j R_j / y_j is absorbed."""
    x = rand((2, 3, 6), 33)
    gamma, beta = (rand((6,), 34), rand((6,), 35)) if affine else (None, None)
    y = aten.layer_norm.default(x, [6], gamma, beta, 1e-5)
    R = rand(y.shape, 36)
    out = rule_of(aten.layer_norm.default)(
        make_ctx(aten.layer_norm.default, (x, [6], gamma, beta, 1e-5), y, (True, False, False, False, False)), R)
    X, Y, Rn = np64(x), np64(y), np64(R)
    G = np64(gamma) if affine else np.ones(6)
    Bt = np64(beta) if affine else np.zeros(6)
    rx, rb = np.zeros(X.shape), np.zeros(X.shape)
    for n, t in np.ndindex(2, 3):
        row = X[n, t]
        sigma = math.sqrt(row.var() + 1e-5)
        for j in range(6):
            for i in range(6):
                rx[n, t, i] += sdiv(row[i] * G[j] / sigma * ((i == j) - 1 / 6) * Rn[n, t, j], Y[n, t, j])
            rb[n, t, j] = sdiv(Bt[j] * Rn[n, t, j], Y[n, t, j])
    torch.testing.assert_close(out[0], torch.from_numpy(rx), rtol=1e-8, atol=1e-10)
    if affine:
        torch.testing.assert_close(out[3], torch.from_numpy(rb), rtol=1e-8, atol=1e-10)
    else:
        assert out[3] is None
    assert out[1] is None and out[2] is None
    total = out[0].sum() + (out[3].sum() if affine else 0)
    torch.testing.assert_close(total, R.sum(), rtol=1e-6, atol=1e-8)


ONE_INPUT = [(aten.gelu.default, ()), (aten.silu.default, ()), (aten.tanh.default, ()), (aten.sigmoid.default, ()),
             (aten.pow.Tensor_Scalar, (3,)), (aten.mul.Scalar, (0.25,)), (aten.div.Scalar, (4.0,)),
             (aten.neg.default, ()), (aten.rms_norm.default, ([4], None, 1e-6))]


@pytest.mark.parametrize("op, extra", ONE_INPUT, ids=[str(o) for o, _ in ONE_INPUT])
@pytest.mark.parametrize("preset", PRESETS)
def test_identity_rule_ops_pass_relevance(op, extra, preset):
    """Identity rule (Eq. 9) on element-wise non-linearities; scaling and negation (linear, no bias:
    ε-rule = identity); RMSNorm (Prop. 3.4, the RMS constant): R_x = R_y, nothing else gets any."""
    x = rand((2, 3, 4), 37)
    y = op(x, *extra)
    R = rand(y.shape, 38)
    out = rule_of(op, preset)(make_ctx(op, (x,) + extra, y, (True,) + (False,) * len(extra), preset=preset), R)
    assert torch.equal(out[0], R) and all(t is None for t in out[1:])


def test_division_by_statistic():
    """x / d (d a norm of x): Prop. 3.4, d is a constant, R_x = R; the divisor is declared blocked."""
    x = rand((2, 3), 39)
    d = x.norm(dim=-1, keepdim=True)
    R = rand((2, 3), 40)
    fn = rule_of(aten.div.Tensor)
    out = fn(make_ctx(aten.div.Tensor, (x, d), x / d, (True, True)), R)
    assert torch.equal(out[0], R) and out[1] is None and 1 in fn.no_relevance_to


# ------------------------------------------------------------------------------------------------
# gradient forms
# ------------------------------------------------------------------------------------------------
def test_gradient_forms_of_normalizations_hold_the_statistic_constant():
    """The fast path's LayerNorm/RMSNorm backward equals autograd through the same layer written out
    with the standard deviation / RMS detached (AttnLRP Prop. 3.4)."""
    x = rand((2, 3, 6), 41).requires_grad_(True)
    gamma, beta, g = rand((6,), 42), rand((6,), 43), rand((2, 3, 6), 44)
    y = _LayerNormConstStd.apply(x, [6], gamma, beta, 1e-5)
    torch.testing.assert_close(y, torch.nn.functional.layer_norm(x, [6], gamma, beta, 1e-5), **F64)
    (got,) = torch.autograd.grad(y, x, g)
    mu = x.mean(-1, keepdim=True)
    ref_y = (x - mu) / (x.var(-1, unbiased=False, keepdim=True) + 1e-5).sqrt().detach() * gamma + beta
    (ref,) = torch.autograd.grad(ref_y, x, g)
    torch.testing.assert_close(got, ref, **F64)
    y = _RMSNormConstRMS.apply(x, [6], gamma, 1e-6)
    (got,) = torch.autograd.grad(y, x, g)
    ref_y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6).detach() * gamma
    (ref,) = torch.autograd.grad(ref_y, x, g)
    torch.testing.assert_close(got, ref, **F64)


# ------------------------------------------------------------------------------------------------
# end to end: tiny models
# ------------------------------------------------------------------------------------------------
def _inputs(name, model, batch=2):
    if name in models.VISION:
        return models.image_batch(model, batch=batch)
    return models.text_batch(pad_id=1 if "roberta" in name else 0)


@pytest.fixture(scope="module")
def decoders():
    """The tiny decoders of the zoo (LLaMA: RMSNorm written out, rotary embeddings, SiLU-gated MLP,
    grouped-query attention, no biases; GPT-2), each built once."""
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = models.DECODERS[name]()
        return cache[name]
    return get


def _model_and_inputs(zoo, decoders, name):
    """(model, inputs, target) for a zoo name; decoders explain the next token (LM) or class 1."""
    if name in models.DECODERS:
        return decoders(name), models.decoder_batch(), ("next_token" if "llama" in name else 1)
    model = zoo(name)
    return model, _inputs(name, model), 1


def _remove_biases(model):
    """A copy of ``model`` with every bias (linear, convolution, LayerNorm β) set to zero."""
    import copy
    return models.zero_biases(copy.deepcopy(model))


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("name", ["timm_vit_tiny", "hf_vit", "hf_bert_eager", "hf_llama", "hf_gpt2_cls"])
def test_fast_path_equals_interpreter(zoo, decoders, name, preset):
    """One modified-gradient backward gives the interpreter's input relevance (max abs difference
    below 5e-5 of the largest relevance, float32), and the fast path is the one used by default."""
    model, x, target = _model_and_inputs(zoo, decoders, name)
    fast = relprop.explain(model, x, target=target, method="lrp", preset=preset)
    ref = relprop.explain(model, x, target=target, method="lrp", preset=preset, fast_path=False)
    assert fast.conservation is None and ref.conservation is not None  # which path ran
    assert fast.preset == ref.preset == preset
    scale = float(ref.input_relevance.abs().max())
    assert scale > 0
    assert float((fast.input_relevance - ref.input_relevance).abs().max()) < 5e-5 * scale
    torch.testing.assert_close(fast.scores, ref.scores, rtol=0, atol=5e-5 * scale)
    assert float(ref.conservation.error.max()) < 1e-4, ref.conservation


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("name", ["timm_vit_tiny", "hf_vit", "hf_bert_eager", "hf_llama"])
def test_conservation_bias_free(zoo, decoders, name, preset):
    """Bias-free random models (every bias and LayerNorm β zero; LLaMA has none): per sample, input
    relevance + absorbed relevance (position embeddings, class token, masks, the softmax's bias
    term) = injected relevance, relative error < 1e-4, end to end and inside every block."""
    model, x, target = _model_and_inputs(zoo, decoders, name)
    e = relprop.explain(_remove_biases(model), x, target=target, method="lrp", preset=preset, fast_path=False)
    c = e.conservation
    torch.testing.assert_close(c.injected, e.target_scores)  # relevance starts at the logit's value
    assert float(c.error.max()) < 1e-4, c
    assert len(c.blocks) == 2
    for b in c.blocks:
        assert float(b.error.max()) < 1e-4, (b.name, b.relevance_in, b.relevance_out, b.absorbed)
    biases = [v for k, v in c.absorbed_by.items() if k.endswith("bias")]
    assert all(float(v.abs().max()) < 1e-6 for v in biases)  # zero biases absorb nothing


@pytest.mark.parametrize("eps", [1e-9, 1e-3, 1e-1])
def test_stabilizer_share_closes_the_ledger(zoo, eps):
    """An ε-rule passes Σ R |z| / (|z| + ε) to its operands; the rest is booked under
    ``STABILIZER``: the ledger closes for every ε (relative error < 1e-4), and the stabilizer's share
    is the gap the ledger would show without it (growing with ε)."""
    vit = zoo("timm_vit_tiny")
    x = models.image_batch(vit, batch=2, seed=3)
    c = relprop.explain(vit, x, target=[0, 1], method="lrp", preset="attnlrp", fast_path=False, eps=eps).conservation
    assert float(c.error.max()) < 1e-4, c
    kept = c.absorbed_by[STABILIZER]
    gap = c.injected - c.input - (c.absorbed - kept)
    torch.testing.assert_close(kept, gap, rtol=1e-3, atol=1e-5)  # float32 sums of relevance 1
    if eps >= 1e-3:
        assert float(kept.abs().min()) > 1e-6
    for b in c.blocks:
        assert float(b.error.max()) < 1e-4, (b.name, b.relevance_in, b.relevance_out, b.absorbed)


@pytest.mark.parametrize("preset", PRESETS)
def test_batch_invariance_fast_path(zoo, preset):
    """A batch explains like its samples one by one (max abs difference < 1e-5), images and padded
    texts, on the fast path."""
    vit = zoo("timm_vit_tiny")
    x = models.image_batch(vit, batch=3, seed=5)
    full = relprop.explain(vit, x, target=[0, 1, 2], method="lrp", preset=preset)
    for i in range(3):
        alone = relprop.explain(vit, x[i:i + 1], target=i, method="lrp", preset=preset)
        assert float((full.input_relevance[i] - alone.input_relevance[0]).abs().max()) < 1e-5
    bert = zoo("hf_bert_eager")
    lengths = (7, 4, 9)
    batch = models.text_batch(lengths, first_id=3)
    full = relprop.explain(bert, batch, target=[0, 1, 2], method="lrp", preset=preset)
    for i, n in enumerate(lengths):
        one = {k: v[i:i + 1, :n] for k, v in batch.items()}
        alone = relprop.explain(bert, one, target=[0, 1, 2][i], method="lrp", preset=preset)
        assert float((full.scores[i, :n] - alone.scores[0]).abs().max()) < 1e-5
        assert (full.scores[i, n:] == 0).all()


def test_method_lrp_honours_an_explicit_preset(zoo):
    """``method="lrp"`` keeps its own preset ("attnlrp"; "lrp" is the paper's baseline, by name) unless one is
    given; an explicit preset applies
    to every method of the call; the fast path is used only when every method reads just the
    input relevance, and falls back to the interpreter for presets without gradient forms."""
    model = zoo("timm_vit_tiny")
    x = models.image_batch(model)
    assert relprop.explain(model, x, target=1, method="lrp").preset == "attnlrp"
    assert relprop.explain(model, x, target=1, method="lrp", preset="lrp").preset == "lrp"
    assert relprop.explain(model, x, target=1).preset == "chefer2021"
    both = relprop.explain(model, x, target=1, method=["transformer_attribution", "lrp"], preset="attnlrp")
    assert [e.preset for e in both] == ["attnlrp", "attnlrp"]
    assert both[1].conservation is not None and both[0].blocks[0].relevance is not None
    fast = relprop.explain(model, x, target=1, method="lrp", preset="attnlrp")
    assert fast.conservation is None and fast.blocks == []
    torch.testing.assert_close(fast.map, both[1].map, rtol=0, atol=5e-5 * float(both[1].map.abs().max()))
    cap = CACHE.get(model, bind_inputs(model, x))
    assert supports(cap, "attnlrp", EPS) is None and supports(cap, "cp_lrp", EPS) is None
    assert "no gradient form" in supports(cap, "chefer2021", EPS)
    e = relprop.explain(model, x, target=1, method="lrp", preset="chefer2021")  # interpreter
    assert e.preset == "chefer2021" and e.conservation is not None
    with pytest.raises(MethodError, match="cp_lrp"):
        relprop.explain(model, x, target=1, method="transformer_attribution", preset="cp_lrp")


def test_cp_lrp_gives_attention_no_relevance(zoo):
    """CP-LRP holds the attention constant: no relevance reaches A (R_A is None in the records) and
    the input relevance differs from AttnLRP's."""
    model = zoo("hf_bert_eager")
    x = models.text_batch()
    cp = relprop.explain(model, x, target=1, method="lrp", preset="cp_lrp", fast_path=False)
    at = relprop.explain(model, x, target=1, method="lrp", preset="attnlrp", fast_path=False)
    assert all(b.relevance is None for b in cp.blocks) and all(b.relevance is not None for b in at.blocks)
    assert float((cp.scores - at.scores).abs().max()) > 1e-3 * float(at.scores.abs().max())


def test_fast_path_leaves_the_model_untouched(zoo):
    """The fast path reads the parameters detached: no .grad, same mode, flags, hooks and values."""
    model = zoo("hf_vit")
    before = snapshot(model)
    relprop.explain(model, models.image_batch(model), target=2, method="lrp", preset="attnlrp")
    assert_same(before, snapshot(model))


def _family(name):
    """(model, inputs, target) of the families beyond the ones above (every family)."""
    if name == "timm_deit_tiny_distilled":
        m = models.timm_deit_tiny_distilled()
        return m, models.image_batch(m), 1
    if name == "hf_deit":
        m = models.hf_deit()
        return m, models.image_batch(m), 1
    if name in ("hf_roberta", "hf_distilbert"):
        return getattr(models, name)(), models.text_batch(), 1
    if name in ("timm_swin", "hf_swin"):
        m = getattr(models, name)()
        return m, models.swin_images(m), 1
    if name == "hf_clip_image":
        return models.hf_clip(), models.clip_batch(), 0
    if name == "hf_gpt2_lm":
        return models.hf_gpt2_lm(), models.decoder_batch(), "next_token"
    if name == "timm_vit_reg4_gap":
        m = models.timm_vit_reg4_gap()
        return m, models.sized_images(m), 1
    raise KeyError(name)


FAMILIES = ["timm_deit_tiny_distilled", "hf_deit", "hf_roberta", "hf_distilbert", "timm_swin", "hf_swin",
            "hf_clip_image", "hf_gpt2_lm", "timm_vit_reg4_gap"]


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("name", FAMILIES)
def test_every_family_conserves_and_fast_path_agrees(name, preset):
    """Every other family of the engine under both presets, biases removed: the interpreter conserves
    (input + absorbed = injected, < 1e-4) and the fast path gives its input relevance (< 1e-4 of the
    largest), finite, with the model untouched."""
    model, x, target = _family(name)
    model = models.zero_biases(model)
    before = snapshot(model)
    ref = relprop.explain(model, x, target=target, method="lrp", preset=preset, fast_path=False)
    fast = relprop.explain(model, x, target=target, method="lrp", preset=preset)
    assert_same(before, snapshot(model))
    assert torch.isfinite(ref.scores).all() and torch.isfinite(fast.scores).all()
    assert float(ref.conservation.error.max()) < 1e-4, ref.conservation
    scale = float(ref.input_relevance.abs().max())
    assert scale > 0
    assert float((fast.input_relevance - ref.input_relevance).abs().max()) < 1e-4 * scale
