"""The reverse walk: relevance from the target back to the input, one graph node at a time.

The nodes are visited in reverse topological order; each node's relevance is complete when it is
reached, its preset's rule splits it among the node's arguments, and relevance given to constants
is booked as absorbed, per sample. The walk records R_A at each attention map and R_h at each
block input, and the relevance entering and leaving each block (:class:`Conservation`).

An ε-rule (AttnLRP Eq. 8) passes Σ R ⊙ |z| / (|z| + ε) to its operands, not Σ R: the rest is kept by
its stabilizer and booked as absorbed under :data:`STABILIZER`, so that the ledger closes exactly
and a rule that loses relevance otherwise still shows as a conservation error.
"""
from __future__ import annotations

import operator
from typing import Any, Dict, Optional, Union

import torch
import torch.fx
import torch.utils._pytree as pytree

from ..errors import RelpropError, UnsupportedOperation
from ..graph.analysis import INDEX_ROUTING
from ..graph.aliasing import shares_memory
from ..graph.capture import Captured
from ..graph.nodes import (evaluate, is_live, module_path, module_paths, module_type, output_leaves,
                          relevance_path)
from ..rules.context import RuleContext
from ..rules.gradient_forms import stabilizer_ledger
from ..rules.registry import Preset, get_preset
from ..rules.stabilize import promote, relevance_dtype
from .memory import read_after_walk
from .node_rules import rule_finder
from .streams import per_stream, primary_parts
from .trace import BlockConservation, Conservation

#: the label under which the ε-rules' stabilizer's share is booked in ``Conservation.absorbed_by``
STABILIZER = "eps stabilizer (the ε-rules' denominators z + ε·sign z)"


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
            raise UnsupportedOperation(node.target, module_path(node), module_type(node), preset.name)


def walk(walker: "Walker") -> tuple:
    """Visit every node of the walker's graph, output to input; (R at kept nodes, Conservation,
    input relevance)."""
    for node in reversed(walker.captured.graph.nodes):
        walker.visit(node)
    return walker.finish()


def _fit(rel: torch.Tensor, shape) -> torch.Tensor:
    """Reduce a relevance tensor computed in a broadcast shape onto the operand's shape."""
    if tuple(rel.shape) == tuple(shape):
        return rel
    while rel.dim() > len(shape):
        rel = rel.sum(0)
    return rel.sum_to_size(shape)


class Walker:
    """The reverse walk, one node at a time (:meth:`visit` in reverse topological order, then
    :meth:`finish`). ``env`` holds the forward values; the value of a node in ``remat`` that is
    missing from it is recomputed from its arguments when a rule reads it
    (:func:`relprop.engine.memory.rematerializable`). ``seed`` holds the relevance at the outputs
    ``out_nodes`` (the partial derivatives of the target score, :func:`relprop.engine.forward.output_seed`).
    """

    def __init__(self, request, env, seed, out_nodes, batch: int, remat=frozenset()):
        captured = request.captured
        a = captured.analysis
        self.captured, self.a, self.env, self.preset, self.eps = captured, a, env, request.preset, request.eps
        self.rule_of = rule_finder(captured, request.preset, request.unsupported)
        self.compute = request.compute
        self.unsupported, self.batch, self.remat = request.unsupported, batch, remat
        # (no memo of |W| for offloaded weights: it would hold them all, keyed by reused addresses)
        weight_cache = captured.weight_cache if request.memory == "high" and not captured.offloaded else None
        self.sources = set(a.sources)
        self.bdim = a.batch_dim
        self.placeholders = {n: (kind, tgt) for n, kind, tgt in captured.bindings}
        self.keep = {b.attention for b in a.blocks} | {b.hidden for b in a.blocks if b.hidden is not None}
        self.block_out = {b.output: b for b in a.blocks if b.output is not None}
        self.block_hidden = {}
        for b in a.blocks:
            if b.hidden is not None:
                self.block_hidden.setdefault(b.hidden, []).append(b)
        self.layers = [b.layer for b in a.blocks]
        self.per_block_in = {}
        self.per_block_out = {}
        self.absorbed_by: Dict[str, torch.Tensor] = {}
        self.rel_at: Dict[torch.fx.Node, torch.Tensor] = {}
        self.options = {"reads_pixels": a.pixel_convs,
                        "weight_cache": weight_cache}
        self.R: Dict[torch.fx.Node, Any] = {}
        self.dev = seed[out_nodes[0]].device if out_nodes else torch.device("cpu")
        # per-sample bookkeeping in the relevance's precision (float64 for a float64 model)
        self.dtype = relevance_dtype(seed[out_nodes[0]].dtype) if out_nodes else torch.float32
        self.per_block_absorbed = {b.layer: self._zeros() for b in a.blocks}
        for n in out_nodes:
            self.R[n] = promote(seed[n].detach())
        self.injected = self._zeros()
        for n in out_nodes:
            self.injected = self.injected + _sample_sum(self.R[n], self.bdim.get(n), batch)
        self.input_parts = []
        self.needed_later = read_after_walk(a)
        #: values a rule must never overwrite: those read after the walk and the program's outputs
        #: (the explanation returns them)
        outputs = {n for n in output_leaves(captured.graph) if isinstance(n, torch.fx.Node)}
        self.untouchable = self.needed_later | outputs
        self.done = None
        #: node -> callback(node, relevance), called when the walk reaches the node (its relevance
        #: is complete, None when none reaches it) and before its rule runs (a streamed run,
        #: :mod:`relprop.engine.streaming`)
        self.reached: Dict[torch.fx.Node, Any] = {}

    def _zeros(self) -> torch.Tensor:
        return torch.zeros(self.batch, device=self.dev, dtype=self.dtype)

    def value(self, n):
        """The forward value of node ``n`` (recomputed, without autograd, if it was discarded).

        A recomputed value stays in ``env`` until the walk passes ``n``; so do the discarded
        values it was computed from (each is read again at its own node, which the walk reaches
        before leaving the attention block: the scores and the masked scores are computed once per
        walk; the values are the same bit for bit)."""
        env = self.env
        if n in env:
            return env[n]
        self._check_remat(n)
        with torch.no_grad():
            v = evaluate(n, self.value, compute=self.compute)
        env[n] = v  # freed when the walk passes n
        return v

    def _check_remat(self, n) -> None:
        if n not in self.remat:
            raise RelpropError(f"the value of node {n.name} was freed before the reverse walk read it "
                               "(a bug of relprop's memory plan: please report it)")

    def absorb(self, label, rel, consumer, arg_bdim):
        batch = self.batch
        out_val = self.env[consumer]
        ob = self.bdim.get(consumer)
        if isinstance(out_val, (list, tuple)) and out_val and torch.is_tensor(out_val[0]):
            # (y, statistics...) of a normalization: shares of constants are shaped like y
            out_val, ob = out_val[0], _element_batch_dim(consumer, self.bdim)
        if torch.is_tensor(out_val) and ob is not None and rel.dim() == out_val.dim() and rel.shape[ob] % batch == 0:
            s = _sample_sum(rel, ob, batch)
        elif arg_bdim is not None and rel.dim() > arg_bdim and rel.shape[arg_bdim] == batch:
            s = _sample_sum(rel, arg_bdim, batch)
        elif rel.dim() > 0 and rel.shape[0] == batch:
            s = _sample_sum(rel, 0, batch)
        else:  # a constant with no per-sample structure: only possible for batch 1
            s = rel.sum().reshape(1).expand(batch) / batch
        self.absorbed_by[label] = self.absorbed_by.get(label, 0) + s
        paths = module_paths(consumer)
        for layer in self.layers:
            if layer in paths:
                self.per_block_absorbed[layer] = self.per_block_absorbed[layer] + s

    def visit(self, node):
        a, env, R, batch, bdim = self.a, self.env, self.R, self.batch, self.bdim
        # last-use freeing: the walk reads a node's value only at that node and at its consumers,
        # all visited before it, so a visited node's value is dead (unless read after the walk)
        if self.done is not None and self.done not in self.needed_later:
            env.pop(self.done, None)
        self.done = node
        if node not in R:
            if node in self.reached:  # no relevance reaches it (e.g. attention held constant): say so
                self.reached[node](node, None)
            return
        r = R.pop(node)
        if node in self.keep:
            self.rel_at[node] = r
        if node in self.reached:
            self.reached[node](node, r)
        if node in self.block_out:
            self.per_block_in[self.block_out[node].layer] = _sample_sum(r, bdim.get(node), batch)
        if node in self.block_hidden:
            for b in self.block_hidden[node]:
                self.per_block_out[b.layer] = _sample_sum(r, bdim.get(node), batch)
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
        out_val = self.value(node)
        if isinstance(out_val, (list, tuple)):
            r = [r.get(i, torch.zeros(v.shape, dtype=relevance_dtype(v.dtype), device=v.device)) if isinstance(r, dict)
                 else r[i]
                 for i, v in enumerate(out_val)]
        preset = self.preset
        spec = self.rule_of(node)
        if spec is None:
            raise UnsupportedOperation(node.target, module_path(node), module_type(node), preset.name)
        # rules compute in float32 at least: half-precision activations are upcast, float64 kept
        value = self.value
        # a rule explaining a subgraph as a whole names its operands (an element-wise function: its input)
        operands = spec.operands
        arg_nodes, kw_nodes = (node.args, node.kwargs) if operands is None else (operands, {})
        args, kw = torch.fx.node.map_arg((arg_nodes, kw_nodes),
                                         lambda n: promote(value(n)) if n in a.live else value(n))
        live = tuple(is_live(x, a.live) for x in arg_nodes)
        lost = stabilizer_ledger(spec.gradient_form)
        ctx = RuleContext(node=node, args=tuple(args), kwargs=kw, out=pytree.tree_map(promote, out_val), live=live,
                          batch_dim=bdim.get(node), batch_size=batch, eps=self.eps, preset=preset,
                          options=self.options,
                          out_writable=lost is None and spec.writes_out and self._dead_after(node))
        shares = spec.fn(ctx, r)
        if lost is not None and shares is not None:  # an ε-rule: book what its stabilizer keeps
            kept = lost(node, ctx.args, ctx.out, r, self.eps)
            if isinstance(kept, tuple):  # (label, share): what a rule does not pass on, under its own label
                self.absorb(kept[0], kept[1], node, None)
            elif kept is not None:
                self.absorb(STABILIZER, kept, node, None)
        del ctx, args, kw, r
        if shares is None:
            raise UnsupportedOperation(node.target, module_path(node), module_type(node), preset.name,
                                       detail="Its rule does not apply to these operands.")
        held = spec.constant_positions  # arguments a rule holds constant (selection parameters)
        for i, arg in enumerate(arg_nodes):
            share = shares[i] if i < len(shares) else None
            if share is None:
                continue
            if i in held and torch.is_tensor(share):
                self.absorb(f"{module_path(node) or 'model'}:{arg.name} (held constant)", promote(share), node,
                            self.bdim.get(arg))
                continue
            if isinstance(arg, (list, tuple)):
                for el, sh in zip(arg, share):
                    if sh is not None:
                        self.deliver(el, sh, node)
            else:
                self.deliver(arg, share, node)

    def _dead_after(self, node) -> bool:
        """Whether the value of ``node`` is dead once its rule has run (``RuleContext.out_writable``):
        a floating tensor in the relevance precision that autograd does not record, neither read
        after the walk nor returned by the program, sharing its memory with none of its arguments
        and none of those values. Its users were visited before it and their values freed (a user
        read after the walk or returned is among the values compared)."""
        v = self.env.get(node)
        if not (torch.is_tensor(v) and v.is_floating_point() and not v.requires_grad and promote(v) is v):
            return False
        if node in self.untouchable:
            return False
        return not shares_memory(v, *(self.env.get(m) for m in (*node.all_input_nodes, *self.untouchable)))

    def deliver(self, arg, share, consumer):
        if isinstance(arg, torch.fx.Node) and arg in self.a.live:
            val = self.value(arg)
            share = _fit(promote(share), val.shape)
            R = self.R
            R[arg] = R[arg] + share if arg in R else share
            return
        if not torch.is_tensor(share):
            return
        if isinstance(arg, torch.fx.Node):
            label = _constant_label(arg, self.placeholders, consumer)
            self.absorb(label, promote(share), consumer, self.bdim.get(arg))
        else:
            self.absorb(f"{module_path(consumer) or 'model'}:{consumer.name}:const", promote(share), consumer,
                        None)

    def finish(self):
        a, batch = self.a, self.batch
        input_rel = None
        reached = self._zeros()
        for node, r in self.input_parts:
            reached = reached + _sample_sum(r, self.bdim.get(node), batch)
        self.stream_relevance = per_stream(a, self.input_parts)
        for node, r in primary_parts(a, self.input_parts):
            if a.modality == "text":
                r = r.sum(-1)
            input_rel = r if input_rel is None else input_rel + r
        absorbed = sum(self.absorbed_by.values(), self._zeros())
        blocks = []
        for b in a.blocks:
            if b.layer in self.per_block_in:
                blocks.append(BlockConservation(b.name, self.per_block_in[b.layer],
                                                self.per_block_out.get(b.layer, self._zeros()),
                                                self.per_block_absorbed[b.layer]))
        cons = Conservation(self.injected, reached, absorbed, self.absorbed_by, blocks, self.preset.name)
        return self.rel_at, cons, input_rel


def _element_batch_dim(node, bdim) -> Optional[int]:
    """The batch dimension of element 0 of a node that returns a tuple (read off its ``getitem``)."""
    for user in node.users:
        if user.target is operator.getitem and user.args[1] == 0:
            return bdim.get(user)
    return None


def _sample_sum(t: torch.Tensor, d: Optional[int], batch: int) -> torch.Tensor:
    if d is None:
        if t.dim() > 0 and t.shape[0] == batch:
            d = 0
        else:
            return t.sum().reshape(1).expand(batch) / batch
    t = t.movedim(d, 0)  # [batch, ...] or [batch·k, ...] (k groups per sample, batch-major)
    return promote(t.reshape(batch, -1).sum(1))


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
