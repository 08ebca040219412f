"""Rollout-style methods folded block by block during the reverse walk (memory flat in the number of
tokens).

Transformer Attribution (Chefer, Gur & Wolf, CVPR 2021, Eq. 13–14), attention rollout (Eq. 15–16)
and the gradient rollout (ICCV 2021, Eq. 5–6) build per block b one fused map Ā_b = I + M_b
(M_b = E_h[(∇A_b ⊙ R_A,b)⁺] for Eq. 13; each I + M_b divided by its row sums with
``normalize_rows``), multiply them output side first, C = Ā_{e-1} · … · Ā_s (Eq. 14, blocks counted
from the input here), and read the query's row of C: scores = q · C for the query weights q
(:mod:`relprop.methods.query`). By associativity

    q · C = ((q · Ā_{e-1}) · Ā_{e-2}) · … · Ā_s,

so a row r ← r · Ā_b, started at q and updated from the output block back, needs one block at a
time: the engine hands each block's record to a :class:`RowFold` as soon as the reverse walk has
its A, ∇A and R_A, and frees the record (:mod:`relprop.engine.fold_hooks`). A method is folded
this way when it declares its per-head maps with ``@method(..., folds=head_maps)``
(:attr:`relprop.methods.method_registry.MethodInfo.folds`) and its options allow it
(:func:`why_not`). The peak holds one block instead of blocks × heads × tokens² records, and the
products are of a [k, tokens] row with a [tokens, tokens] map (k ≤ 2) instead of [tokens, tokens]².

The query q is read off the block next to the output (the rows its gradient reaches), which the
fold meets first. Whether the model is causal (a decoder's query is its last position, an encoder's
the mean of the rows read) is known only once every block has been seen, so when the two readings
differ both rows are folded and the right one is kept at the end. The results equal those of the
full-matrix path (``keep_blocks=True``, :func:`relprop.methods.aggregation.aggregate`) to float
rounding (the products are associated differently); ``tests/test_folding.py`` checks it.
"""
from __future__ import annotations

import dataclasses
import inspect
import types
from typing import Any, Dict, Optional

import torch

from ..engine.trace import NotKept
from ..errors import MethodError
from ..graph.aliasing import shares_memory
from ..graph.host_reads import deferring
from ..graph.attention_core import pad_keys
from .aggregation import Aggregation, block_range, fuse_heads, per_head_maps
from .apply import no_relevance
from .query import causal_block, row_zero_only, support_of, weighted_rows, weights_of
from .first_block_rows import FirstBlockRows, causal_rows
from .identity import flat_cause, fold_step, merge_rows, with_identity
from .rollout_utils import check_mixing, check_neighbours, check_square

#: a block's map is built and multiplied into the row in chunks of query rows whose per-head maps
#: take at most this many bytes by default (below glibc's mmap threshold, so the heap reuses them;
#: ``explain(..., tuning=Tuning(fold_chunk_bytes=...))``)
FOLD_CHUNK_BYTES = 16 << 20

#: the aggregation of Eq. 13–14 (every block, E_h of the positive part, nothing discarded, rollout, rows
#: not normalized), for the options a folded method does not take (``ta_without_gradient`` has no
#: ``head_fusion``, ``positive``, …: its maps are aggregated so)
EQ13 = {"head_fusion": "mean", "positive": True, "discard_ratio": 0.0, "start_block": 0, "end_block": None,
        "layers": "rollout", "last_k": 1, "normalize_rows": False}


def settings(info, options: Dict[str, Any]) -> Dict[str, Any]:
    """Every option of method ``info`` with its value: ``options`` over the method's defaults."""
    params = inspect.signature(info.fn).parameters
    return {k: options.get(k, p.default) for k, p in params.items() if k != "trace"}


def why_not(info, options: Dict[str, Any], analysis) -> Optional[str]:
    """None when method ``info`` with ``options`` can be folded block by block on a model with this
    graph ``analysis``, else why not, in words."""
    if info.folds is None:
        return f"method '{info.name}' is not a rollout of per-block maps"
    s = settings(info, options)
    if s.get("layers", "rollout") != "rollout":
        return f"layers={s['layers']!r} reads the maps of several blocks at once (only layers='rollout' folds)"
    if s.get("discard_ratio", 0.0) > 0:
        return "discard_ratio > 0 ranks every entry of each block's map against the query of the last block"
    if s.get("normalize_self", True) is not True:
        return "normalize_self=False is the two-stream ablation (the full path checks it)"
    if s.get("identity", "keep") == "exclude_self":
        return "identity='exclude_self' reads the diagonal of the whole aggregated matrix C"
    if not analysis.blocks:
        return "the model has no attention blocks"
    if analysis.windows:
        return "the model's attention works on windows whose token count changes between stages (Swin)"
    if len(analysis.streams) > 1:
        return "the model has two token streams (the bi-modal rules read every block of both)"
    if analysis.unmapped:
        return "the blocks' attention cannot be read as token-to-token maps"
    return None


class RowFold:
    """The query row of a rollout-style method, folded from the output block back.

    Called with every block's :class:`relprop.engine.trace.BlockRecord` from the output back
    (``fold(record)``); :meth:`result` then gives the method's output (``tokens``, ``query``,
    ``heads``, and ``matrix`` as a :class:`relprop.engine.trace.NotKept`). Options and checks are
    those of the method (:func:`relprop.methods.aggregation.aggregate`); the block range is checked
    when the fold is made, before any work.
    """

    def __init__(self, info, options: Dict[str, Any], n_blocks: int, attention_mask: Optional[torch.Tensor],
                 preset: Optional[str], token_mixing: Optional[str] = None, chunk_bytes: int = FOLD_CHUNK_BYTES):
        s = settings(info, options)
        self.chunk_bytes = chunk_bytes
        self.name, self.preset, self.needs_relevance = info.name, preset, info.needs_relevance
        self.head_maps = info.folds
        self.agg = Aggregation(*(s.get(k, EQ13[k]) for k in ("head_fusion", "positive", "discard_ratio", "start_block",
                                                             "end_block", "layers", "last_k", "normalize_rows")),
                               identity=s.get("identity", "keep"))
        if self.agg.identity not in ("exclude", "keep"):
            raise MethodError(f"{info.name}: identity={self.agg.identity!r} is not folded block by block; explain with "
                              "keep_blocks=True")
        self.query = s["query"]
        if self.query not in ("cls", "mean"):
            raise MethodError(f"query={self.query!r} is not a choice. Choices: ['cls', 'mean']")
        self.range = block_range(n_blocks, self.agg.start_block, self.agg.end_block, info.name)
        self.mask, self.mixing, self.n_blocks = attention_mask, token_mixing, n_blocks
        self.row = None  # [batch, k, N]: the folded rows of the k query candidates
        self.excluded = None  # [batch, k, N]: their parts off the identity path (identity="exclude")
        self.path = None  # [batch, k, N]: their parts on it
        self.weights = None  # [batch, k, N]: the candidates' query weights
        self.real = None  # [batch, N] bool: the real (non-padding) tokens
        self.causal = True
        self.heads = None
        self.prev = None  # (index, name, tokens) of the block folded last
        self.seen, self.tokens0, self.used_mask = 0, None, False
        self.first = self.rows_state = None  # the row-chunked walk's block in progress

    def _real(self, n: int, device) -> torch.Tensor:
        """[batch, n] bool: the real tokens, as ``Trace.token_mask`` gives them (the attention mask
        when it has one entry per token, else every token)."""
        m = self.mask
        if torch.is_tensor(m) and m.dim() == 2 and m.shape[1] == n:
            self.used_mask = True
            return m.to(device) != 0
        self.used_mask = False
        return torch.ones(self.batch, n, dtype=torch.bool, device=device)

    def _start(self, rec) -> None:
        """At the block next to the output: the real tokens and the query candidates."""
        a = rec.attention
        self.batch, n, device = a.shape[0], a.shape[-2], a.device
        self.real = self._real(n, device)
        self.first_tokens = n
        if self.query == "mean":
            self.causal = False
            self.weights = self.real[:, None, :].float()
            return
        read = support_of(rec.gradient).to(device)
        self._candidates(read, n, device)

    def _candidates(self, read: torch.Tensor, n: int, device) -> None:
        """The query candidates [non-causal reading, causal reading] of the rows the gradient of the block
        next to the output reaches (one reading where there is one row); the blocks decide, on the device,
        which one holds (``causal``, a 0-d bool tensor: nothing is read on the host)."""
        self.causal = torch.full((), n >= 2, dtype=torch.bool, device=device)
        # (row 0 alone, the class token's row either way: one reading; decided on the host where the call
        # reads values as needed, relprop.graph.host_reads)
        if n < 2 or not deferring() and bool(row_zero_only(read)):
            self.weights = weights_of(read, self.real, False)[:, None, :]
        else:
            self.weights = torch.stack([weights_of(read, self.real, False), weights_of(read, self.real, True)], 1)

    def __call__(self, rec) -> None:
        """Fold one block (blocks arrive from the output back)."""
        if self.needs_relevance and rec.relevance is None:
            raise MethodError(no_relevance(self.name, self.preset))
        if self.seen == 0:
            self._start(rec)
        self.seen += 1
        if rec.index == 0:
            self.tokens0 = rec.attention.shape[-1]
        if self.weights.shape[1] > 1 and (deferring() or bool(self.causal)):  # (skipped once a block is not)
            self.causal = self.causal & causal_block(rec.attention, self.real)
        if rec.index not in self.range:
            return
        check_square(rec, self.name)
        if self.prev is not None:
            check_neighbours(rec, self.prev, self.name)
        self.prev = types.SimpleNamespace(index=rec.index, name=rec.name,
                                          attention=torch.empty(rec.attention.shape, device="meta"))
        if self.row is not None:  # not the last block of the range (whose head rows need whole maps)
            self.row = self._fold_in_chunks(rec)
            return
        maps = self.head_maps(rec)
        agg = self.agg
        if agg.positive and agg.head_fusion != "gradient" and not shares_memory(
                maps, rec.attention, rec.gradient, rec.relevance):
            # the method's own product (Eq. 13's ∇A ⊙ R_A, not a record nor a view of one): its
            # positive part in place, once, for the fused map and the head rows (one
            # attention-sized tensor fewer per block)
            maps, agg = maps.clamp_(min=0), dataclasses.replace(agg, positive=False)
        fused = fuse_heads(maps, rec.gradient, agg)
        if self.row is None:  # the last block of the range: start from the query weights
            self.row = self.weights.to(fused.dtype)
            self.excluded, self.path = torch.zeros_like(self.row), self.row
            self.heads = self._head_rows(rec, maps, agg)
        if self.agg.identity == "exclude":  # the row's part off the identity path (relprop.methods.identity)
            self.excluded, self.path = fold_step(self.excluded, self.path, fused, self.agg.normalize_rows)
        a = with_identity(fused, self.agg.normalize_rows)
        self.row = torch.matmul(self.row, a)  # [batch, k, N] · [batch, N, N]: row ← row · (I + M_b)

    def _fold_in_chunks(self, rec) -> torch.Tensor:
        """row · (I + M_b) with I + M_b built in chunks of query rows: row · A = Σ_chunks
        row[:, :, chunk] · A[chunk, :]. Every step of M_b (the per-head maps of Eq. 13 or of the
        rollouts, their positive part, the head fusion, the identity, ``normalize_rows``) is row by
        row, so a chunk's rows are those of the whole map; only the order of the sums of the
        product differs (float rounding). The maps of one chunk take at most
        ``chunk_bytes`` (:data:`FOLD_CHUNK_BYTES`), so no per-head tensor as large as the attention map
        is formed."""
        state = self._rows_begin()
        self._rows_add(state, rec, 0)
        return self._rows_end(state)

    def _rows_begin(self) -> dict:
        """The sums of a fold by chunks of rows (:meth:`_rows_add`, :meth:`_rows_end`)."""
        path = self.path.clone() if self.agg.identity == "exclude" and self.agg.normalize_rows else self.path
        return {"out": None, "excluded": None, "path": path}

    def _rows_add(self, state: dict, rec, offset: int) -> None:
        """Add the terms of query rows ``offset`` … of the block to ``state``: ``rec`` holds A, dA,
        R_A on those rows (a whole record with ``offset`` 0, or a chunk of the row-chunked walk, on the
        first keys of the block's N: the keys after its width are 0 there, and so are their terms)."""
        a = rec.attention
        n, total = a.shape[-2], self.row.shape[-1]
        per_row = max(1, a.numel() // n) * a.element_size()
        step = max(1, self.chunk_bytes // per_row)
        for start in range(0, n, step):
            stop = min(n, start + step)
            lo, hi = offset + start, offset + stop
            part = types.SimpleNamespace(**{k: None if getattr(rec, k) is None else getattr(rec, k)[..., start:stop, :]
                                            for k in ("attention", "gradient", "relevance")})
            maps, agg = self.head_maps(part), self.agg
            if agg.positive and agg.head_fusion != "gradient" and not shares_memory(
                    maps, part.attention, part.gradient, part.relevance):
                maps, agg = maps.clamp_(min=0), dataclasses.replace(agg, positive=False)
            fused = fuse_heads(maps, part.gradient, agg)  # [batch, rows of the chunk, its first keys]
            fused = pad_keys(fused, max(fused.shape[-1], hi))  # (the identity's column of each row included)
            rows = torch.arange(hi - lo, device=fused.device)
            eye = torch.zeros(fused.shape[-2:], dtype=fused.dtype, device=fused.device)
            eye[rows, rows + lo] = 1
            chunk = fused + eye
            if self.agg.normalize_rows:
                sums = chunk.sum(-1, keepdim=True)
                chunk, fused = chunk / sums, fused / sums  # Ā_b's rows and their map part N_b
            term = torch.matmul(self.row[..., lo:hi], chunk)  # [batch, k, rows] · [batch, rows, its keys]
            _add_first(state, "out", term, total)
            if self.agg.identity == "exclude":  # relprop.methods.identity.fold_step, chunk by chunk
                term = torch.matmul(self.excluded[..., lo:hi], chunk) + torch.matmul(self.path[..., lo:hi], fused)
                _add_first(state, "excluded", term, total)
                if self.agg.normalize_rows:
                    state["path"][..., lo:hi] = self.path[..., lo:hi] / sums[:, None, :, 0]

    def _rows_end(self, state: dict) -> torch.Tensor:
        if self.agg.identity == "exclude":
            self.excluded, self.path = state["excluded"], state["path"]
        return state["out"]

    # -- the row-chunked walk (relprop.engine.chunked_walk): a block handed over in chunks of rows --
    def start_rows(self, meta) -> bool:
        """A block arrives in chunks of query rows (``meta``: its index, name, ``device`` and
        ``attention``, a tensor on the meta device shaped like the whole map). False: this fold needs the whole
        record (the block next to the output, whose query and head rows read whole maps, or the
        last block of the range); then it is called with it instead."""
        if self.seen == 0 and self.query == "cls":  # the first block: its chunks are kept as needed
            self.batch = meta.attention.shape[0]
            real = self._real(meta.attention.shape[-2], meta.device)
            self.first = (meta, FirstBlockRows(self.head_maps, self.agg, real))
            return True
        if self.seen == 0 or (meta.index in self.range and self.row is None):
            return False
        self.first = None
        self.seen += 1
        if meta.index == 0:
            self.tokens0 = meta.attention.shape[-1]
        self.rows_state = None
        if meta.index not in self.range:
            return True
        check_square(meta, self.name)
        if self.prev is not None:
            check_neighbours(meta, self.prev, self.name)
        self.prev = types.SimpleNamespace(index=meta.index, name=meta.name, attention=meta.attention)
        self.rows_state = self._rows_begin()
        return True

    def fold_rows(self, part, lo: int) -> None:
        """Fold query rows ``lo`` … of the block of :meth:`start_rows` (``part``: their A, dA, R_A)."""
        if self.needs_relevance and part.relevance is None:
            raise MethodError(no_relevance(self.name, self.preset))
        if self.first is not None:
            self.first[1].add(part, lo)
            return
        if self.weights.shape[1] > 1 and (deferring() or bool(self.causal)):
            self.causal = self.causal & causal_rows(part.attention, self.real, lo)
        if self.rows_state is not None:
            self._rows_add(self.rows_state, part, lo)

    def end_rows(self) -> None:
        """The block of :meth:`start_rows` is complete."""
        if self.first is not None:
            self._end_first(*self.first)
            self.first = None
            return
        if self.rows_state is not None:
            self.row = self._rows_end(self.rows_state)
        self.rows_state = None

    def _end_first(self, meta, first: FirstBlockRows) -> None:
        """As :meth:`__call__` on the block next to the output, from its chunks (``first``)."""
        n = meta.attention.shape[-2]
        self.real, self.first_tokens = first.real, n
        read = first.read()
        self._candidates(read, n, self.real.device)
        self.seen += 1
        if meta.index == 0:
            self.tokens0 = meta.attention.shape[-1]
        if self.weights.shape[1] > 1:
            self.causal = self.causal & first.causal
        if meta.index not in self.range:
            return
        check_square(meta, self.name)
        self.prev = types.SimpleNamespace(index=meta.index, name=meta.name, attention=meta.attention)
        fused = first.fused_map()
        self.row = self.weights.to(fused.dtype)
        self.excluded, self.path = torch.zeros_like(self.row), self.row
        self.heads = first.head_rows(self.weights)
        if self.agg.identity == "exclude":
            self.excluded, self.path = fold_step(self.excluded, self.path, fused, self.agg.normalize_rows)
        self.row = torch.matmul(self.row, with_identity(fused, self.agg.normalize_rows))

    def _head_rows(self, rec, maps: torch.Tensor, agg: Aggregation) -> Optional[torch.Tensor]:
        """[batch, k, heads, N]: each head's map of the last block of the range at the query rows
        (as :func:`relprop.methods.aggregation._head_rows`)."""
        maps = per_head_maps(rec, maps, agg)
        if maps is None:
            return None
        w = self.weights.to(maps.dtype)
        if self.query == "mean":
            w = w / w.sum(-1, keepdim=True).clamp_min(1)
        return torch.stack([weighted_rows(w[:, i], maps) for i in range(w.shape[1])], 1)

    def result(self) -> dict:
        """The method's output: ``tokens`` (the query row of C), ``query`` (its weights), ``heads``."""
        check_mixing(self.mixing, self.name)
        if self.seen != self.n_blocks or self.row is None:
            raise MethodError(f"{self.name}: the folded run folded {self.seen} of {self.n_blocks} blocks; explain "
                              f"with keep_blocks=True")
        if self.used_mask and self.tokens0 != self.first_tokens:
            raise MethodError(f"{self.name}: the first and the last attention block have different token counts; "
                              f"explain with keep_blocks=True")
        row, w, excluded = self.row, self.weights.to(self.row.dtype), self.excluded
        heads = self.heads
        if self.weights.shape[1] > 1:  # the causal reading where every block was causal (chosen on the device)
            row, w, excluded = (torch.where(self.causal, t[:, 1], t[:, 0]) for t in (row, w, excluded))
            heads = None if heads is None else torch.where(self.causal, heads[:, 1], heads[:, 0])
        else:
            row, w, excluded = row[:, 0], w[:, 0], excluded[:, 0]
            heads = None if heads is None else heads[:, 0]
        if self.query == "mean":
            total = w.sum(1, keepdim=True).clamp_min(1)
            row, w, excluded = row / total, w / total, excluded / total
        if self.agg.identity == "exclude":
            row = merge_rows(row, excluded, w)
        return {"tokens": row, "query": w, "heads": heads, "flat_cause": flat_cause(self.agg.identity, w),
                "matrix": NotKept("the aggregated matrix (exp.matrix)", self.name)}


def _add_first(state: dict, key: str, term: torch.Tensor, total: int) -> None:
    """``state[key]`` += ``term`` on its first keys (``term``: [batch, k, width ≤ total]); a new
    [batch, k, total] sum the first time."""
    if state[key] is None:
        state[key] = pad_keys(term, total)
    else:
        state[key][..., :term.shape[-1]].add_(term)
