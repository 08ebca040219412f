"""Papercuts of issue 30: a warning raised inside relprop points at the caller's line (the frame just
outside relprop), and relprop.methods() prints a readable table while it stays the dict it was."""
from __future__ import annotations

import inspect
import warnings

import torch

import models
import relprop


def test_warnings_point_at_the_callers_line():
    model = models.hf_gpt2_lm()
    x = models.decoder_batch()
    x["attention_mask"] = x["attention_mask"].flip(1)  # left padding: explain() warns
    x["input_ids"] = x["input_ids"].flip(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        relprop.explain(model, x, target="next_token")
        line = inspect.currentframe().f_lineno - 1
    ours = [w for w in caught if issubclass(w.category, relprop.RelpropWarning)]
    assert ours and all(w.filename == __file__ and w.lineno == line for w in ours), \
        [(w.filename, w.lineno, str(w.message)[:60]) for w in ours]


def test_rule_registration_warning_points_at_the_callers_line():
    preset = relprop.Preset("test_remembered_warn", extends="attnlrp")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        preset.rule(torch.ops.aten.gelu.default)(lambda ctx, r: (r,))
        line = inspect.currentframe().f_lineno - 1
    ours = [w for w in caught if issubclass(w.category, relprop.RelpropWarning)]
    assert ours and all(w.filename == __file__ and w.lineno == line for w in ours)


def test_methods_prints_a_table_and_stays_a_dict():
    table = relprop.methods()
    assert isinstance(table, dict) and dict(table) == table and "lrp" in table and table["lrp"]["signed"]
    lines = repr(table).splitlines()
    assert lines[0].split()[:3] == ["method", "class-specific", "signed"] and set(lines[1]) <= {"-", " "}
    assert [line.split()[0] for line in lines[2:2 + len(table)]] == list(table)
    assert str(table) == repr(table)
    html = table._repr_html_()
    assert html.count("<tr>") == len(table) + 1 and all(f">{name}<" in html for name in table)


def test_a_warning_from_deep_inside_explain_points_at_the_callers_line():
    model = models.hf_bert()  # no tokenizer, no special ids in the config: the special-tokens warning
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        relprop.explain(model, models.text_batch(lengths=(5, 4)), target=1, method="lrp")
        line = inspect.currentframe().f_lineno - 1
    ours = [w for w in caught if issubclass(w.category, relprop.RelpropWarning)]
    assert any("no special token" in str(w.message) for w in ours)
    assert all(w.filename == __file__ and w.lineno == line for w in ours)


def test_warn_without_relprop_on_the_stack_names_the_caller():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        relprop.errors.warn("plain")
        line = inspect.currentframe().f_lineno - 1
    assert [(w.filename, w.lineno, w.category) for w in caught] == [(__file__, line, relprop.RelpropWarning)]
