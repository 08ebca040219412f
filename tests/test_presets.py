"""Presets as first-class objects: inheritance that rules cannot break, registration without traps,
scoped overrides, and explain() saying why the fast path was not taken."""
import itertools
import os
import re
import threading

import pytest
import torch

import models
import relprop
from relprop.rules import RuleContext, get_preset, override

aten = torch.ops.aten
_names = (f"test_preset_{i}" for i in itertools.count())


def _vit():
    model = models.timm_vit_tiny()
    return model, models.image_batch(model)


def _gelu_times(k):
    """A (deliberately odd) GELU rule: k x the relevance, so its use is visible in the numbers."""
    def rule(ctx, relevance):
        return (relevance * k,) + (None,) * (len(ctx.args) - 1)
    return rule


# --------------------------------------------------------------------------- inheritance (bug 1)

@pytest.mark.parametrize("parent, methods", [
    ("lrp", ["lrp", "partial_lrp"]),
    ("chefer2021", ["transformer_attribution", "lrp"]),
    ("attnlrp", ["lrp"]),
])
@pytest.mark.parametrize("family", ["vit", "bert"])
def test_a_preset_that_adds_nothing_explains_like_its_parent(parent, methods, family):
    """A preset extending ``parent`` with no rule of its own gives the parent's numbers exactly: no rule
    chooses its formula by the preset's name (linear layers, convolutions and products with a
    constant matrix all take the rule the preset's table names)."""
    if family == "vit":
        model, x = _vit()
    else:
        model, x = models.hf_bert(), models.text_batch()
    child = relprop.Preset(next(_names), extends=parent)
    for m in methods:
        a = relprop.explain(model, x, target=0, method=m, preset=child, fast_path=False)
        b = relprop.explain(model, x, target=0, method=m, preset=parent, fast_path=False)
        assert torch.equal(a.scores, b.scores), (parent, m)
        assert torch.equal(a.conservation.input, b.conservation.input)
        assert a.preset == child.name
    if parent == "lrp":  # and the parent's numbers are not chefer2021's (the bug gave chefer2021's)
        c = relprop.explain(model, x, target=0, method="lrp", preset="chefer2021")
        assert not torch.allclose(a.conservation.input, c.conservation.input)


def test_no_rule_reads_the_presets_name():
    """The rule modules never branch on ``ctx.preset`` (they may name it in an error message)."""
    folder = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "relprop", "rules")
    pattern = re.compile(r"ctx\.preset\s*(==|!=|in\b|\))|\.get\(ctx\.preset|\[ctx\.preset\]")
    for name in os.listdir(folder):
        if name.endswith(".py"):
            with open(os.path.join(folder, name), encoding="utf-8") as f:
                for i, line in enumerate(f, 1):
                    if pattern.search(line) and "UnsupportedOperation" not in line:
                        pytest.fail(f"relprop/rules/{name}:{i} reads the preset's name: {line.strip()}")


def test_a_child_presets_own_rule_wins_and_the_parent_is_untouched():
    model, x = _vit()
    child = relprop.Preset(next(_names), extends="chefer2021", description="chefer2021, GELU doubled")
    child.rule(aten.gelu.default)(_gelu_times(2.0))
    assert relprop.presets()[child.name] == "chefer2021, GELU doubled"
    assert child.lookup(aten.gelu.default) is not get_preset("chefer2021").lookup(aten.gelu.default)
    assert child.lookup(aten.linear.default) is get_preset("chefer2021").lookup(aten.linear.default)
    assert "(test_preset" in child.describe(aten.gelu.default)
    a = relprop.explain(model, x, target=0, preset=child)
    b = relprop.explain(model, x, target=0)
    assert not torch.allclose(a.scores, b.scores)
    assert torch.equal(b.scores, relprop.explain(model, x, target=0, preset="chefer2021").scores)


# ------------------------------------------------------------------ registration traps (bug 2)

def test_rule_on_an_unknown_preset_is_an_error_that_says_how_to_make_one():
    with pytest.raises(relprop.PresetError, match=r"not a preset.*relprop\.Preset\("):
        relprop.rule(aten.exp.default, preset="no_such_preset")(lambda ctx, r: (r,))
    assert "no_such_preset" not in relprop.presets()


def test_a_preset_name_cannot_be_taken_twice_nor_extend_the_unknown():
    with pytest.raises(relprop.PresetError, match="exists already"):
        relprop.Preset("chefer2021", extends="base")
    with pytest.raises(relprop.PresetError, match="unknown preset 'nope'.*Choices"):
        relprop.Preset(next(_names), extends="nope")
    with pytest.raises(relprop.PresetError, match="must extend"):
        relprop.Preset(next(_names), extends=())


def test_registering_over_a_rule_needs_replace_and_a_builtin_replaced_warns_and_can_be_restored():
    model, x = _vit()
    before = relprop.explain(model, x, target=0)
    builtin = get_preset("chefer2021").lookup(aten.gelu.default)
    with pytest.raises(relprop.PresetError, match="already has a rule.*replace=True.*override"):
        relprop.rule(aten.gelu.default, preset="chefer2021")(_gelu_times(2.0))
    assert get_preset("chefer2021").lookup(aten.gelu.default) is builtin
    try:
        with pytest.warns(relprop.RelpropWarning, match=r"replaces relprop's built-in rule.*reset"):
            relprop.rule(aten.gelu.default, preset="chefer2021", replace=True)(_gelu_times(2.0))
        assert not torch.allclose(relprop.explain(model, x, target=0).scores, before.scores)
    finally:
        get_preset("chefer2021").reset(aten.gelu.default)
    assert get_preset("chefer2021").lookup(aten.gelu.default) is builtin
    assert torch.equal(relprop.explain(model, x, target=0).scores, before.scores)


def test_reset_removes_a_users_rule_from_a_builtin_preset():
    @relprop.rule(aten.exp.default, preset="chefer2021")
    def exp_identity(ctx, relevance):
        return (relevance,)
    assert get_preset("chefer2021").lookup(aten.exp.default).fn is exp_identity
    get_preset("chefer2021").reset(aten.exp.default)
    assert get_preset("chefer2021").lookup(aten.exp.default) is None


def test_override_is_scoped_to_the_with_block_and_to_the_thread():
    model, x = _vit()
    before = relprop.explain(model, x, target=0)
    child = relprop.Preset(next(_names), extends="chefer2021")
    seen_elsewhere = {}
    with override({aten.gelu: _gelu_times(3.0)}, preset="chefer2021") as p:
        assert p is get_preset("chefer2021")
        inside = relprop.explain(model, x, target=0)
        inside_child = relprop.explain(model, x, target=0, preset=child)  # children see it too

        def other_thread():
            seen_elsewhere["scores"] = relprop.explain(model, x, target=0).scores
        t = threading.Thread(target=other_thread)
        t.start()
        t.join()
    after = relprop.explain(model, x, target=0)
    assert not torch.allclose(inside.scores, before.scores)
    assert torch.equal(inside.scores, inside_child.scores)
    assert torch.equal(after.scores, before.scores)
    assert torch.equal(seen_elsewhere["scores"], before.scores)


def test_override_checks_its_argument():
    with pytest.raises(relprop.PresetError, match="non-empty dict"):
        with override({}, preset="chefer2021"):
            pass
    with pytest.raises(relprop.PresetError, match="not a function"):
        with override({aten.gelu.default: 3}, preset="chefer2021"):
            pass
    with pytest.raises(relprop.PresetError, match="not a preset"):
        with override({aten.gelu.default: _gelu_times(1.0)}, preset="nope"):
            pass


# ------------------------------------------------------------------------- the fast path (bug 2)

def test_a_rule_without_gradient_form_in_a_fast_preset_warns_and_explain_says_why():
    model, x = _vit()
    mine = relprop.Preset(next(_names), extends="attnlrp")
    with pytest.warns(relprop.RelpropWarning, match="no modified-gradient form"):
        mine.rule(aten.gelu.default)(lambda ctx, r: (r,) + (None,) * (len(ctx.args) - 1))
    quiet = relprop.explain(model, x, target=0, method="lrp", preset=mine)  # auto: a note, no warning
    assert quiet.conservation is not None  # the interpreter ran
    assert any("fast path was not taken" in n and "no gradient form" in n for n in quiet.notes)
    with pytest.warns(relprop.RelpropWarning, match="fast path was not taken.*gelu"):
        relprop.explain(model, x, target=0, method="lrp", preset=mine, fast_path=True)
    fast = relprop.explain(model, x, target=0, method="lrp", preset="attnlrp")
    assert fast.conservation is None and fast.notes == []


def test_rule_context_documents_what_exists():
    assert "rule_options" not in RuleContext.__doc__
    ctx_fields = {f for f in RuleContext.__dataclass_fields__}
    assert {"node", "args", "out", "live", "preset", "options"} <= ctx_fields
