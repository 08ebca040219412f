"""The selection parameters of a selective state-space scan (Mamba), found in the graph structurally.

A Mamba mixer (Gu & Dao 2023) computes, from its input sequence x, the step size Δ, the input
matrix B and the output matrix C with one linear projection split in three (Δ through a low-rank
projection and a softplus), discretizes Ā = exp(Δ A) and B̄ = Δ B, and runs the recurrence
h_t = Ā_t ⊙ h_{t−1} + B̄_t x_t, y_t = C_t h_t (+ D x_t). MambaLRP (Jafari, Montavon, Müller &
Eberle, NeurIPS 2024, §4 "selective SSM") explains the scan as the linear time-varying system it is
for fixed parameters: Ā, B̄ and C, functions of the input, are held constant (``.detach()`` in the
authors' code), so relevance flows only along x → B̄ x → h → C h, and the scan conserves it.

:func:`selection_parameters` finds them without knowing the model: a *decay* is ``exp(c · Δ)``
with c constant and Δ depending on the input, whose steps (``select``/``slice`` of it) multiply
another input-dependent tensor (the state of an unrolled scan). Walking back from Δ to the first
``split`` it comes from gives that split's chunks (Δ, B, C); every value computed from those chunks
alone is a selection parameter. An op that mixes selection parameters with other input-dependent
values (B̄ ⊙ x, Ā_t ⊙ h_{t−1}, C_t h_t, the first state from Ā_0 and the zero initial state) holds
the selection parameters constant; none of them, and nothing before them back to the projection,
receives relevance.
"""
from __future__ import annotations

import operator
from typing import Dict, FrozenSet, Optional, Set

import torch
import torch.fx

aten = torch.ops.aten

SPLITS = frozenset({aten.split_with_sizes.default, aten.split.Tensor, aten.split_with_sizes_copy.default,
                    aten.split_copy.Tensor, aten.unbind.int})
#: how the steps of a decay are read by an unrolled scan
STEP_READS = frozenset({aten.select.int, aten.slice.Tensor})
#: ops a step may pass through before it multiplies the state
_ROUTING = frozenset({aten.unsqueeze.default, aten.view.default, aten.reshape.default, aten.permute.default,
                      aten.transpose.int, aten.expand.default, aten._to_copy.default, aten.to.dtype,
                      aten.clone.default, aten.squeeze.dim, aten.squeeze.dims})
#: how deep to look back from Δ for the split it comes from
MAX_DEPTH = 32


def _is_decay(node: torch.fx.Node, live) -> Optional[torch.fx.Node]:
    """Δ when ``node`` is the decay exp(c · Δ) of an unrolled scan, else None."""
    if node.op != "call_function" or node.target is not aten.exp.default or node not in live:
        return None
    arg = node.args[0]
    if not isinstance(arg, torch.fx.Node) or arg.target is not aten.mul.Tensor:
        return None
    factors = [a for a in arg.args[:2] if isinstance(a, torch.fx.Node) and a in live]
    if len(factors) != 1 or not any(_multiplies_state(u, live) for u in node.users if u.target in STEP_READS):
        return None
    return factors[0]


def _multiplies_state(step: torch.fx.Node, live, hops: int = 4) -> bool:
    for u in step.users:
        if u.op != "call_function":
            continue
        if u.target is aten.mul.Tensor and all(isinstance(a, torch.fx.Node) and a in live for a in u.args[:2]):
            return True
        if u.target in _ROUTING and hops > 0 and _multiplies_state(u, live, hops - 1):
            return True
    return False


def _split_of(delta: torch.fx.Node, live):
    """The split node that ``delta`` comes from (the nearest, walking back through live values)."""
    frontier, seen = [delta], set()
    for _ in range(MAX_DEPTH):
        nxt = []
        for n in frontier:
            if n in seen or n.op != "call_function":
                continue
            seen.add(n)
            if n.target is operator.getitem and isinstance(n.args[0], torch.fx.Node) \
                    and n.args[0].target in SPLITS:
                return n.args[0]
            nxt.extend(m for m in n.all_input_nodes if m in live)
        if not nxt:
            return None
        frontier = nxt
    return None


def selection_parameters(graph: torch.fx.Graph, live) -> Dict[torch.fx.Node, FrozenSet[int]]:
    """{node: positions of its arguments that are selection parameters} for every op that mixes
    selection parameters of a selective scan with other input-dependent values (module docstring);
    empty when the graph has no selective scan."""
    seeds: Set[torch.fx.Node] = set()
    for node in graph.nodes:
        delta = _is_decay(node, live)
        if delta is None:
            continue
        split = _split_of(delta, live)
        if split is None:
            continue
        seeds |= {u for u in split.users if u.target is operator.getitem and u in live}
    if not seeds:
        return {}
    params: Set[torch.fx.Node] = set(seeds)
    held: Dict[torch.fx.Node, FrozenSet[int]] = {}
    for node in graph.nodes:
        if node.op != "call_function" or node not in live or node in params:
            continue
        ins = [m for m in node.all_input_nodes if m in live]
        if ins and all(m in params for m in ins):
            params.add(node)
            continue
        if any(m in params for m in ins):
            held[node] = frozenset(i for i, a in enumerate(node.args) if isinstance(a, torch.fx.Node) and a in params)
    return held
