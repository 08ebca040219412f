"""The examples of docs/extending.md, read from the markdown and run: a user's rule, a user's preset
with a declared gradient form, a user's method. Each registration is undone afterwards so that the
rest of the run sees relprop's own tables."""
import re
from pathlib import Path

import pytest
import torch

import models
import relprop
from relprop.methods import method_registry as methods_registry
from relprop.methods import get_method
from relprop.rules import get_preset, lookup, preset_table
from relprop.rules.gradient_forms import identity_rule

DOC = Path(__file__).resolve().parents[1] / "docs" / "extending.md"
aten = torch.ops.aten


def code_blocks(heading: str) -> list:
    """The ```python blocks of docs/extending.md under ``heading`` (a line such as '## Adding a
    method'), up to the next heading of the same or a higher level."""
    text = DOC.read_text()
    level = heading.split(" ", 1)[0]
    start = text.index("\n" + heading + "\n")
    nxt = re.compile(r"^#{1,%d} " % len(level), re.M).search(text, start + len(heading) + 2)
    section = text[start:nxt.start() if nxt else len(text)]
    return re.findall(r"```python\n(.*?)```", section, re.S)


@pytest.fixture(scope="module")
def vit():
    model = models.timm_vit_tiny()
    return model, models.image_batch(model)


def _drop_preset(name):
    preset_table.PRESETS.pop(name, None)


def test_the_docs_examples_are_found():
    assert len(code_blocks("## Adding a rule")) == 3  # the rule, the preset/override, the declared form
    assert len(code_blocks("### What a rule declares")) == 1
    assert len(code_blocks("## Adding a method")) == 1


def test_rule_example_is_the_rule_the_walk_applies():
    ns = {}
    try:
        exec(code_blocks("## Adding a rule")[0], ns)
        spec = lookup("chefer2021", aten.exp.default)
        assert spec.fn is ns["exp_identity"] and spec.gradient_form is None  # declared nothing else
        calls = []

        def spy(ctx, relevance):
            calls.append(ctx.node.name)
            return ns["exp_identity"](ctx, relevance)
        with relprop.rules.override({aten.exp.default: spy}, preset="chefer2021"):
            again = relprop.explain(ns["net"], ns["inputs"], target=0, method="lrp", preset="chefer2021")
        assert len(calls) == 1
        assert torch.equal(again.scores, ns["exp"].scores) and ns["exp"].scores.shape == (2, 6)
        assert torch.isfinite(ns["exp"].scores).all() and ns["exp"].scores.abs().sum() > 0
    finally:
        get_preset("chefer2021").reset(aten.exp.default)
    with pytest.raises(relprop.UnsupportedOperation, match="aten.exp.default"):  # the rule was what made it run
        relprop.explain(ns["net"], ns["inputs"], target=0, method="lrp", preset="chefer2021")


def test_preset_example_registers_in_the_users_preset_only(vit):
    model, x = vit
    ns = {"relprop": relprop, "torch": torch, "model": model, "x": x}
    try:
        exec(code_blocks("## Adding a rule")[1], ns)
        assert get_preset("mine").lookup(aten.gelu.default).fn is ns["gelu_rule"]
        assert lookup("chefer2021", aten.gelu.default).fn is not ns["gelu_rule"]
        assert get_preset("mine").lookup(aten.linear.default) is lookup("chefer2021", aten.linear.default)
    finally:
        _drop_preset("mine")


def test_declared_gradient_form_keeps_the_fast_path_and_the_numbers(vit):
    model, x = vit
    ns = {"relprop": relprop, "torch": torch, "model": model, "x": x}
    try:
        exec(code_blocks("### What a rule declares")[0], ns)
        spec = get_preset("attnlrp_gelu").lookup(aten.gelu.default)
        assert spec.fn is ns["gelu_identity"] and spec.gradient_form is identity_rule
        mine, theirs = ns["mine"], ns["theirs"]
        assert torch.equal(mine.scores, theirs.scores)  # the same rule and form as "attnlrp"'s own
        assert not any("fast path" in n for n in getattr(mine, "notes", []) or [])
    finally:
        _drop_preset("attnlrp_gelu")


def test_method_example_equals_raw_attention_with_max_fusion(vit):
    model, x = vit
    ns = {"relprop": relprop, "torch": torch, "model": model, "x": x}
    try:
        exec(code_blocks("## Adding a method")[0], ns)
        info = get_method("max_head_attention")
        assert (info.streams, info.no_windows, info.folds, info.needs_relevance) == (1, None, None, False)
        exp = ns["exp"]
        reference = relprop.explain(model, x, method="raw_attention", head_fusion="max")
        assert exp.scores.shape == reference.scores.shape == (2, 16)
        torch.testing.assert_close(exp.scores, reference.scores)
        with pytest.raises(relprop.MethodError, match="registered already"):
            exec(code_blocks("## Adding a method")[0], ns)
    finally:
        methods_registry._METHODS.pop("max_head_attention", None)
