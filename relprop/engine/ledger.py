"""The conservation ledger of one reverse walk: where the relevance went, per sample.

LRP's conservation (Bach et al. 2015, Eq. 2; AttnLRP Eq. 3) says that the relevance injected at
the outputs equals the relevance reaching the input plus what the rules booked as absorbed
(constants, biases, the ε-rules' stabilizers, held-constant operands). The :class:`Ledger` keeps
those sums per sample while the walk runs: the relevance injected at the outputs, each absorbed
share under its label and per attention block, and the relevance entering and leaving each block;
:meth:`Ledger.close` turns them into a :class:`relprop.engine.trace.Conservation`.
"""
from __future__ import annotations

import operator
from typing import Dict, Optional, Tuple

import torch

from ..graph.nodes import module_paths
from ..rules.stabilize import promote
from .trace import BlockConservation, Conservation

#: the label under which the ε-rules' stabilizer's share is booked in ``Conservation.absorbed_by``
STABILIZER = "eps stabilizer (the ε-rules' denominators z + ε·sign z)"


class Ledger:
    """The per-sample sums of one walk over the graph of ``analysis`` (a
    :class:`relprop.graph.analysis.Analysis`) for ``batch`` samples, in ``dtype`` on ``device``
    (the relevance's precision: float64 for a float64 model)."""

    def __init__(self, analysis, batch: int, device: torch.device, dtype: torch.dtype):
        a = analysis
        self.batch, self.device, self.dtype = batch, device, dtype
        self.bdim = a.batch_dim
        # values whose batch axis interleaves the samples (rows t·B + b), read off the axes' provenance
        self.outer: Dict = getattr(a, "interleaved", {})
        self.blocks = a.blocks
        self.layers = [b.layer for b in a.blocks]
        self.block_out = {b.output: b for b in a.blocks if b.output is not None}
        self.block_hidden: Dict = {}
        for b in a.blocks:
            if b.hidden is not None:
                self.block_hidden.setdefault(b.hidden, []).append(b)
        self.per_block_in: Dict[str, torch.Tensor] = {}
        self.per_block_out: Dict[str, torch.Tensor] = {}
        self.absorbed_by: Dict[str, torch.Tensor] = {}
        self.per_block_absorbed = {b.layer: self.zeros() for b in a.blocks}
        self.injected = self.zeros()

    def zeros(self) -> torch.Tensor:
        """A [batch] zero in the ledger's precision."""
        return torch.zeros(self.batch, device=self.device, dtype=self.dtype)

    def inject(self, node, relevance: torch.Tensor) -> None:
        """Book the relevance seeded at output ``node`` as injected."""
        self.injected = self.injected + sample_sum(relevance, self.bdim.get(node), self.batch, self.outer.get(node, 1))

    def passing(self, node, relevance: torch.Tensor) -> None:
        """The walk reached ``node`` with its complete ``relevance``: book it as entering a block (at
        the block's output) or leaving one (at the hidden state entering it)."""
        outer = self.outer.get(node, 1)
        if node in self.block_out:
            self.per_block_in[self.block_out[node].layer] = sample_sum(relevance, self.bdim.get(node), self.batch,
                                                                       outer)
        if node in self.block_hidden:
            for b in self.block_hidden[node]:
                self.per_block_out[b.layer] = sample_sum(relevance, self.bdim.get(node), self.batch, outer)

    def absorb(self, label: str, rel: torch.Tensor, consumer, arg_bdim: Optional[int], out_val) -> None:
        """Book ``rel``, a share that node ``consumer`` (with forward value ``out_val``) does not pass
        on, as absorbed under ``label``, per sample (its batch axis read off the consumer's output or,
        failing that, off the argument's ``arg_bdim``) and in every block the consumer belongs to."""
        self.book(label, self.share(rel, consumer, arg_bdim, out_val)[0], consumer)

    def share(self, rel: torch.Tensor, consumer, arg_bdim: Optional[int], out_val) -> Tuple[torch.Tensor, bool]:
        """(the per-sample sum [batch] of ``rel`` as :meth:`absorb` books it, whether it is split by
        sample: False for a constant with no per-sample structure, shared equally by the samples)."""
        batch = self.batch
        ob = self.bdim.get(consumer)
        if isinstance(out_val, (list, tuple)) and out_val and torch.is_tensor(out_val[0]):
            # (y, statistics...) of a normalization: shares of constants are shaped like y
            out_val, ob = out_val[0], _element_batch_dim(consumer, self.bdim)
        if torch.is_tensor(out_val) and ob is not None and rel.dim() == out_val.dim() and rel.shape[ob] % batch == 0:
            outer = self.outer.get(consumer, 1) if tuple(rel.shape) == tuple(out_val.shape) else 1
            return sample_sum(rel, ob, batch, outer), True
        if arg_bdim is not None and rel.dim() > arg_bdim and rel.shape[arg_bdim] == batch:
            return sample_sum(rel, arg_bdim, batch), True
        if rel.dim() > 0 and rel.shape[0] == batch:
            return sample_sum(rel, 0, batch), True
        # a constant with no per-sample structure: only possible for batch 1
        return rel.sum().reshape(1).expand(batch) / batch, batch == 1

    def book(self, label: str, s: torch.Tensor, consumer) -> None:
        """Book the per-sample sum ``s`` [batch] of a share absorbed by node ``consumer`` under
        ``label`` and in every block the consumer belongs to."""
        self.absorbed_by[label] = self.absorbed_by.get(label, 0) + s
        paths = module_paths(consumer)
        for layer in self.layers:
            if layer in paths:
                self.per_block_absorbed[layer] = self.per_block_absorbed[layer] + s

    def close(self, input_parts, preset: str) -> Conservation:
        """The :class:`Conservation` of the walk, once ``input_parts`` ((source node, relevance)
        pairs) reached the input under ``preset``."""
        reached = self.zeros()
        for node, r in input_parts:
            reached = reached + sample_sum(r, self.bdim.get(node), self.batch, self.outer.get(node, 1))
        absorbed = sum(self.absorbed_by.values(), self.zeros())
        blocks = [BlockConservation(b.name, self.per_block_in[b.layer],
                                    self.per_block_out.get(b.layer, self.zeros()), self.per_block_absorbed[b.layer])
                  for b in self.blocks if b.layer in self.per_block_in]
        return Conservation(self.injected, reached, absorbed, self.absorbed_by, blocks, preset)


def _element_batch_dim(node, bdim) -> Optional[int]:
    """The batch dimension of element 0 of a node that returns a tuple (read off its ``getitem``)."""
    for user in node.users:
        if user.target is operator.getitem and user.args[1] == 0:
            return bdim.get(user)
    return None


def sample_sum(t: torch.Tensor, d: Optional[int], batch: int, outer: int = 1) -> torch.Tensor:
    """The per-sample sum [batch] of ``t`` whose batch axis is ``d`` (possibly [batch·k] with k groups
    per sample, batch-major, or, with ``outer`` > 1, [outer·batch·k] with the samples interleaved: rows
    (o·batch + b)·k + i, as sequence-major rows flattened); a tensor with no batch axis is shared equally
    by the samples."""
    if d is None:
        if t.dim() > 0 and t.shape[0] == batch:
            d = 0
        else:
            return t.sum().reshape(1).expand(batch) / batch
    t = t.movedim(d, 0)  # [batch, ...] or [batch·k, ...] (k groups per sample, batch-major)
    if outer > 1 and batch > 1 and t.shape[0] % (outer * batch) == 0:
        return promote(t.reshape(outer, batch, -1).sum((0, 2)))
    return promote(t.reshape(batch, -1).sum(1))
