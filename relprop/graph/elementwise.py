"""Element-wise functions written out op by op: the subgraphs that compute ``y = f(x)`` from one tensor.

Activations are often not one aten op in a captured graph: GPT-2's ``gelu_new`` is
``0.5·x·(1 + tanh(√(2/π)(x + 0.044715·x³)))`` (``mul``, ``pow``, ``add``, ``tanh``), CLIP's
``quick_gelu`` is ``x·sigmoid(1.702·x)``, a SiLU may be written ``x·sigmoid(x)``, Gemma-2's
softcapping is ``c·tanh(x / c)`` and Mamba's softplus is ``where(x > 20, x, log1p(exp(x)))``.
A rule that explains a function of one variable (AttnLRP's identity rule, Eq. 9) applies to the
function, not to its parts: op by op, the product inside ``gelu_new`` would get the uniform rule of
a product of two tensors, and the constants added along the way would absorb relevance.

:func:`find_regions` finds these subgraphs structurally, whatever model they come from: a
*region* is a set of input-dependent nodes of :data:`POINTWISE` ops that

* reads exactly one input-dependent tensor ``x`` from outside (anything else it reads is a
  constant: a Python number, a parameter, a buffer, a mask that does not depend on the input),
* whose values are all shaped like ``x`` (element-wise: output i depends on input i only),
* whose nodes are read only by other nodes of the region (or by checks that compute nothing, such
  as ``_assert_tensor_metadata``), except one, its output ``y``,
* has at least two nodes and at least one non-linear one (:data:`NONLINEAR`, or a product or
  quotient of two values that depend on ``x``).

Regions are grown backwards from each candidate output, latest first, so a region is the largest
such subgraph ending at its output. Nodes in ``protected`` (attention maps, block inputs, the
relevance sources) are never inside a region.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, FrozenSet, Iterable, Optional, Set

import torch
import torch.fx

aten = torch.ops.aten

#: element-wise ops a written-out function of one tensor is made of
POINTWISE = frozenset({
    aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar, aten.rsub.Scalar, aten.rsub.Tensor,
    aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar, aten.neg.default,
    aten.pow.Tensor_Scalar, aten.tanh.default, aten.sigmoid.default, aten.erf.default, aten.exp.default,
    aten.log.default, aten.log1p.default, aten.rsqrt.default, aten.sqrt.default, aten.reciprocal.default,
    aten.gelu.default, aten.silu.default, aten.relu.default, aten.softplus.default, aten.abs.default,
    aten.clamp.default, aten.clamp_min.default, aten.clamp_max.default, aten.hardtanh.default,
    aten.where.self, aten.gt.Scalar, aten.lt.Scalar, aten.ge.Scalar, aten.le.Scalar,
    aten._to_copy.default, aten.to.dtype, aten.clone.default, aten.alias.default,
})
#: the ops that make a region non-linear (with products and quotients of two values of the region)
NONLINEAR = frozenset({
    aten.pow.Tensor_Scalar, aten.tanh.default, aten.sigmoid.default, aten.erf.default, aten.exp.default,
    aten.log.default, aten.log1p.default, aten.rsqrt.default, aten.sqrt.default, aten.reciprocal.default,
    aten.gelu.default, aten.silu.default, aten.relu.default, aten.softplus.default, aten.abs.default,
    aten.clamp.default, aten.clamp_min.default, aten.clamp_max.default, aten.hardtanh.default,
})
_PRODUCTS = frozenset({aten.mul.Tensor, aten.div.Tensor})


@dataclasses.dataclass(frozen=True)
class Region:
    """``output = f(input)`` computed element-wise by ``nodes`` (``output`` among them)."""

    output: torch.fx.Node
    input: torch.fx.Node
    nodes: FrozenSet[torch.fx.Node]


def _shape(node) -> Optional[tuple]:
    v = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def _inert(node: torch.fx.Node) -> bool:
    """A user that computes nothing from the value (``_assert_tensor_metadata`` checks of a cast)."""
    return node.op == "call_function" and node.meta.get("val") is None and not node.users


def _live_inputs(node: torch.fx.Node, live) -> list:
    return [m for m in node.all_input_nodes if m in live]


def _grow(y: torch.fx.Node, live, protected) -> Optional[Region]:
    """The largest region ending at ``y`` (None when there is none)."""
    shape = _shape(y)
    if shape is None:
        return None
    nodes: Set[torch.fx.Node] = {y}
    changed = True
    while changed:
        changed = False
        for n in list(nodes):
            for m in _live_inputs(n, live):
                if m in nodes or m in protected or m.op != "call_function" or m.target not in POINTWISE:
                    continue
                if _shape(m) != shape or not all(u in nodes or _inert(u) for u in m.users):
                    continue
                nodes.add(m)
                changed = True
    outside = {m for n in nodes for m in _live_inputs(n, live) if m not in nodes}
    if len(nodes) < 2 or len(outside) != 1:
        return None
    (x,) = outside
    if _shape(x) != shape or not _nonlinear(nodes, live):
        return None
    return Region(y, x, frozenset(nodes))


def _nonlinear(nodes, live) -> bool:
    for n in nodes:
        if n.target in NONLINEAR:
            return True
        if n.target in _PRODUCTS and len(_live_inputs(n, live)) > 1:
            return True
    return False


def find_regions(graph: torch.fx.Graph, live, protected: Iterable[torch.fx.Node] = ()) -> Dict[torch.fx.Node, Region]:
    """{output node: :class:`Region`} for every element-wise function of one tensor written out op
    by op in ``graph`` (see the module docstring); ``live`` are the input-dependent nodes."""
    protected = set(protected)
    regions: Dict[torch.fx.Node, Region] = {}
    taken: Set[torch.fx.Node] = set()
    for y in reversed(graph.nodes):
        if y in taken or y in protected or y not in live or y.op != "call_function" or y.target not in POINTWISE:
            continue
        region = _grow(y, live, protected | taken)
        if region is None:
            continue
        regions[y] = region
        taken |= region.nodes
    return regions
