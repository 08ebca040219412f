"""No value that depends on the explained input is taken for a constant: on every model of the zoo, each
node of the captured graph that the explained input reaches through values (floating or complex ones, and
the token ids themselves through their rearrangements) and whose value is a floating or complex tensor is
on relprop's live path (``GraphAnalysis.live``). Integer values computed from the ids (a padding mask,
position ids counted from it, a router's expert indices) are structure, not the input's value: what they
select is held constant, as the rules define it."""
from __future__ import annotations

import re

import pytest
import torch

import relprop

import zoo
from zoo_checks import get_model, primary
from relprop.graph.capture import CACHE
from relprop.graph.id_lookups import ID_ROUTING
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
    try:
        c = CACHE.get(model, kwargs, _name_of(entry, kwargs) if isinstance(inputs, dict) else next(iter(kwargs)))
    except relprop.RelpropError as why:  # a model the zoo expects refused at capture: with its true reason
        assert any(re.search(pattern, str(why), re.S) for _, pattern in entry.refusals), str(why)[:400]
        return
    a = c.analysis
    primary_node = next(n for n, kind, tgt in c.bindings if kind == "user" and tgt == c.primary)
    reached = {primary_node} | set(a.sources)
    missing = []
    ids = {primary_node}  # the token ids, through their rearrangements

    def carries(m) -> bool:  # m passes the input's values on (not a size, not a mask computed from ids)
        v = m.meta.get("val")
        values = v if isinstance(v, (list, tuple)) else [v]
        return m in ids or any(isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())
                               for t in values)

    for n in c.graph.nodes:
        if n in reached or n.target in CONSTANT_PRODUCING or not any(m in reached and carries(m)
                                                                       for m in n.all_input_nodes):
            continue
        reached.add(n)
        if n.target in ID_ROUTING and n.args and n.args[0] in ids:
            ids.add(n)
        if carries(n) and n not in ids and n not in a.live and n.op == "call_function":
            missing.append(f"{n.name} ({n.target})")
    assert not missing, f"{name}: input-dependent values classed constant: {missing[:10]}"
