"""The forward values a reverse walk reads, and when it frees them.

The walk visits the nodes output first; it reads a node's value at that node and at its consumers,
all visited before it, so once the walk has left a node its value is dead unless something reads
it after the walk (the block records, :func:`relprop.engine.memory.read_after_walk`). A value the
forward pass discarded because it is cheap to recompute (:func:`relprop.engine.memory.rematerializable`)
is computed again, without autograd, when a rule reads it. The :class:`ValueStore` holds the
values, recomputes, frees, and says whether a rule may compute into a node's output buffer.
"""
from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterable

import torch
import torch.fx

from ..errors import RelpropError
from ..graph.aliasing import KeptStorages, shares_memory, storage_of
from ..graph.nodes import evaluate, output_leaves
from ..rules.stabilize import promote
from .memory import read_after_walk


class ValueStore:
    """The forward values ``env`` of a captured graph during its reverse walk (freed in place as the
    walk leaves each node). ``remat``: the nodes whose discarded value may be recomputed;
    ``compute``: the precision the ops are evaluated in (:attr:`relprop.engine.request.Request.compute`)."""

    def __init__(self, captured, env: Dict[torch.fx.Node, Any], remat=frozenset(), compute=None):
        self.env, self.remat, self.compute = env, remat, compute
        #: values freed only after the walk (the block records read them)
        self.needed_later = read_after_walk(captured.analysis)
        #: values a rule must never overwrite: those read after the walk and the program's outputs
        #: (the explanation returns them)
        outputs = {n for n in output_leaves(captured.graph) if isinstance(n, torch.fx.Node)}
        self.untouchable = self.needed_later | outputs
        self.previous = None
        self.kept_storages = None  # (dead_after: the storages of the untouchable values, once)
        #: no rule may compute into a value's buffer (values autograd may still read: a segment
        #: walked before its backward pass is done, :mod:`relprop.engine.fused_segment`)
        self.frozen = False

    @contextlib.contextmanager
    def no_overwrites(self):
        """Within this context no rule computes into a value's buffer (:meth:`dead_after` is False):
        autograd may still read the values (:mod:`relprop.engine.fused_segment`)."""
        before, self.frozen = self.frozen, True
        try:
            yield
        finally:
            self.frozen = before

    def release_after_walk(self, nodes: Iterable[torch.fx.Node]) -> None:
        """Free the values of ``nodes`` when the walk leaves them, although the block records read
        them (a folded run hands each block over before that, :mod:`relprop.engine.fold_hooks`);
        a rule still never overwrites them."""
        self.needed_later = self.needed_later - set(nodes)

    def value(self, n):
        """The forward value of node ``n`` (recomputed, without autograd, if it was discarded).

        A recomputed value stays in ``env`` until the walk passes ``n``; so do the discarded
        values it was computed from (each is read again at its own node, which the walk reaches
        before leaving the attention block: the scores and the masked scores are computed once per
        walk; the values are the same bit for bit)."""
        env = self.env
        if n in env:
            return env[n]
        if n not in self.remat:
            raise RelpropError(f"the value of node {n.name} was freed before the reverse walk read it "
                               "(a bug of relprop's memory plan: please report it)")
        with torch.no_grad():
            v = evaluate(n, self.value, compute=self.compute)
        env[n] = v  # freed when the walk passes n
        return v

    def entering(self, node) -> None:
        """The walk enters ``node``: the node it left before is dead (last-use freeing), its value is
        freed unless it is read after the walk."""
        if self.previous is not None and self.previous not in self.needed_later:
            self.env.pop(self.previous, None)
        self.previous = node

    def dead_after(self, node) -> bool:
        """Whether the value of ``node`` is dead once its rule has run (``RuleContext.out_writable``):
        a floating tensor in the relevance precision that autograd does not record, neither read
        after the walk nor returned by the program, sharing its memory with none of its arguments
        and none of those values. Its users were visited before it and their values freed (a user
        read after the walk or returned is among the values compared)."""
        v = self.env.get(node)
        if self.frozen:
            return False
        if not (torch.is_tensor(v) and v.is_floating_point() and not v.requires_grad and promote(v) is v):
            return False
        if node in self.untouchable:
            return False
        if self.kept_storages is None:  # (the storages of the values no rule may overwrite, gathered once)
            self.kept_storages = KeptStorages(self.env.get(m) for m in self.untouchable)
        ptr = storage_of(v)
        if ptr is None or self.kept_storages.holds_address(ptr):
            return False
        return not shares_memory(v, *(self.env.get(m) for m in node.all_input_nodes))
