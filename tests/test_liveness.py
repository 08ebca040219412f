"""No value that depends on the explained input is taken for a constant: on every model of the zoo, each
node of the captured graph that the explained input reaches (by data flow, through any op) and whose value
is a floating or complex tensor is on relprop's live path (``GraphAnalysis.live``), and the graph holds no
complex value at all (:mod:`relprop.graph.complex_values` writes it in real form) unless an op without a
real form reads it."""
from __future__ import annotations

import pytest
import torch

import zoo
from zoo_checks import get_model, primary
from relprop.graph.capture import capture
from relprop.graph.nodes import CONSTANT_PRODUCING

CASES = [pytest.param(name, marks=() if name in zoo.FAST + ["xlnet", "llama4_text", "timm_mvitv2"] else
                      (pytest.mark.slow,)) for name in zoo.ZOO]


def _name_of(entry, inputs):
    if torch.is_tensor(inputs):
        return "x"
    x = primary(entry, inputs)
    return next(k for k, v in inputs.items() if v is x)


@pytest.mark.parametrize("name", CASES)
def test_input_dependent_values_are_live(name):
    entry = zoo.ZOO[name]
    model = get_model(name)
    inputs = entry.inputs(model, 2, 0)
    kwargs = dict(inputs) if isinstance(inputs, dict) else {"x": inputs}
    if isinstance(inputs, dict) and getattr(getattr(model, "config", None), "use_cache", None) is not None:
        kwargs["use_cache"] = False  # as explain() calls a decoder
    if not isinstance(inputs, dict):
        import inspect
        first = next(iter(inspect.signature(model.forward).parameters))
        kwargs = {first: inputs}
    c = capture(model, kwargs, _name_of(entry, kwargs) if isinstance(inputs, dict) else next(iter(kwargs)))
    a = c.analysis
    primary_node = next(n for n, kind, tgt in c.bindings if kind == "user" and tgt == c.primary)
    reached = {primary_node} | set(a.sources)
    missing = []
    for n in c.graph.nodes:
        # reached through a tensor's values (a size read off it, full_like's shape: not its values)
        if n in reached or n.target in CONSTANT_PRODUCING or not any(
                m in reached and isinstance(m.meta.get("val"), (torch.Tensor, list, tuple)) for m in n.all_input_nodes):
            continue
        reached.add(n)
        v = n.meta.get("val")
        values = v if isinstance(v, (list, tuple)) else [v]
        if any(isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()) for t in values) \
                and n not in a.live and n.op == "call_function":
            missing.append(f"{n.name} ({n.target})")
    assert not missing, f"{name}: input-dependent values classed constant: {missing[:10]}"
