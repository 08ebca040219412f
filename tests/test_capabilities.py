"""Capabilities are declared, not looked for: a rule's in its RuleSpec (keywords of @rule), a
method's in its MethodInfo (keywords of @method). No module of relprop reads a capability off a
function with getattr, and the declarations say what relprop's own rules and methods do."""
import ast
import dataclasses
import re
from pathlib import Path

import pytest
import torch

from relprop.methods import all_methods
from relprop.rules import RuleSpec, get_preset, lookup
from relprop.rules.spec import GradientForm

PACKAGE = Path(__file__).resolve().parents[1] / "relprop"
aten = torch.ops.aten

#: the names a rule or a method declares; reading one with getattr means it was set on a function
CAPABILITIES = ("gradient_form", "formula", "writes_out", "WRITES_OUT", "no_relevance_to", "constant_positions",
                "operands", "region", "folds", "no_windows",
                "lost", "inner")  # a gradient form's (a trace has .streams: not a capability)
#: getattr on a rule function (fn, rule, spec, ...) or of a capability name, and setattr of one
READS = [re.compile(r"getattr\(\s*(fn|rule|_rule|spec|rule_fn|func)\b"),
         re.compile(r"getattr\([^,()]+,\s*(\"|')?(%s)\b" % "|".join(CAPABILITIES)),
         re.compile(r"setattr\([^,()]+,\s*(\"|')?(%s)\b" % "|".join(CAPABILITIES)),
         re.compile(r"^\s*\w+\.(%s)\s*=" % "|".join(c for c in CAPABILITIES if c != "WRITES_OUT"), re.M)]
#: the lists that said which methods can do what before MethodInfo declared it
#: and the words that called block folding streaming before "stream" kept its encoder–decoder meaning only
OLD_LISTS = re.compile(r"\b(STREAM_MAPS|TWO_STREAM_METHODS|NOT_APPLICABLE|streamable|RERUNS|ROLLOUT_METHODS|"
                       r"_OWN_FUSIONS|Streamer|STREAM_WINDOWS|streamed|streaming)\b")
#: module-level collections that name several methods and are not capability lists: (file, line's name)
NOT_CAPABILITIES = {
    ("relprop/cli/parser.py", "DEFAULT_METHODS"),  # the paper's line-up the CLI evaluates by default
    ("relprop/methods/__init__.py", "__all__"),  # module names (transformer_attribution.py, attcat.py)
    ("relprop/viz/blocks.py", "METHOD_SOURCE"),  # which per-block quantity a picture draws (viz, not a method's)
    # the names the CLI checks before importing torch: a copy of the registry that tests/test_cli_startup.py
    # keeps equal to it (relprop/cli/known_names.py)
    ("relprop/cli/known_names.py", "_OPTIONS"),
}


def test_no_capability_is_read_off_a_function():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        for pattern in READS + [OLD_LISTS]:
            for m in pattern.finditer(text):
                line = text.count("\n", 0, m.start()) + 1
                found.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {m.group(0).strip()}")
    assert not found, "capabilities read or set as function attributes:\n" + "\n".join(found)


def _name_collections(tree, methods):
    """(line, assigned name) of every module-level tuple, list, set or dict (its keys) holding the
    names of two methods or more."""
    for node in tree.body:
        if not isinstance(node, (ast.Assign, ast.AnnAssign)) or node.value is None:
            continue
        target = node.targets[0] if isinstance(node, ast.Assign) else node.target
        for sub in ast.walk(node.value):
            elts = (sub.keys if isinstance(sub, ast.Dict) else
                    sub.elts if isinstance(sub, (ast.Tuple, ast.List, ast.Set)) else [])
            named = [e.value for e in elts if isinstance(e, ast.Constant) and e.value in methods]
            if len(named) >= 2:
                yield node.lineno, getattr(target, "id", ast.dump(target))
                break


def test_no_module_level_list_of_method_names():
    methods = set(all_methods())
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = str(path.relative_to(PACKAGE.parent))
        for line, name in _name_collections(ast.parse(path.read_text()), methods):
            if (rel, name) not in NOT_CAPABILITIES:
                found.append(f"{rel}:{line}: {name}")
    assert not found, "method names listed in a module, not declared with @method(...):\n" + "\n".join(found)


def test_rules_declare_what_the_engine_reads():
    for name in ("base", "chefer2021", "lrp", "attnlrp", "cp_lrp"):
        assert all(isinstance(s, RuleSpec) for s in get_preset(name).rules.values()), name
    # the sums' rules compute into their output; no other rule does
    writers = {s.name for p in ("chefer2021", "lrp", "attnlrp", "cp_lrp") for s in get_preset(p).rules.values()
               if s.writes_out}
    assert writers == {"residual_add", "residual_sub", "add_z_rule", "sub_z_rule"}
    for preset in ("chefer2021", "lrp", "attnlrp"):  # a divisor gets no relevance (a normalizing statistic)
        assert lookup(preset, aten.div.Tensor).no_relevance_to == {1}
    for preset in ("chefer2021", "lrp", "attnlrp"):  # products with a constant matrix apply this formula
        assert lookup(preset, aten.linear.default).formula is not None
    fast = ("attnlrp", "cp_lrp")
    for preset in fast:  # every rule of a modified-gradient preset's own table has a form
        assert all(s.gradient_form is not None for s in get_preset(preset).rules.values()), preset
    assert lookup("chefer2021", aten.linear.default).gradient_form is None


def test_methods_declare_where_they_apply():
    methods = all_methods()
    assert {n for n, m in methods.items() if m.streams == 2} == {
        "gradient_rollout", "transformer_attribution", "lrp", "input_x_gradient", "smoothgrad", "integrated_gradients"}
    assert {n for n, m in methods.items() if m.no_windows is not None} == {
        "cat", "attcat", "attgrads", "attention_norm", "attn_res_ln_norm", "gradcam", "vit_cx", "value_zeroing"}
    assert {n for n, m in methods.items() if m.folds is not None} == {
        "transformer_attribution", "rollout", "gradient_rollout", "ta_without_gradient"}
    assert {n for n, m in methods.items() if m.rollout} == {
        "transformer_attribution", "ta_without_gradient", "rollout", "gradient_rollout", "value_zeroing"}
    assert {n for n, m in methods.items() if m.checks_only} == {
        "input_x_gradient", "smoothgrad", "integrated_gradients", "vit_cx", "value_zeroing"}
    assert {n: m.head_fusions for n, m in methods.items() if m.head_fusions is not None} == {
        "attention_norm": ("combined", "mean", "max", "min", "gradient"), "attn_res_ln_norm": ("combined",),
        "value_zeroing": ("all",)}


def test_gradient_forms_are_data():
    """A gradient form is a frozen GradientForm: what its stabilizer keeps (``lost``) is a field, set
    for the ε-rules' forms and for the renormalization, absent for the exact ones."""
    forms = {p: {s.name: s.gradient_form for s in get_preset(p).rules.values()} for p in ("attnlrp", "cp_lrp")}
    assert all(isinstance(f, GradientForm) for table in forms.values() for f in table.values())
    attn = lookup("attnlrp", aten.linear.default).gradient_form
    assert attn.lost is not None and attn.inner is not None
    assert lookup("attnlrp", aten.gelu.default).gradient_form.lost is None  # the identity rule loses nothing
    assert lookup("attnlrp", aten.div.Tensor).gradient_form.lost is not None  # top-k renormalization
    with pytest.raises(dataclasses.FrozenInstanceError):
        attn.lost = None
    # a plain function declared as a form is wrapped, declaring nothing lost
    spec = RuleSpec(lambda ctx, r: (r,), gradient_form=lambda node, live, eps: None)
    assert isinstance(spec.gradient_form, GradientForm) and spec.gradient_form.lost is None
