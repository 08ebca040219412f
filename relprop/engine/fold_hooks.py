"""The fold hooks of a folded run: every attention block handed to the methods' folds as soon as
the reverse walk has its A, dA and R_A, and then dropped.

Rollout-style methods read per block one heads-fused token×token map and only the query's row of
the product of the blocks' maps (CVPR 2021, Eq. 13–14). Folded from the output block back, the row
needs one block at a time, so the run need not keep any block's records: it is the segmented run of
``memory="low"`` (:func:`relprop.engine.low_memory.run_low`: a forward pass without autograd, then
block by block from the output, the block recomputed with autograd, its gradients, its part of the
relevance walk) with, after each segment, the block's record passed to every fold of
``Request.folds`` and its attention-sized values (A, dA, R_A) and the block's own V and features
freed. The peak then holds the hidden states between blocks and one block, whatever the number of
blocks; the records grow with blocks × heads × tokens² otherwise.
"""
from __future__ import annotations

import types
from typing import List

import torch

from ..errors import RelpropError
from ..graph.attention_core import pad_keys
from .chunked_core import chunk_plan
from .chunked_walk import chunk_values
from .memory import crossing, segments
from .records import block_record, record, unfolder

#: why a folded run was refused by the engine (the api does not ask for one there)
FOLD_WINDOWS = ("a folded run folds one token sequence per block; this model's attention works on windows (Swin) "
                "or connects two token streams: explain it with keep_blocks=True (the full-record path)")


def foldable(analysis) -> bool:
    """Whether a folded (block-by-block, records-dropping) run applies to a graph with this ``analysis``:
    one token sequence per block, i.e. no window attention and one token stream (else
    :data:`FOLD_WINDOWS` says why not)."""
    return not analysis.windows and len(analysis.streams) <= 1


class BlockFolder:
    """Hands every attention block of a segmented run (:func:`relprop.engine.low_memory.run_low`) to
    the folds of ``request.folds``, from the output block back, and frees the block's records (with
    no fold, a schedule with ``records="dropped"``: frees them only).

    With the relevance walk (whose hooks it is: :class:`relprop.engine.walk.Walker` calls
    :meth:`reached` at each of :attr:`nodes` and frees the values of :attr:`droppable` when it
    leaves them), a block is handed over when the walk reaches its attention map (R_A is
    then complete; dA came from the segment's backward pass), before the map's own rule runs: dA is
    freed at once, R_A when the rule has passed it on, A when the walk leaves the node (the walk no
    longer keeps A, V and the features for after the walk). Without it (gradient-only methods) the
    blocks of a segment are handed over after the segment's backward pass. ``token_count`` is the
    first block's number of tokens once it has been seen."""

    def __init__(self, request):
        captured = request.captured
        a = captured.analysis
        self.folds, self.analysis = request.folds, a
        self.block_of = {b.attention: b for b in a.blocks}
        kept = crossing(captured) | set(a.sources) | {a.primary}
        self.droppable = {n for b in a.blocks for n in (b.attention, b.value, b.features)
                          if n is not None and n not in kept}
        #: the nodes at which the walk calls :meth:`reached` (the attention maps)
        self.nodes = frozenset(self.block_of)
        self.first = segments(captured)[0]
        self.seen: List[int] = []
        self.token_count = None
        self.walked = False

    def attach(self, env, grad, batch: int, walked: bool, cores=None, compute=None) -> None:
        """Called by the run once its forward values ``env`` and gradients ``grad`` exist; ``walked``:
        a relevance walk runs (a :class:`relprop.engine.walk.Walker` given this folder as its hooks);
        ``cores``: the row-chunked cores (:class:`relprop.engine.chunked_walk.ChunkedCores`), whose
        blocks arrive by :meth:`reached_rows`."""
        self.env, self.grad, self.batch, self.walked = env, grad, batch, walked
        self.cores, self.rows = (cores.cores, cores.chunks) if cores is not None else ({}, None)
        self.compute = compute
        self.chunked_blocks = {b.index: p for p, (_, b) in self.cores.items()}
        self.pending = None
        self.handed: set = set()  # the blocks the backward passes handed over (rows_hook)

    def reached_rows(self, b, lo: int, hi: int, queries: int, attention, gradient, relevance, keys: int) -> None:
        """The row-chunked walk reached rows ``lo:hi`` of block ``b``'s attention map (of ``queries``
        rows and ``keys`` keys) with their A, dA and R_A (None: no relevance reaches it), on the
        chunk's first keys (the others are 0: :func:`relprop.engine.chunked_core.chunk_plan`): hand
        them to the folds that take chunks (``fold.start_rows``, which take them so); gather them
        whole, with their zeros, for the others (:meth:`rows_done`)."""
        if not self.folds:  # (a run that keeps no records: nothing to hand over)
            if lo == 0:
                self.pending = ([], [], [], keys)
            return
        unfold = unfolder(b.folded_heads, self.batch)
        part = types.SimpleNamespace(attention=unfold(record(attention)), gradient=unfold(record(gradient)),
                                     relevance=unfold(record(relevance)))
        if lo == 0:
            shape = part.attention.shape[:-2] + (queries, keys)
            meta = types.SimpleNamespace(index=b.index, name=b.name, layer=b.layer, device=part.attention.device,
                                         attention=torch.empty(shape, device="meta"))
            chunked = [f for f in self.folds if getattr(f, "start_rows", None) is not None and f.start_rows(meta)]
            self.pending = (chunked, [f for f in self.folds if f not in chunked], [], keys)
        chunked, whole, parts, _ = self.pending
        for fold in chunked:
            fold.fold_rows(part, lo)
        if whole:
            parts.append(tuple(pad_keys(t, keys) for t in (attention, gradient, relevance)))

    def rows_done(self, b) -> None:
        """Every chunk of block ``b`` was handed over (:meth:`reached_rows`): close the chunked folds,
        call the others with the whole record."""
        chunked, whole, parts, keys = self.pending
        self.pending = None
        for fold in chunked:
            fold.end_rows()
        if whole:
            cat = [None if any(p[i] is None for p in parts) else torch.cat([p[i] for p in parts], -2)
                   for i in range(3)]
            del parts[:]
            self.env[b.attention], self.grad[b.attention] = cat[0], cat[1]
            rec = block_record(b, self.env, self.grad, {b.attention: cat[2]}, self.batch, partial=True)
            del cat
            for fold in whole:
                fold(rec)
            del rec
            self.env.pop(b.attention, None)
        if b.index == 0:
            self.token_count = keys
        self.seen.append(b.index)
        self.grad.pop(b.attention, None)
        if b.features is not None and b.features in self.droppable:
            self.grad.pop(b.features, None)

    def rows_hook(self, b):
        """Gradient-only methods: the function the segment's backward pass calls with each chunk of
        block ``b`` (``fn(lo, hi, queries, A, dA)``, :func:`relprop.engine.chunked_core.core_in_row_chunks`),
        which hands the chunks to the folds as that backward computes them; :meth:`after_segment`
        then has nothing left to compute for the block (else, when no gradient reached the core,
        it recomputes the chunks, :meth:`_rows_without_walk`)."""
        def hand(lo, hi, queries, attention, gradient, keys):
            self.reached_rows(b, lo, hi, queries, attention, gradient, None, keys)
            if hi == queries:
                self.rows_done(b)
                self.handed.add(b.index)
        return hand

    def _rows_without_walk(self, b) -> None:
        """Gradient-only methods: hand block ``b``'s chunks over after the segment's backward pass."""
        product = self.chunked_blocks[b.index]
        core = self.cores[product][0]
        dout = self.grad.pop(product, None)
        queries = self.env[core.rows[0]].shape[-2]
        for lo, hi, keys in chunk_plan(core, self.env.__getitem__, queries, self.rows):
            vals, grad = chunk_values(core, b.attention, self.env.__getitem__, lo, hi, self.compute, dout, keys)
            self.reached_rows(b, lo, hi, queries, vals[b.attention], grad, None, keys[1])
            del vals, grad
        self.rows_done(b)

    def reached(self, node, relevance) -> None:
        """The walk reached attention map ``node`` with its complete ``relevance`` (None: none
        reaches it): hand its block to the folds."""
        self._hand_over(self.block_of[node], {node: relevance})

    def _hand_over(self, b, rel_at) -> None:
        if self.folds:
            rec = block_record(b, self.env, self.grad, rel_at, self.batch, partial=True)
            if b.index == 0:
                self.token_count = rec.attention.shape[-1]
            for fold in self.folds:
                fold(rec)
            del rec
        elif b.index == 0:
            self.token_count = self.env[b.attention].shape[-1]
        self.seen.append(b.index)
        self.grad.pop(b.attention, None)
        if b.features is not None and b.features in self.droppable:
            self.grad.pop(b.features, None)

    def after_segment(self, seg) -> set:
        """After a segment's walk: hand over its blocks if the walk did not, free their values;
        returns the nodes whose values and gradients were freed."""
        inside = set(seg)
        blocks = sorted((b for b in self.analysis.blocks if b.attention in inside), key=lambda b: -b.index)
        if not self.walked:
            for b in blocks:
                if b.index in self.handed:  # by the backward pass (rows_hook)
                    self.grad.pop(self.chunked_blocks[b.index], None)
                elif b.index in self.chunked_blocks:
                    self._rows_without_walk(b)
                else:
                    self._hand_over(b, {})
        dropped = set()
        for b in blocks:
            for n in (b.attention, b.value, b.features):
                if n in self.droppable and n in inside:
                    self.env.pop(n, None)
                    self.grad.pop(n, None)
                    dropped.add(n)
        if seg is self.first:
            missing = [b.index for b in self.analysis.blocks if b.index not in self.seen]
            if missing:
                raise RelpropError(f"a folded run did not reach blocks {missing} (a bug of relprop's segments: "
                                   "please report it; keep_blocks=True explains without folding)")
        return dropped
