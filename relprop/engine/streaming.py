"""A streamed run: every attention block handed to the methods' folds as soon as the reverse walk
has its A, dA and R_A, and then dropped.

Rollout-style methods read per block one heads-fused token×token map and only the query's row of
the product of the blocks' maps (CVPR 2021, Eq. 13–14). Folded from the output block back, the row
needs one block at a time, so the run need not keep any block's records: it is the segmented run of
``memory="low"`` (:func:`relprop.engine.low_memory.run_low`: a forward pass without autograd, then
block by block from the output, the block recomputed with autograd, its gradients, its part of the
relevance walk) with, after each segment, the block's record passed to every fold of
``Request.stream`` and its attention-sized values (A, dA, R_A) and the block's own V and features
freed. The peak then holds the hidden states between blocks and one block, whatever the number of
blocks; the records grow with blocks × heads × tokens² otherwise.
"""
from __future__ import annotations

from typing import List

from ..errors import RelpropError
from .memory import crossing, segments
from .records import block_record

#: why a streamed run was refused by the engine (the api does not ask for one there)
STREAM_WINDOWS = ("a streamed run folds one token sequence per block; this model's attention works on windows (Swin) "
                  "or connects two token streams: explain it with keep_blocks=True (the full-record path)")


def segment_hook(request):
    """``after_segment(seg, env, grad, rel_at, batch)`` for :func:`relprop.engine.low_memory.run_low`:
    for the blocks whose attention map lies in ``seg`` (from the output back), build the block's
    record, call every fold of ``request.stream`` with it, and free its A, dA, R_A, V and features;
    returns the nodes freed. Sets ``hook.token_count`` (the first block's number of tokens)."""
    captured = request.captured
    a = captured.analysis
    kept = crossing(captured) | set(a.sources) | {a.primary}
    first = segments(captured)[0]
    seen: List[int] = []

    def hook(seg, env, grad, rel_at, batch: int) -> set:
        inside = set(seg)
        dropped = set()
        for b in sorted((b for b in a.blocks if b.attention in inside), key=lambda b: -b.index):
            rec = block_record(b, env, grad, rel_at, batch, partial=True)
            if b.index == 0:
                hook.token_count = rec.attention.shape[-1]
            for fold in request.stream:
                fold(rec)
            del rec
            seen.append(b.index)
            for n in (b.attention, b.value, b.features):
                if n is not None and n in inside and n not in kept:
                    env.pop(n, None)
                    grad.pop(n, None)
                    rel_at.pop(n, None)
                    dropped.add(n)
        if seg is first:
            missing = [b.index for b in a.blocks if b.index not in seen]
            if missing:
                raise RelpropError(f"a streamed run did not reach blocks {missing} (a bug of relprop's segments: "
                                   "please report it; keep_blocks=True explains without streaming)")
        return dropped

    hook.token_count = None
    return hook
