"""Element-wise functions written out op by op get the rule of the whole function under
``"attnlrp"`` (AttnLRP Eq. 9, the identity rule, as LXT applies it to activation modules):
``relprop.graph.elementwise.find_regions`` finds them structurally (GPT-2's tanh-GELU, quick_gelu,
a SiLU written ``x·sigmoid(x)``, softcapping ``c·tanh(x/c)``, Mamba's softplus) and leaves alone
what is not one (RMSNorm, rotary embeddings, masks, residual sums, linear chains).

The reference is AttnLRP computed by hand on a two-layer network ``y = W₂ f(W₁ x)``: the ε-rule on
each linear layer, R passed unchanged through f; the relprop walk and its fast path must equal it,
and conserve relevance (bias-free: the input receives the target logit's value).
"""
import math

import pytest
import torch
import torch.fx
from hypothesis import given, settings
from hypothesis import strategies as st

import llm_models
import relprop
from relprop.api import prepare
from relprop.engine.node_rules import regions
from relprop.graph.elementwise import find_regions

from rule_helpers import sdiv

aten = torch.ops.aten
SQRT_2_PI = math.sqrt(2 / math.pi)

FUNCTIONS = {
    "gelu_new": lambda x: 0.5 * x * (1.0 + torch.tanh(SQRT_2_PI * (x + 0.044715 * torch.pow(x, 3.0)))),
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "silu_written_out": lambda x: x * torch.sigmoid(x),
    "softcapping": lambda x: 3.0 * torch.tanh(x / 3.0),
    "softplus_written_out": lambda x: torch.where(x > 20, x, torch.log1p(torch.exp(x))),
    "gelu_erf_cast": lambda x: (0.5 * x.float() * (1 + torch.erf(x.float() / math.sqrt(2)))).to(x.dtype),
}


class TwoLayers(torch.nn.Module):
    """y = W₂ f(W₁ x), no biases: every relevance reaches the input."""

    def __init__(self, fn, d=6, h=10, k=3, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w1 = torch.nn.Parameter(torch.randn(h, d, generator=g))
        self.w2 = torch.nn.Parameter(torch.randn(k, h, generator=g) / 3)
        self.fn = fn

    def forward(self, x):
        return torch.nn.functional.linear(self.fn(torch.nn.functional.linear(x, self.w1)), self.w2)


def reference(model, x, target):
    """AttnLRP by hand, in Python floats: ε-rule at W₂ (seed: the target logit's value), identity
    through f, ε-rule at W₁; returns R_x [batch, d]."""
    w1, w2 = model.w1.double().tolist(), model.w2.double().tolist()
    out = []
    for xs in x.double().tolist():
        a = [sum(w * xi for w, xi in zip(row, xs)) for row in w1]
        h = model.fn(torch.tensor(a, dtype=torch.float64)).tolist()
        y = sum(w * hi for w, hi in zip(w2[target], h))
        r_h = [h[i] * w2[target][i] * sdiv(y, y) for i in range(len(h))]  # R_y = y (the "score" seed)
        r_a = r_h  # identity rule of the whole function
        out.append([sum(xs[j] * w1[i][j] * sdiv(r_a[i], a[i]) for i in range(len(a))) for j in range(len(xs))])
    return torch.tensor(out, dtype=torch.float64)


def _slow_but(fast):
    return [pytest.param(n, id=n, marks=() if n == fast else (pytest.mark.slow,)) for n in sorted(FUNCTIONS)]


@pytest.mark.parametrize("name", _slow_but("gelu_new"))
@pytest.mark.parametrize("fast_path", [True, False], ids=["fast_path", "interpreter"])
def test_written_out_function_gets_the_identity_rule(name, fast_path):
    model = TwoLayers(FUNCTIONS[name]).eval()
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    e = relprop.explain(model, x, target=1, method="lrp", preset="attnlrp", fast_path=fast_path)
    ref = reference(model, x, 1)
    torch.testing.assert_close(e.input_relevance.double(), ref, rtol=1e-4, atol=1e-5 * float(ref.abs().max()))
    if not fast_path:  # bias-free: what reaches the input is the logit's value
        c = e.conservation
        torch.testing.assert_close(c.injected, model(x)[:, 1].detach())
        torch.testing.assert_close(c.input, c.injected, rtol=1e-4, atol=1e-6)


def _regions_of(model, x):
    captured = prepare(model, x, None).captured
    return captured, regions(captured)


@pytest.mark.parametrize("name", _slow_but("softplus_written_out"))
def test_each_function_is_one_region(name):
    captured, found = _regions_of(TwoLayers(FUNCTIONS[name]).eval(), torch.randn(2, 6))
    assert len(found) == 1, found
    (region,) = found.values()
    assert region.input.target is aten.linear.default
    assert [u.target for u in region.output.users if u.target is not aten._assert_tensor_metadata.default] \
        == [aten.linear.default]


class NotFunctions(torch.nn.Module):
    """Element-wise code that is not a function of one tensor: RMSNorm, a rotary embedding, a
    gate of one tensor by another (SwiGLU), a chain of linear maps."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 8) / 3)
        self.register_buffer("cos", torch.rand(8))
        self.register_buffer("sin", torch.rand(8))

    def forward(self, x):
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)         # RMSNorm written out
        h = torch.nn.functional.linear(h, self.w)
        rot = torch.cat([-h[..., 4:], h[..., :4]], -1)
        h = h * self.cos + rot * self.sin                                     # rotary embedding
        h = torch.nn.functional.linear(h, self.w)
        g = torch.nn.functional.linear(h, self.w)
        h = torch.nn.functional.silu(g) * h                                   # a gate: two tensors
        h = torch.nn.functional.linear(h, self.w)
        return (2.0 * h + 1.0) * 0.5                                          # linear chain


def test_what_is_not_a_function_of_one_tensor_is_left_alone():
    captured, found = _regions_of(NotFunctions().eval(), torch.randn(2, 8))
    for region in found.values():  # only the RMSNorm's statistic path (rsqrt(mean + ε)) qualifies
        assert region.input.target is aten.mean.dim, region
    e = relprop.explain(NotFunctions().eval(), torch.randn(2, 8), target=0, method="lrp", preset="attnlrp",
                        fast_path=False)
    assert float(e.conservation.error.max()) < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("name, count", [("gpt2", 2), ("mamba", 2)])
def test_language_models_have_their_activations_found(name, count):
    """GPT-2's two tanh-GELUs (one per block) and Mamba's two softplus (one per mixer)."""
    model = llm_models.build(name)
    captured, found = _regions_of(model, llm_models.batch())
    kinds = {n.target for r in found.values() for n in r.nodes}
    assert len(found) >= count
    assert aten.tanh.default in kinds if name == "gpt2" else aten.log1p.default in kinds


def test_presets_without_a_function_rule_explain_op_by_op():
    """``"chefer2021"`` and ``"lrp"`` have no rule for whole functions: their numbers on a
    written-out GELU are those of the ops one by one (what they always were)."""
    model = TwoLayers(FUNCTIONS["gelu_new"]).eval()
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(2))
    captured = prepare(model, x, None).captured
    from relprop.engine.node_rules import rule_finder
    for preset in ("chefer2021", "lrp"):
        rule_of = rule_finder(captured, preset)
        specs = [rule_of(n) for n in captured.graph.nodes if n.op == "call_function"]
        assert not any(s is not None and s.operands is not None for s in specs)  # no rule applied to a whole function
        assert any(s is not None for s in specs)
    assert find_regions(captured.graph, captured.analysis.live)  # the function is there all the same


# ------------------------------------------------------------------------------------------------
# property: any element-wise function of one tensor, written out, conserves under "attnlrp"
# ------------------------------------------------------------------------------------------------
#: element-wise steps (x -> y) a written-out activation is made of
STEPS = {
    "tanh": torch.tanh, "sigmoid": torch.sigmoid, "erf": torch.erf, "scale": lambda t: 1.7 * t,
    "shift": lambda t: t + 0.3, "cube": lambda t: torch.pow(t, 3.0), "gate": lambda t: t * torch.sigmoid(t),
    "cap": lambda t: 2.0 * torch.tanh(t / 2.0),
}


def _chain(names):
    def fn(x):
        y = x
        for n in names:
            y = STEPS[n](y)
        return x * y  # the input read twice: never one op
    return fn


@pytest.mark.slow
@settings(max_examples=12, deadline=None)
@given(st.lists(st.sampled_from(sorted(STEPS)), min_size=1, max_size=4), st.integers(0, 2 ** 16))
def test_any_written_out_function_conserves(names, seed):
    """Bias-free ``W₂ f(W₁ x)`` with f a random chain of element-wise steps applied as ``x·g(x)``: one
    region; the walk and the fast path give the input the target logit's value (identity rule)."""
    model = TwoLayers(_chain(names), seed=seed).eval()
    x = torch.randn(2, 6, generator=torch.Generator().manual_seed(seed))
    captured, found = _regions_of(model, x)
    assert len(found) == 1
    walk = relprop.explain(model, x, target=0, method="lrp", preset="attnlrp", fast_path=False)
    fast = relprop.explain(model, x, target=0, method="lrp", preset="attnlrp")
    logit = model(x)[:, 0].detach()
    torch.testing.assert_close(walk.conservation.input, logit, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(fast.input_relevance.sum(-1), logit, rtol=1e-4, atol=1e-6)
