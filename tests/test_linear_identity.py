"""LRP-α1β0 (CVPR 2021, Eq. 5) computed with x⁺W⁺ + x⁻W⁻ = ½(xW + |x||W|) agrees in float32 with
Eq. 5 written out term by term (loops, float64), also where z is small against |x||W|
(cancellation, recomputed from the split terms), and through the registered ``aten.linear`` rule
that reads xW from the layer's own forward output."""
import models
import pytest
import torch
import torch.fx

import relprop
from relprop.rules import linear as lin
from relprop.rules import override
from relprop.rules.stabilize import safe_divide
from relprop.rules.context import RuleContext
from relprop.rules.rule_registry import lookup

aten = torch.ops.aten
EPS = 1e-9


def ref_eq5(x, w, R, eps=EPS):
    """Eq. 5 with loops in float64: z_j = Σ_i x⁺_i W⁺_ij + x⁻_i W⁻_ij; R_i = Σ_j (those terms)/z_j · R_j."""
    x, w, R = x.double().reshape(-1, x.shape[-1]), w.double(), R.double().reshape(-1, w.shape[-1])
    out = torch.zeros_like(x)
    for n in range(x.shape[0]):
        for j in range(w.shape[1]):
            terms = [max(x[n, i], 0) * max(w[i, j], 0) + min(x[n, i], 0) * min(w[i, j], 0)
                     for i in range(x.shape[1])]
            z = float(sum(terms))
            if z == 0:
                continue
            for i in range(x.shape[1]):
                out[n, i] += terms[i] / (z + eps) * R[n, j]
    return out


def cancelling(seed, n=6, n_in=24, n_out=10):
    """x mostly positive, and half of W's columns negative but for one tiny positive entry: z_j for
    those columns is about 1e-6 of |x||W|_j, where ½(xW + |x||W|) loses every float32 digit."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, n_in, generator=g) + 0.1
    x[:, 0] = -torch.rand(n, generator=g)  # one negative input
    w = torch.randn(n_in, n_out, generator=g)
    w[:, ::2] = -w[:, ::2].abs()
    w[1, ::2] = 1e-6
    w[0, ::2] = 0.0
    R = torch.randn(n, n_out, generator=g)
    return x, w, R


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("kind", ["random", "cancelling"])
def test_identity_float32_matches_eq5(seed, kind):
    if kind == "random":
        g = torch.Generator().manual_seed(seed)
        x, w, R = torch.randn(5, 16, generator=g), torch.randn(16, 7, generator=g), torch.randn(5, 7, generator=g)
    else:
        x, w, R = cancelling(seed)
    ref = ref_eq5(x, w, R)
    scale = float(ref.abs().max())
    for xw in (None, x @ w):
        got = lin.alpha1_beta0(x, w, R, EPS, xw=xw)
        assert got.dtype == torch.float32
        err = float((got.double() - ref).abs().max())
        assert err <= 1e-5 * scale, f"{kind}: max error {err:.3g} of scale {scale:.3g}"


def test_cancelling_columns_take_the_split_path():
    """Where z ≪ |x||W| the identity alone is off by far more than rounding; the split recomputation
    of those outputs is what brings it back (so the test above would fail without it)."""
    x, w, R = cancelling(0)
    z = (x @ w + x.abs() @ w.abs()) / 2
    assert bool((z < (x.abs() @ w.abs()) * lin.SMALL_Z).any())
    ref = ref_eq5(x, w, R)
    s = torch.nan_to_num(R / z, nan=0.0, posinf=0.0, neginf=0.0)
    naive = x.clamp(min=0) * (s @ w.clamp(min=0).t()) + x.clamp(max=0) * (s @ w.clamp(max=0).t())
    assert float((naive.double() - ref).abs().max()) > 1e-3 * float(ref.abs().max())


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("kind", ["random", "cancelling"])
def test_registered_linear_rule_reads_forward_output(bias, kind):
    """The chefer2021 rule for aten.linear (x Wᵀ + b, xW read from the node's output less b) vs Eq. 5."""
    if kind == "random":
        g = torch.Generator().manual_seed(3)
        x, w, R = torch.randn(2, 5, 16, generator=g), torch.randn(16, 7, generator=g), torch.randn(2, 5, 7, generator=g)
    else:
        x, w, R = cancelling(4)
        x, R = x.unsqueeze(0), R.unsqueeze(0)
    weight = w.t().contiguous()
    b = torch.randn(weight.shape[0]) * 3 if bias else None
    out = torch.nn.functional.linear(x, weight, b)
    args = (x, weight, b) if bias else (x, weight)
    node = torch.fx.Graph().call_function(aten.linear.default, ())
    for cache in (None, {}):
        ctx = RuleContext(node=node, args=args, kwargs={}, out=out, live=(True, False, False)[:len(args)], batch_dim=0,
                          batch_size=x.shape[0], eps=EPS, preset="chefer2021", options={"weight_cache": cache})
        rx = lookup("chefer2021", aten.linear.default)(ctx, R)[0]
        ref = ref_eq5(x, w, R).reshape(x.shape)
        assert float((rx.double() - ref).abs().max()) <= 1e-5 * float(ref.abs().max())
    assert sum(k[0] == "abs" for k in cache) == 1  # |W| memoized per weight


def test_half_precision_output_is_not_reused():
    """A float16 layer's output has float16 rounding: the rule recomputes xW in float32 instead."""
    x, w, R = cancelling(5)
    weight = w.t().contiguous().half()
    node = torch.fx.Graph().call_function(aten.linear.default, ())
    out = torch.nn.functional.linear(x.half(), weight).float()
    ctx = RuleContext(node=node, args=(x, weight), kwargs={}, out=out, live=(True, False), batch_dim=0,
                      batch_size=x.shape[0], eps=EPS, preset="chefer2021")
    assert lin._forward_product(ctx, x) is None


# ------------------------------------------------------------------------------------------------
# explain(): Transformer Attribution with the identity equals the split formula to float32 rounding
# ------------------------------------------------------------------------------------------------
def split_alpha1_beta0(ctx, relevance):
    """The α1β0 rule as it was computed before the identity (Eq. 5 on [x⁺, x⁻] and [W⁺, W⁻])."""
    x, w = ctx.args[0], ctx.args[1].t()
    xp, xn, wp, wn = x.clamp(min=0), x.clamp(max=0), w.clamp(min=0), w.clamp(max=0)
    s = safe_divide(relevance, xp @ wp + xn @ wn, ctx.eps)
    return (xp * (s @ wp.t()) + xn * (s @ wn.t()),) + (None,) * (len(ctx.args) - 1)


@pytest.mark.parametrize("which", ["vit", pytest.param("bert", marks=pytest.mark.slow)])
def test_transformer_attribution_unchanged_to_float32_rounding(which):
    """explain() with the identity vs with the rule as it was (split formula, set by override()): the
    same Transformer Attribution scores to float32 rounding on the tiny test models."""
    if which == "vit":
        model = models.timm_vit_tiny()
        x = models.image_batch(model)
        kw = {}
    else:
        model = models.hf_bert()
        x, kw = models.text_batch(), {}
    for method in ("transformer_attribution", "ta_last_block"):
        new = relprop.explain(model, x, target=1, method=method, **kw)
        with override({aten.linear.default: split_alpha1_beta0}, preset="chefer2021"):
            old = relprop.explain(model, x, target=1, method=method, **kw)
        torch.testing.assert_close(new.scores, old.scores, rtol=1e-4, atol=1e-5 * float(old.scores.abs().max()))
