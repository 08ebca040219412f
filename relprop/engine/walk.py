"""The reverse walk: relevance from the target back to the input, one graph node at a time.

The nodes are visited in reverse topological order; each node's relevance is complete when it is
reached, its preset's rule splits it among the node's arguments, and relevance given to constants
is booked as absorbed, per sample. The walk records R_A at each attention map and R_h at each
block input, and the relevance entering and leaving each block (:class:`relprop.engine.ledger.Ledger`).
The walker only routes relevance: the forward values and their freeing are the
:class:`relprop.engine.value_store.ValueStore`'s, the sums the ledger's, and a folded run's
per-block work the fold hooks' (:mod:`relprop.engine.fold_hooks`).

An ε-rule (AttnLRP Eq. 8) passes Σ R ⊙ |z| / (|z| + ε) to its operands, not Σ R: the rest is kept by
its stabilizer and booked as absorbed under :data:`STABILIZER`, so that the ledger closes exactly
and a rule that loses relevance otherwise still shows as a conservation error.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Any, Dict, Optional, Union

import torch
import torch.fx

from ..errors import UnsupportedOperation
from ..graph.analysis import INDEX_ROUTING
from ..graph.capture import Captured
from ..graph.complex_values import complex_detail
from ..graph.nodes import module_path, module_type, relevance_path
from ..rules.pa_lrp import is_positional
from ..rules.rule_registry import Preset, get_preset
from ..rules.stabilize import fit_to_shape, promote, relevance_dtype
from .ledger import STABILIZER, Ledger
from .node_rules import rule_finder
from .position_relevance import LABEL as POSITIONS, PositionRelevance
from .row_bounds import joined, operand_bound
from .rule_apply import apply_rule
from .stream_relevance import per_stream, primary_parts
from .trace import Conservation
from .value_store import ValueStore

__all__ = ["STABILIZER", "WalkResult", "Walker", "check_rules", "walk"]


def check_rules(captured: Captured, preset: Union[str, Preset], unsupported: str) -> None:
    """Raise :class:`UnsupportedOperation` for the first op on the relevance path with no rule in
    ``preset`` (the request's :class:`relprop.rules.Preset`; a name, from a direct caller, is resolved
    here) unless ``unsupported="z_rule"``."""
    a = captured.analysis
    preset = get_preset(preset)
    rule_of = rule_finder(captured, preset, unsupported)
    for node in relevance_path(captured.graph, a.live, a.sources, rule_of):
        if node.op == "call_function" and node not in a.sources and node.target is not operator.getitem \
                and rule_of(node) is None:
            raise UnsupportedOperation(node.target, module_path(node), module_type(node), preset.name,
                                       detail=complex_detail(node))


def walk(walker: "Walker", graph: torch.fx.Graph) -> "WalkResult":
    """Visit every node of ``graph`` (the walker's), output to input, and finish the walk."""
    for node in reversed(graph.nodes):
        walker.visit(node)
    return walker.finish()


@dataclasses.dataclass
class WalkResult:
    """What a reverse walk gives (:meth:`Walker.finish`).

    Attributes
    ----------
    relevance_at : R at the kept nodes (each block's attention map and hidden state entering it).
    conservation : the ledger's :class:`relprop.engine.trace.Conservation`.
    input_relevance : the relevance of the explained input (per token for text: summed over the
        embedding), None when none reached it.
    stream_relevance : two-stream models: each token stream's input relevance ({} otherwise).
    """

    relevance_at: Dict[torch.fx.Node, torch.Tensor]
    conservation: Conservation
    input_relevance: Optional[torch.Tensor]
    stream_relevance: Dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)


class Walker:
    """The reverse walk, one node at a time (:meth:`visit` in reverse topological order, then
    :meth:`finish`): it routes relevance from each node to its arguments under the preset's rules.
    The forward values are read from a :class:`relprop.engine.value_store.ValueStore` over ``env``
    (``remat``: the nodes whose discarded value it recomputes), the conservation sums go to a
    :class:`relprop.engine.ledger.Ledger`. ``seed`` holds the relevance at the outputs ``out_nodes``
    (the partial derivatives of the target score, :func:`relprop.engine.forward.output_seed`).
    ``hooks`` (a folded run, :class:`relprop.engine.fold_hooks.BlockFolder`) is told when the walk
    reaches each of its ``nodes`` (:meth:`~relprop.engine.fold_hooks.BlockFolder.reached`, before the
    node's rule runs); the walk then keeps no relevance there and lets the values of its
    ``droppable`` nodes go when it leaves them. ``steps`` (a strategy hooked at some nodes: the
    row-chunked attention cores, :class:`relprop.engine.chunked_walk.ChunkedCores`): at each node of
    ``steps.nodes`` the walk hands the node's complete relevance (:meth:`take`) to ``steps(walker, node,
    relevance)`` instead of applying its rule, and it skips the nodes ``steps.covers``.
    ``weight_memo``: keep a memo of |W| with the captured graph (``memory="high"``).
    """

    def __init__(self, request, env, seed, out_nodes, batch: int, remat=frozenset(), hooks=None, steps=None,
                 weight_memo: bool = False):
        captured = request.captured
        a = captured.analysis
        self.a, self.preset, self.eps, self.batch = a, request.preset, request.eps, batch
        self.rule_of = rule_finder(captured, request.preset, request.unsupported)
        # (no memo of |W| for offloaded weights: it would hold them all, keyed by reused addresses)
        weight_cache = captured.weight_cache if weight_memo and not captured.offloaded else None
        self.options = {"reads_pixels": a.pixel_convs, "weight_cache": weight_cache}
        self.sources = set(a.sources)
        self.bdim = a.batch_dim
        self.placeholders = {n: (kind, tgt) for n, kind, tgt in captured.bindings}
        self.values = ValueStore(captured, env, remat, request.compute)
        self.hooks = hooks
        self.hooked = frozenset(hooks.nodes) if hooks is not None else frozenset()
        if hooks is not None:
            self.values.release_after_walk(hooks.droppable)
        self.keep = ({b.attention for b in a.blocks} | {b.hidden for b in a.blocks if b.hidden is not None}) \
            - self.hooked
        self.rel_at: Dict[torch.fx.Node, torch.Tensor] = {}
        self.R: Dict[torch.fx.Node, Any] = {}
        dev = seed[out_nodes[0]].device if out_nodes else torch.device("cpu")
        # per-sample bookkeeping in the relevance's precision (float64 for a float64 model)
        dtype = relevance_dtype(seed[out_nodes[0]].dtype) if out_nodes else torch.float32
        self.ledger = Ledger(a, batch, dev, dtype)
        for n in out_nodes:
            self.R[n] = promote(seed[n].detach())
        for n in out_nodes:
            self.ledger.inject(n, self.R[n])
        #: at most how many positions of a node's relevance are not zero (relprop.engine.row_bounds)
        self.bounds: Dict[torch.fx.Node, Optional[int]] = {n: request.target.rows for n in out_nodes}
        self.input_parts = []
        self.positions = PositionRelevance(self.placeholders, batch) if is_positional(request.preset) else None
        self.steps = steps

    def held_label(self, arg, consumer) -> str:
        """The ledger's label of a share ``consumer``'s rule holds constant (a selection parameter)."""
        return f"{module_path(consumer) or 'model'}:{arg.name} (held constant)"

    def constant_label(self, arg, consumer) -> str:
        """The ledger's label of a share ``consumer`` gives to constant ``arg``."""
        if isinstance(arg, torch.fx.Node):
            return _constant_label(arg, self.placeholders, consumer)
        return f"{module_path(consumer) or 'model'}:{consumer.name}:const"

    def absorb(self, label, rel, consumer, arg_bdim):
        """Book ``rel``, a share node ``consumer`` does not pass on, in the ledger under ``label``."""
        self.ledger.absorb(label, rel, consumer, arg_bdim, self.values.value(consumer))

    def visit(self, node):
        """Apply the rule of ``node`` to its (complete) relevance and pass the shares to its arguments."""
        a, R = self.a, self.R
        self.values.entering(node)
        steps = self.steps
        if steps is not None:
            if steps.covers(node):  # walked by the step at the core's output
                return
            if node in steps.nodes:
                steps(self, node, self.take(node))
                return
        if node not in R:
            if node in self.hooked:  # no relevance reaches it (e.g. attention held constant): say so
                self.hooks.reached(node, None)
            return
        r = self.take(node)
        bound = self.bounds.pop(node, None)
        if node in self.sources:
            self.input_parts.append((node, r))
            return
        if node.op != "call_function":
            return
        if node.target is operator.getitem:
            src, idx = node.args[0], node.args[1]
            slots = R.setdefault(src, {})
            slots[idx] = slots[idx] + r if idx in slots else r
            return
        value = self.values.value
        out_val = value(node)
        if isinstance(out_val, (list, tuple)):
            r = [r.get(i, torch.zeros(v.shape, dtype=relevance_dtype(v.dtype), device=v.device)) if isinstance(r, dict)
                 else r[i]
                 for i, v in enumerate(out_val)]
        spec = self.rule_of(node)
        if spec is None:
            raise UnsupportedOperation(node.target, module_path(node), module_type(node), self.preset.name,
                                       detail=complex_detail(node))
        # rules compute in float32 at least: half-precision activations are upcast, float64 kept
        applied = apply_rule(spec, node, r, value, a.live, batch=self.batch, batch_dim=self.bdim.get(node),
                             eps=self.eps, preset=self.preset, options=self.options,
                             dead=lambda: self.values.dead_after(node), relevant_rows=bound)
        out_shape = getattr(r, "shape", ())
        del r
        if applied.kept is not None:  # what an ε-rule's stabilizer keeps, or a rule's own label
            self.absorb(applied.kept[0], applied.kept[1], node, None)
        held = spec.constant_positions  # arguments a rule holds constant (selection parameters)
        shares = applied.shares
        for i, arg in enumerate(applied.operands):
            share = shares[i] if i < len(shares) else None
            if share is None:
                continue
            if i in held and torch.is_tensor(share):
                self.absorb(self.held_label(arg, node), promote(share), node, self.bdim.get(arg))
                continue
            if isinstance(arg, (list, tuple)):
                for el, sh in zip(arg, share):
                    if sh is not None:
                        self.deliver(el, sh, node)
            else:
                self.deliver(arg, share, node, (spec, i, bound, out_shape))

    def take(self, node):
        """The complete relevance at ``node`` (None: none reaches it), taken off the walk: kept where the
        Trace records it, handed to the hooks at their nodes, passed through the ledger."""
        if node not in self.R:
            if node in self.hooked:
                self.hooks.reached(node, None)
            return None
        r = self.R.pop(node)
        if node in self.keep:
            self.rel_at[node] = r
        if node in self.hooked:
            self.hooks.reached(node, r)
        self.ledger.passing(node, r)
        return r

    def deliver(self, arg, share, consumer, rows=None):
        """Add ``share`` to the relevance of ``arg`` (a live node), or book it as absorbed by ``consumer``
        (a constant). ``rows``: (the consumer's rule, the operand's position, the bound on the consumer's
        relevance and its shape), from which the bound on ``arg``'s follows (:mod:`relprop.engine.row_bounds`)."""
        if isinstance(arg, torch.fx.Node) and arg in self.a.live:
            val = self.values.value(arg)
            share = fit_to_shape(promote(share), val.shape)
            R = self.R
            bound = operand_bound(consumer, rows[0], rows[1], rows[2], rows[3], val.shape) if rows else None
            if arg in R:
                R[arg] = R[arg] + share
                self.bounds[arg] = joined(self.bounds.get(arg), bound)
            else:
                R[arg] = share
                self.bounds[arg] = bound
            return
        if not torch.is_tensor(share):
            return
        if isinstance(arg, torch.fx.Node) and self.positions is not None \
                and self.positions.take(arg, consumer, share, self.bdim.get(consumer)):
            self.absorb(POSITIONS, promote(share), consumer, self.bdim.get(arg))  # for the blocks' books
            return
        self.absorb(self.constant_label(arg, consumer), promote(share), consumer,
                    self.bdim.get(arg) if isinstance(arg, torch.fx.Node) else None)

    def finish(self) -> WalkResult:
        """The walk's :class:`WalkResult`, once every node was visited."""
        a = self.a
        input_rel = None
        conservation = self.ledger.close(self.input_parts, self.preset.name)
        for node, r in primary_parts(a, self.input_parts):
            if a.modality == "text":
                r = r.sum(-1)
            input_rel = r if input_rel is None else input_rel + r
        if self.positions is not None and input_rel is not None:
            input_rel = self.positions.add_to(input_rel, a.modality, a.grid)
            conservation = reassigned(conservation, self.positions.prefix_share(a.grid))
        return WalkResult(self.rel_at, conservation, input_rel, per_stream(a, self.input_parts))


def reassigned(c, prefix: Optional[torch.Tensor]):
    """Conservation ``c`` with the position relevance (booked under :data:`POSITIONS`) moved from the
    absorbed to the input relevance, except ``prefix`` (per sample: the position shares of the
    class and other prefix tokens of an image model, which stay absorbed)."""
    moved = c.absorbed_by.pop(POSITIONS, None)
    if moved is None:
        return c
    if prefix is not None:
        prefix = prefix.to(moved.dtype)
        c.absorbed_by["position embeddings of the prefix tokens (class, ...)"] = prefix
        moved = moved - prefix
    return dataclasses.replace(c, input=c.input + moved, absorbed=c.absorbed - moved)


def _constant_label(arg, placeholders, consumer) -> str:
    """Name a constant by the parameter/buffer it was derived from (through shape-only ops), e.g.
    'cls_token' for the expanded class token, else by the module that consumed it."""
    n, hops = arg, 0
    while isinstance(n, torch.fx.Node) and hops < 8:
        if n in placeholders:
            return str(placeholders[n][1])
        if n.op != "call_function" or n.target not in INDEX_ROUTING:
            break
        n, hops = n.args[0], hops + 1
    return f"{module_path(consumer) or 'model'}:{arg.name}"
