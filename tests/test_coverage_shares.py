"""Coverage as a figure: every node of the captured graph counted as exact, structural, fallback or
missing, from what the rules declare (RuleSpec.kind, else the rule_kind of the preset they are
registered in), the shares summing to 100 %, and ``benchmarks/zoo_report.py --coverage``'s core on two
tiny zoo architectures."""
import os
import sys

import pytest
import torch

import models
import relprop
from relprop.engine.coverage import CATEGORIES
from relprop.errors import PresetError
from relprop.graph.capture import CACHE
from relprop.graph.inputs import bind_inputs
from relprop.rules import get_preset
from relprop.rules.spec import RULE_KINDS, RuleSpec

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import zoo_coverage  # noqa: E402 - benchmarks/zoo_coverage.py

aten = torch.ops.aten


@pytest.fixture(scope="module")
def llama():
    """A tiny LLaMA and its batch, captured once for the module."""
    return models.hf_llama(), models.decoder_batch()


def _declared(preset, target) -> str:
    """The category a node with op ``target`` must have, read off the registry directly."""
    spec, owner = get_preset(preset).owner(target)
    return spec.kind or owner.rule_kind


@pytest.mark.parametrize("preset", ["chefer2021", "attnlrp"])
def test_shares_sum_to_100_and_follow_the_declarations(preset, llama):
    """Over the graph and over the relevance path the four shares sum to 100 %; the counts cover every
    node once; each node with a rule has the category its rule declares (else its preset's), the
    base preset's routing is structural, the paper presets' own rules exact, and nodes that need no
    rule (source, constant, no relevance) structural."""
    model, x = llama
    report = relprop.coverage(model, x, preset)
    for on_path in (False, True):
        shares = report.shares(on_path)
        assert list(shares) == list(CATEGORIES) and sum(shares.values()) == pytest.approx(100.0)
    assert sum(report.category_counts().values()) == len(report.ops)
    assert sum(report.category_counts(on_path=True).values()) == sum(o.on_path for o in report.ops)
    assert report.shares()["missing"] == 0 and report.shares()["fallback"] == 0
    nodes = {n.name: n for n in CACHE.get(model, bind_inputs(model, x)).graph.nodes}
    checked = 0
    for o in report.ops:
        assert o.category in CATEGORIES
        if o.status in ("source", "constant") or (o.status == "no relevance" and o.rule is None):
            assert o.category == "structural" and (o.status != "constant" or not o.on_path)
        elif o.status in ("rule", "shape-only") and o.rule and "element-wise function" not in o.rule \
                and o.rule != "element of a list output":
            assert o.category == _declared(preset, nodes[o.node].target), o
            assert (o.status == "shape-only") == (o.category == "structural") == o.rule.endswith("(base)"), o
            checked += 1
    assert checked > 50
    assert "exact" in report.shares_line() and report.shares_line() in report.summary()


def test_ops_inside_an_elementwise_function_count_as_exact(llama):
    """Under attnlrp an element-wise function written out op by op is explained by one rule at its
    output: the ops inside it receive no relevance of their own but count as exact, on the path."""
    report = relprop.coverage(*llama, "attnlrp")
    inside = [o for o in report.ops if o.rule and o.rule.startswith("inside the element-wise function")]
    assert inside and all(o.category == "exact" and o.on_path and o.status == "no relevance" for o in inside)


def test_missing_op_is_counted_and_named_and_z_rule_makes_it_a_fallback():
    """exp has no rule: it is 'missing' (1 node of the graph, named in the summary); with
    unsupported='z_rule' it is a 'fallback' given the generic z-rule, named as such, and nothing is missing."""
    model = models.UnruledOp().eval()
    x = torch.randn(2, 4)
    report = relprop.coverage(model, x)
    assert report.category_counts()["missing"] == 1
    (miss,) = [o for o in report.ops if o.category == "missing"]
    assert miss.op == "aten.exp.default" and miss.status == "missing" and miss.on_path
    assert report.category_counts(on_path=True) == {"exact": 2, "structural": 0, "fallback": 0, "missing": 1}
    assert report.shares(on_path=True)["missing"] == pytest.approx(100.0 / 3)  # linear, exp, linear
    assert "missing 33.3 %" in report.shares_line()
    fallback = relprop.coverage(model, x, unsupported="z_rule")
    (fb,) = fallback.fallbacks
    assert fb.op == "aten.exp.default" and fb.status == "fallback" and fb.category == "fallback"
    assert fb.rule == "generic.gradient_times_input (unsupported='z_rule')"
    assert fallback.complete and fallback.category_counts()["missing"] == 0
    assert "FALLBACK: 1 op(s)" in fallback.summary() and "aten.exp.default x1" in fallback.summary()
    with pytest.raises(relprop.RelpropError, match="unsupported"):
        relprop.coverage(model, x, unsupported="ignore")


def test_declared_kind_decides_the_category():
    """A user's rule declares its kind: kind='structural' in a user preset is structural (shape-only),
    kind='fallback' a fallback, none declared the preset's rule_kind (exact); an unknown kind is refused."""
    model = models.UnruledOp().eval()
    x = torch.randn(2, 4)
    for kind, status in (("structural", "shape-only"), ("fallback", "fallback"), (None, "rule")):
        mine = relprop.Preset(f"coverage_kind_{kind}", extends="chefer2021")

        @mine.rule(aten.exp.default, kind=kind)
        def exp_identity(ctx, relevance):
            return (relevance,)

        (op,) = [o for o in relprop.coverage(model, x, mine).ops if o.op == "aten.exp.default"]
        assert (op.category, op.status) == (kind or "exact", status)
    assert RULE_KINDS == ("exact", "structural", "fallback")
    with pytest.raises(PresetError, match="not a rule kind"):
        RuleSpec(lambda ctx, r: (r,), kind="approximate")
    with pytest.raises(PresetError, match="rule_kind"):
        relprop.Preset("coverage_kind_bad", extends="chefer2021", rule_kind="approximate")


def test_builtin_rules_declare_their_kind_by_preset():
    """Every rule of 'base' counts as structural, every rule of the paper presets and AttnLRP as
    exact; no built-in rule is a fallback."""
    for name in ("base", "chefer2021", "lrp", "attnlrp", "cp_lrp"):
        p = get_preset(name)
        for op, spec in p.rules.items():
            kind = spec.kind or p.rule_kind
            assert kind == ("structural" if name == "base" else "exact"), (name, op, spec.name)


def test_zoo_coverage_core_on_two_architectures(tmp_path):
    """The benchmark's core on two tiny zoo models: a row per (model, preset) whose shares sum to 100,
    the total the sum of the rows, the markdown table with the total, and the figure written."""
    rows = zoo_coverage.coverage_rows(["bert", "timm_vit_gap"], ["chefer2021", "attnlrp"])
    assert [(r.model, r.preset) for r in rows] == [("bert", "chefer2021"), ("bert", "attnlrp"),
                                                   ("timm_vit_gap", "chefer2021"), ("timm_vit_gap", "attnlrp")]
    for r in rows:
        assert r.error is None and r.nodes > 50
        assert sum(r.share(c) for c in CATEGORIES) == pytest.approx(100.0)
        assert sum(r.share(c, on_path=True) for c in CATEGORIES) == pytest.approx(100.0)
    t = zoo_coverage.total(rows, "chefer2021")
    assert t.nodes == rows[0].nodes + rows[2].nodes
    assert t.share("exact", True) + t.share("structural", True) == pytest.approx(100.0)
    table = zoo_coverage.markdown(rows, "chefer2021")
    assert "**TOTAL**" in table and "| bert |" in table and "timm_vit_gap" in table
    path = tmp_path / "coverage.png"
    zoo_coverage.draw(rows, ["chefer2021", "attnlrp"], str(path))
    assert path.stat().st_size > 10_000
