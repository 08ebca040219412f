"""The rule of each node of a captured graph under a preset: what the walk, the fast path, the
rule check and the coverage report apply.

Most nodes get the rule the preset has for their op. Two patterns of the graph are explained as a
whole instead, found structurally by :mod:`relprop.graph` and cached on the captured program:

* an element-wise function of one tensor written out op by op
  (:func:`relprop.graph.elementwise.find_regions`): when the preset has a rule for
  :data:`relprop.rules.rule_registry.ELEMENTWISE_FUNCTION`, the function's output node gets that rule,
  applied to the function's input (:func:`on_operands`); the nodes inside the function receive no
  relevance. Presets without such a rule explain the ops one by one;
* a product with a selection parameter of a selective state-space scan
  (:func:`relprop.graph.selective_scan.selection_parameters`): the parameter is a constant of the
  product (:func:`with_constants`; Jafari et al., NeurIPS 2024, MambaLRP), in every preset.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Dict, FrozenSet, Optional, Union

import torch
import torch.fx

from ..graph.capture import Captured
from ..graph.complex_values import reads_complex
from ..graph.elementwise import Region, find_regions
from ..graph.torch_fixes import safe_target
from ..graph.selective_scan import selection_parameters
from ..rules import rule_registry as registry
from ..rules.generic import gradient_times_input
from ..rules.rule_registry import ELEMENTWISE_FUNCTION, Preset
from ..rules.spec import GradientForm, RuleSpec, as_spec


def on_operands(spec: RuleSpec, operands: tuple, region: Region) -> RuleSpec:
    """``spec`` applied to ``operands`` (nodes) instead of the node's own arguments: ``rule(ctx, R)``
    sees them as ``ctx.args`` and returns one share per operand; its gradient form is called
    ``form(node, live, eps)(*operand values, output)`` by the fast path."""
    return dataclasses.replace(spec, operands=tuple(operands), region=region)


def with_constants(spec: RuleSpec, positions: FrozenSet[int]) -> RuleSpec:
    """``spec`` with the arguments at ``positions`` held constant (not live): it gives them no
    relevance, a share it gives them anyway is booked as absorbed, and its gradient form sees them
    detached."""
    positions = frozenset(positions)
    fn = spec.fn

    def held(ctx, relevance):
        ctx.live = tuple(False if i in positions else x for i, x in enumerate(ctx.live))
        return fn(ctx, relevance)
    form = spec.gradient_form
    return dataclasses.replace(spec, fn=held, name=spec.name, module=spec.module,
                               constant_positions=spec.constant_positions | positions,
                               no_relevance_to=spec.no_relevance_to | positions,
                               gradient_form=None if form is None else _detaching(form, positions))


def _detaching(form, positions):
    def detached(node, live, eps):
        live = tuple(False if i in positions else x for i, x in enumerate(live))
        op = form(node, live, eps)

        def call(*args, **kwargs):
            args = tuple(a.detach() if i in positions and torch.is_tensor(a) else a for i, a in enumerate(args))
            return (op or safe_target(node.target))(*args, **kwargs)
        return call
    return GradientForm(detached, lost=form.lost, inner=form)


def regions(captured: Captured) -> Dict[torch.fx.Node, Region]:
    """The element-wise functions of ``captured``'s graph, by output node (cached on the program)."""
    plans = captured.plans
    if "elementwise_regions" not in plans:
        a = captured.analysis
        protected = set(a.sources) | {n for b in a.blocks for n in (b.attention, b.hidden, b.features)
                                       if n is not None}
        plans["elementwise_regions"] = find_regions(captured.graph, a.live, protected)
    return plans["elementwise_regions"]


def constants(captured: Captured) -> Dict[torch.fx.Node, FrozenSet[int]]:
    """{product node: argument positions that are selection parameters of a selective scan}
    (cached on the program)."""
    plans = captured.plans
    if "selection_parameters" not in plans:
        plans["selection_parameters"] = selection_parameters(captured.graph, captured.analysis.live)
    return plans["selection_parameters"]


#: the generic z-rule of ``unsupported="z_rule"``, for ops the preset has no rule for
_Z_RULE = as_spec(gradient_times_input, kind="fallback")


def rule_finder(captured: Captured, preset: Union[str, Preset], unsupported: str = "error"
                ) -> Callable[[torch.fx.Node], Optional[RuleSpec]]:
    """``node -> RuleSpec`` under ``preset`` (None when the node has none): the rule of an element-wise
    function at its output node, the rule of the node's op with selection parameters held constant,
    else the rule of its op; the generic z-rule for an op without one when ``unsupported="z_rule"``.
    ``preset`` is the request's :class:`relprop.rules.Preset` (a name, from a direct caller, is resolved)."""
    p = registry.get_preset(preset)
    function_rule = p.lookup(ELEMENTWISE_FUNCTION)
    found = regions(captured) if function_rule is not None else {}
    held = constants(captured)

    def rule_of(node) -> Optional[RuleSpec]:
        if reads_complex(node):  # complex values the graph could not write in real form: no rule applies
            return None
        region = found.get(node)
        if region is not None:
            return on_operands(function_rule, (region.input,), region)
        spec = p.lookup(node.target)
        if spec is None and unsupported == "z_rule":
            spec = _Z_RULE
        positions = held.get(node)
        if spec is not None and positions:
            return with_constants(spec, positions)
        return spec
    return rule_of
