"""One attention block's :class:`relprop.engine.trace.BlockRecord` from the values of a run (shared by
the full-record path, :func:`relprop.engine.execute.build_trace`, and the folded one,
:mod:`relprop.engine.fold_hooks`)."""
from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from ..rules.stabilize import promote
from .trace import BlockRecord


def block_record(b, env: Dict[Any, Any], grad: Dict[Any, torch.Tensor], rel_at: Dict[Any, torch.Tensor],
                 batch: int, partial: bool = False) -> BlockRecord:
    """The record of block ``b`` (a :class:`relprop.graph.attention_blocks.BlockInfo`): A, dA, R_A, h, dh, R_h,
    V, the features, their gradient and W_O, detached, in at least float32, heads unfolded.

    ``partial`` (a folded run, when the walk reaches the block's attention map): values the run
    has not reached yet or already freed are None — the gradient and relevance of the hidden state
    entering the block (they belong to the segment before it), V and the features when the walk
    has passed them."""
    unfold = unfolder(b.folded_heads, batch)
    if partial:
        env, grad = _Partial(env), _Partial(grad)
    return BlockRecord(
        index=b.index, name=b.name, layer=b.layer,
        attention=unfold(record(env[b.attention])), gradient=unfold(record(grad[b.attention])),
        relevance=unfold(rel_at.get(b.attention)),
        hidden=record(env[b.hidden]) if b.hidden is not None else None,
        hidden_gradient=record(grad[b.hidden]) if b.hidden is not None else None,
        hidden_relevance=rel_at.get(b.hidden) if b.hidden is not None else None,
        value=unfold(record(env[b.value])) if b.value is not None else None,
        features=record(env[b.features]) if b.features is not None else None,
        features_gradient=record(grad[b.features]) if b.features is not None else None,
        out_proj_weight=record(env[b.out_proj]) if b.out_proj is not None else None,
        query_stream=b.query_stream, key_stream=b.key_stream, wave=b.wave,
    )


class _Partial(dict):
    """A view of a dict whose missing keys read as None (``record(None)`` is None)."""

    def __missing__(self, key):
        return None


def record(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A value or gradient as the Trace records it: detached, in at least float32 (float64 kept)."""
    return None if t is None else promote(t.detach())


def unfolder(heads, batch: int):
    """[batch·heads, ...] → [batch, heads, ...] for a block whose heads are folded into the batch
    axis, batch-major (identity for the others and for None)."""
    def unfold(t):
        if t is None or not heads or t.shape[0] != batch * heads:
            return t
        return t.reshape((batch, heads) + tuple(t.shape[1:]))
    return unfold
