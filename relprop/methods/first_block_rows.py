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
from .aggregation import fuse_heads
from .query import support_of


def causal_rows(a: torch.Tensor, real: torch.Tensor, lo: int) -> bool:
    """:func:`relprop.methods.query.causal_block` on query rows ``lo`` … of a map (``a``: those rows,
    on the first keys of the N tokens: the keys after its width are 0, the row-chunked walk's chunks
    of :func:`relprop.engine.chunked_core.chunk_plan`)."""
    n = real.shape[-1]
    if a.shape[-1] > n:
        return False
    rows, width = a.shape[-2], a.shape[-1]
    cut = lo + 1  # (keys 0 … lo are above no row of the chunk's diagonal: only the keys after them are read)
    if cut >= width:
        return True
    upper = torch.arange(cut, width, device=a.device)[None, :] > torch.arange(lo, lo + rows, device=a.device)[:, None]
    r = real[:, lo:lo + rows]
    r = r[:, None, :, None] if a.dim() == 4 else r[:, :, None]
    return not bool(((a[..., cut:] != 0) & upper & r).any())


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
        self.causal = True

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
        if self.causal:
            self.causal = causal_rows(part.attention, self.real, lo)
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
        (as :func:`relprop.methods.query.weighted_rows`; the weights vanish off the kept rows)."""
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
