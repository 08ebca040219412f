"""The block next to the output, folded from chunks of query rows (the row-chunked walk,
:mod:`relprop.engine.chunked_walk`).

A :class:`relprop.methods.fold_maps.RowFold` starts at the block next to the output: it reads the
query off the rows its gradient reaches (:func:`relprop.methods.query.weights_of`), the per-head
query rows ``exp.heads`` off the per-head maps at the query, and starts the row r = q · (I + M_b)
(CVPR 2021 Eq. 13–14). None of this needs the whole per-head maps: the fused map M_b is heads times
smaller, and the query's weights are non-zero only on the rows the gradient reaches, row 0 and each
sample's last real row (the candidates of :func:`~relprop.methods.query.weights_of`). So
:class:`FirstBlockRows` keeps, chunk by chunk, the fused rows, the rows the gradient reaches, whether
the map is causal, and the per-head maps at those candidate rows only.
"""
from __future__ import annotations

import dataclasses
from typing import List, Optional

import torch

from ..graph.aliasing import shares_memory
from ..graph.attention_core import pad_keys
from ..graph.host_reads import deferring
from .aggregation import fuse_heads
from .query import row_zero_only, support_of


def causal_rows(a: torch.Tensor, real: torch.Tensor, lo: int) -> torch.Tensor:
    """:func:`relprop.methods.query.causal_block` on query rows ``lo`` … of a map (``a``: those rows,
    on the first keys of the N tokens: the keys after its width are 0, the row-chunked walk's chunks
    of :func:`relprop.engine.chunked_core.chunk_plan`); a 0-d bool tensor."""
    n = real.shape[-1]
    if a.shape[-1] > n:
        return torch.zeros((), dtype=torch.bool, device=a.device)
    rows, width = a.shape[-2], a.shape[-1]
    cut = lo + 1  # (keys 0 … lo are above no row of the chunk's diagonal: only the keys after them are read)
    if cut >= width:
        return torch.ones((), dtype=torch.bool, device=a.device)
    upper = torch.arange(cut, width, device=a.device)[None, :] > torch.arange(lo, lo + rows, device=a.device)[:, None]
    r = real[:, lo:lo + rows]
    r = r[:, None, :, None] if a.dim() == 4 else r[:, :, None]
    return ~((a[..., cut:] != 0) & upper & r).any()


class FirstBlockRows:
    """The chunks of the block next to the output, for :class:`relprop.methods.fold_maps.RowFold`
    (``head_maps``: the method's per-head maps of a record, ``agg``: its aggregation, ``real``:
    [batch, N] bool, the real tokens)."""

    def __init__(self, head_maps, agg, real: torch.Tensor):
        self.head_maps, self.agg, self.real = head_maps, agg, real
        n = real.shape[-1]
        idx = torch.arange(n, device=real.device)
        last_real = torch.where(real, idx, -1).amax(1).clamp_min(0)
        self.candidates = torch.zeros(n, dtype=torch.bool, device=real.device)
        self.candidates[0] = True
        self.candidates[last_real] = True
        self.fused: List[torch.Tensor] = []
        self.reads: List[torch.Tensor] = []
        self.rows: List[torch.Tensor] = []  # the candidate rows' indices, chunk by chunk
        self.head_parts: List[Optional[torch.Tensor]] = []
        self.causal = torch.ones((), dtype=torch.bool, device=real.device)
        #: within a call that reads nothing on the host until its end (relprop.graph.host_reads): the
        #: per-head rows of the query candidates gathered on the device, chunk by chunk (:meth:`_gather`)
        self.on_device = deferring()
        self.gathered = None

    def add(self, part, lo: int) -> None:
        """Take query rows ``lo`` … (``part``: their A, dA, R_A, on the first keys of the N tokens, the
        others 0; kept here with those zeros)."""
        maps, agg = self.head_maps(part), self.agg
        if agg.positive and agg.head_fusion != "gradient" and not shares_memory(
                maps, part.attention, part.gradient, part.relevance):
            maps, agg = maps.clamp_(min=0), dataclasses.replace(agg, positive=False)
        n = self.real.shape[-1]
        self.fused.append(pad_keys(fuse_heads(maps, part.gradient, agg), n))
        read = support_of(part.gradient)
        self.reads.append(read)
        if deferring() or bool(self.causal):  # (skipped once a chunk is not causal, where values are read)
            self.causal = self.causal & causal_rows(part.attention, self.real, lo)
        if self.on_device:
            self._gather(part, maps, agg, read, lo)
            return
        keep = (read.any(0) | self.candidates[lo:lo + read.shape[1]]).nonzero().flatten()
        self.rows.append(keep + lo)
        if maps.dim() != 4:
            self.head_parts.append(None)
            return
        sel = maps[:, :, keep]  # as relprop.methods.aggregation.per_head_maps, on these rows
        if agg.head_fusion == "gradient":
            sel = part.gradient[:, :, keep] * sel
        if agg.positive:
            sel = sel.clamp(min=0)
        self.head_parts.append(pad_keys(sel, n))

    def _gather(self, part, maps: torch.Tensor, agg, read: torch.Tensor, lo: int) -> None:
        """The query candidates' per-head rows from the chunk at rows ``lo`` … , on the device: the sum of
        the rows the gradient reaches (the mean reading's numerator), the last such row and the last real
        row seen so far (the causal reading's), and row 0 (the class token's). Each is a weighted row of
        the per-head maps, as :meth:`head_rows` computes it from the kept rows."""
        if maps.dim() != 4:
            self.gathered = False
            return
        n = self.real.shape[-1]
        sel = part.gradient * maps if agg.head_fusion == "gradient" else maps
        if agg.positive:
            sel = sel.clamp(min=0)
        sel = pad_keys(sel, n)  # [batch, heads, rows, N]
        b, heads, rows = sel.shape[0], sel.shape[1], sel.shape[2]
        idx = torch.arange(rows, device=sel.device)

        def row_at(which: torch.Tensor) -> tuple:
            at = torch.where(which, idx, -1).amax(1)  # [batch]: the last such row of the chunk, -1: none
            picked = sel.gather(2, at.clamp_min(0).reshape(b, 1, 1, 1).expand(b, heads, 1, n))[:, :, 0]
            return at >= 0, picked
        summed = (read.to(sel.dtype)[:, None, :, None] * sel).sum(2)
        read_here, last_read = row_at(read)
        real_here, last_real = row_at(self.real[:, lo:lo + rows])
        if self.gathered is None:
            self.gathered = {"sum": summed, "read": last_read, "real": last_real, "first": sel[:, :, 0]}
            self.gathered_any = {"read": read_here, "real": real_here}
            return
        g, seen = self.gathered, self.gathered_any
        g["sum"] = g["sum"] + summed
        for key, here, row in (("read", read_here, last_read), ("real", real_here, last_real)):
            g[key] = torch.where(here[:, None, None], row, g[key])
            seen[key] = seen[key] | here

    def read(self) -> torch.Tensor:
        """[batch, N] bool: the rows the gradient reaches (:func:`relprop.methods.query.support_of`)."""
        return torch.cat(self.reads, 1)

    def fused_map(self) -> torch.Tensor:
        """[batch, N, N]: the fused map M_b."""
        out = torch.cat(self.fused, -2)
        self.fused = []
        return out

    def head_rows(self, weights: torch.Tensor) -> Optional[torch.Tensor]:
        """[batch, k, heads, N]: each head's map weighted by the query weights ``weights`` [batch, k, N]
        (as :func:`relprop.methods.query.weighted_rows`; the weights vanish off the kept rows): the
        readings [non-causal, causal] of :func:`relprop.methods.query.weights_of` (one where k is 1)."""
        if self.on_device:
            return self._head_rows_on_device(weights.shape[1])
        if any(p is None for p in self.head_parts):
            return None
        rows = torch.cat(self.rows)
        maps = torch.cat(self.head_parts, 2)  # [batch, heads, kept rows, N]
        w = weights.to(maps.dtype)
        off = torch.ones(w.shape[-1], dtype=torch.bool, device=w.device)
        off[rows] = False
        if bool((w[..., off] != 0).any()):
            raise RuntimeError("a query weight off the rows the folded first block kept (a bug of relprop)")
        w = w[..., rows]
        out = [torch.stack([(w[:, i, :, None] * maps[:, h]).sum(-2) for h in range(maps.shape[1])], 1)
               for i in range(w.shape[1])]
        return torch.stack(out, 1)

    def _head_rows_on_device(self, k: int) -> Optional[torch.Tensor]:
        """:meth:`head_rows` from the rows :meth:`_gather` kept: row 0 where every sample reads row 0
        alone; the non-causal reading, the mean of the rows read (row 0 where none is); the causal reading,
        the last row read (the last real row where none is)."""
        g = self.gathered
        if not g:
            return None
        read = self.read()
        first = g["first"]
        if k == 1:
            return first[:, None]
        count = read.sum(1).to(first.dtype)[:, None, None]
        mean = torch.where(count > 0, g["sum"] / count.clamp_min(1), first)
        latest = torch.where(self.gathered_any["read"][:, None, None], g["read"], g["real"])
        alone = row_zero_only(read)
        return torch.stack([torch.where(alone, first, mean), torch.where(alone, first, latest)], 1)
