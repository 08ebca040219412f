"""Mixture-of-experts layers (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE; ``relprop.rules.moe``).

* the rules against slow references written from their formulas: the router's ``topk``/``sort``
  route each selected value's relevance back to where it was taken from; the experts' grouped
  product applies the preset's linear rule on each expert's rows (loops over every contribution
  x_i w_ij, ``tests/test_rules_reference.ref_linear``); the top-k renormalization w = p / Σ p gets
  the ε-rule of the whole function, R_p,j = Σ_i p_j ∂w_i/∂p_j R_i / w_i, computed term by term;
* end to end on tiny random models: AttnLRP and CP-LRP conserve relevance (input + absorbed =
  injected, relative error < 1e-4, what the renormalization does not pass on booked under its own
  label), the fast path equals the rule-by-rule walk, CP-LRP gives the gate weights nothing, and
  every default method runs (Transformer Attribution's LRP-α1β0 on the experts included).
The comparison with the AttnLRP authors' treatment of the gates (LXT's functions) is in
``tests/test_lxt_agreement.py``.
"""
import pytest
import torch

import llm_models
import relprop
from relprop.rules import moe
from relprop.rules.moe import RENORMALIZATION

from rule_helpers import make_ctx, rand, rule_of, sdiv
from test_rules_reference import ref_linear

aten = torch.ops.aten
MOE = tuple(llm_models.MOE)


# ------------------------------------------------------------------------------------------------
# rules against references
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("op", [aten.topk.default, aten.sort.default])
def test_selection_routes_relevance_back(op):
    x = rand((5, 6), 0, torch.float32)
    args = (x, 3, -1) if op is aten.topk.default else (x, -1)
    out = op(*args)
    r = rand(tuple(out[0].shape), 1, torch.float32)
    shares = rule_of(op, "base")(make_ctx(op, args, out, (True, False, False)[:len(args)], preset="base"),
                                 [r, torch.zeros(out[1].shape)])
    ref = torch.zeros_like(x)
    for i in range(x.shape[0]):
        for j in range(out[1].shape[1]):
            ref[i, int(out[1][i, j])] += r[i, j]
    torch.testing.assert_close(shares[0], ref)
    assert all(s is None for s in shares[1:])


@pytest.mark.parametrize("preset, rule", [("attnlrp", "z"), ("chefer2021", "ab"), ("lrp", "lrp")])
def test_grouped_linear_is_the_linear_rule_per_expert(preset, rule):
    """Experts 0..3 own rows [0, 2), [2, 2) (none), [2, 5), [5, 7); rows past the last offset get none."""
    x, w = rand((8, 4), 2, torch.float32), rand((4, 4, 3), 3, torch.float32)
    offs = torch.tensor([2, 2, 5, 7], dtype=torch.int32)
    z = torch.cat([x[0:2] @ w[0], x[2:5] @ w[2], x[5:7] @ w[3], torch.zeros(1, 3)])
    r = rand((8, 3), 4, torch.float32)
    op = aten._grouped_mm.default
    shares = rule_of(op, preset)(make_ctx(op, (x, w, offs), z, (True, False, False), preset=preset), r)
    ref = torch.zeros(8, 4, dtype=torch.float64)
    for g, (a, b) in enumerate([(0, 2), (2, 2), (2, 5), (5, 7)]):
        if b > a:
            ref[a:b] = ref_linear(x[a:b].double(), w[g].double(), r[a:b].double(), 1e-9, rule)
    torch.testing.assert_close(shares[0].double(), ref, rtol=1e-4, atol=1e-5)
    assert float(shares[0][7].abs().max()) == 0


def test_renormalization_is_the_epsilon_rule_of_the_whole_function():
    p = torch.rand(5, 2, generator=torch.Generator().manual_seed(5), dtype=torch.float64) + 0.1
    w = p / p.sum(-1, keepdim=True)
    r = rand((5, 2), 6)
    shares, kept = moe.renormalization_shares(w, r, [-1])
    ref = torch.zeros_like(p)
    for t in range(5):
        s = float(p[t].sum())
        for j in range(2):  # R_p,j = Σ_i p_j ∂w_i/∂p_j R_i / w_i, ∂w_i/∂p_j = δ_ij / s − p_i / s²
            ref[t, j] = sum(float(p[t, j]) * ((i == j) / s - float(p[t, i]) / s ** 2) * sdiv(float(r[t, i]),
                                                                                            float(w[t, i]), 0)
                            for i in range(2))
    torch.testing.assert_close(shares, ref)
    torch.testing.assert_close(shares.sum(-1), torch.zeros(5, dtype=torch.float64))  # degree-0 homogeneous
    torch.testing.assert_close(kept.sum(-1), r.sum(-1))


# ------------------------------------------------------------------------------------------------
# end to end
# ------------------------------------------------------------------------------------------------
_BUILT = {}


def _model(name):
    if name not in _BUILT:
        _BUILT[name] = llm_models.build(name)
    return _BUILT[name]


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["attnlrp", "cp_lrp"])
@pytest.mark.parametrize("name", MOE)
def test_moe_conserves_and_fast_path_equals_walk(name, preset):
    model, x = _model(name), llm_models.batch()
    walk = relprop.explain(model, x, target="next_token", method="lrp", preset=preset, fast_path=False)
    fast = relprop.explain(model, x, target="next_token", method="lrp", preset=preset)
    c = walk.conservation
    torch.testing.assert_close(c.injected, walk.target_scores)
    assert float(c.error.max()) < 1e-4, c
    for b in c.blocks:
        assert float(b.error.max()) < 1e-4, (b.name, b.relevance_in, b.relevance_out, b.absorbed)
    scale = float(walk.scores.abs().max())
    assert float((fast.scores - walk.scores).abs().max()) < 1e-5 * scale
    renormalizes = name == "mixtral"  # the only one of the four whose config renormalizes the top-k weights
    assert (RENORMALIZATION in c.absorbed_by) == (renormalizes and preset == "attnlrp")
    if RENORMALIZATION in c.absorbed_by:  # what reaches it: half of the experts' relevance, not passed on
        assert float(c.absorbed_by[RENORMALIZATION].abs().min()) > 0


@pytest.mark.slow
@pytest.mark.parametrize("name", MOE)
def test_default_methods_run_on_moe(name):
    model, x = _model(name), llm_models.batch()
    for method in ("transformer_attribution", "lrp", "gradient_rollout"):
        e = relprop.explain(model, x, target="next_token", method=method)
        assert torch.isfinite(e.scores).all() and float(e.scores.abs().sum()) > 0, method
    e = relprop.explain(model, x, target="next_token", method="transformer_attribution")
    assert float(e.conservation.error.max()) < 1e-4, e.conservation  # chefer2021 conserves through the experts
