"""The rule of each node of a captured graph under a preset: what the walk, the fast path, the
rule check and the coverage report apply.

Most nodes get the rule the preset has for their op. Two patterns of the graph are explained as a
whole instead, found structurally by :mod:`relprop.graph` and cached on the captured program:

* an element-wise function of one tensor written out op by op
  (:func:`relprop.graph.elementwise.find_regions`): when the preset has a rule for
  :data:`relprop.rules.registry.ELEMENTWISE_FUNCTION`, the function's output node gets that rule,
  applied to the function's input (:class:`OnOperands`); the nodes inside the function receive no
  relevance. Presets without such a rule explain the ops one by one;
* a product with a selection parameter of a selective state-space scan
  (:func:`relprop.graph.selective_scan.selection_parameters`): the parameter is a constant of the
  product (:class:`WithConstants`; Jafari et al., NeurIPS 2024, MambaLRP), in every preset.
"""
from __future__ import annotations

from typing import Callable, Dict, FrozenSet, Optional

import torch
import torch.fx

from ..graph.capture import Captured
from ..graph.elementwise import Region, find_regions
from ..graph.torch_fixes import safe_target
from ..graph.selective_scan import selection_parameters
from ..rules import registry
from ..rules.generic import gradient_times_input
from ..rules.registry import ELEMENTWISE_FUNCTION


class OnOperands:
    """A rule applied to ``operands`` (nodes) instead of the node's own arguments: ``rule(ctx, R)``
    sees them as ``ctx.args`` and returns one share per operand. ``gradient_form`` is the rule's
    form (called ``form(node, live, eps)(*operand values, output)`` by the fast path)."""

    def __init__(self, fn, operands: tuple, region: Region):
        self.fn, self.operands, self.region = fn, operands, region
        self.__name__ = getattr(fn, "__name__", "rule")
        self.__module__ = getattr(fn, "__module__", __name__)
        self.gradient_form = getattr(fn, "gradient_form", None)

    def __call__(self, ctx, relevance):
        return self.fn(ctx, relevance)


class WithConstants:
    """A rule applied with the arguments at ``positions`` held constant (not live): it gives them
    no relevance, and its gradient form sees them detached."""

    def __init__(self, fn, positions: FrozenSet[int]):
        self.fn, self.positions = fn, positions
        #: the walk books a share the rule gives these arguments as absorbed, as for any constant
        self.constant_positions = frozenset(positions)
        self.no_relevance_to = frozenset(positions) | frozenset(getattr(fn, "no_relevance_to", ()))
        self.__name__ = getattr(fn, "__name__", "rule")
        self.__module__ = getattr(fn, "__module__", __name__)
        form = getattr(fn, "gradient_form", None)
        self.gradient_form = None if form is None else _detaching(form, positions)

    def __call__(self, ctx, relevance):
        ctx.live = tuple(False if i in self.positions else x for i, x in enumerate(ctx.live))
        return self.fn(ctx, relevance)


def _detaching(form, positions):
    def detached(node, live, eps):
        live = tuple(False if i in positions else x for i, x in enumerate(live))
        op = form(node, live, eps)

        def call(*args, **kwargs):
            args = tuple(a.detach() if i in positions and torch.is_tensor(a) else a for i, a in enumerate(args))
            return (op or safe_target(node.target))(*args, **kwargs)
        return call
    detached.lost = getattr(form, "lost", None)
    detached.inner = form
    return detached


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


def rule_finder(captured: Captured, preset: str, unsupported: str = "error") -> Callable:
    """``node -> rule`` under ``preset`` (None when the node has none): the rule of an element-wise
    function at its output node, the rule of the node's op with selection parameters held constant,
    else the rule of its op; the generic z-rule for an op without one when ``unsupported="z_rule"``."""
    p = registry.get_preset(preset)
    function_rule = p.lookup(ELEMENTWISE_FUNCTION)
    found = regions(captured) if function_rule is not None else {}
    held = constants(captured)

    def rule_of(node) -> Optional[Callable]:
        region = found.get(node)
        if region is not None:
            return OnOperands(function_rule, (region.input,), region)
        fn = p.lookup(node.target)
        if fn is None and unsupported == "z_rule":
            fn = gradient_times_input
        positions = held.get(node)
        if fn is not None and positions:
            return WithConstants(fn, positions)
        return fn
    return rule_of
