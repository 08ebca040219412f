"""How much memory the per-block records of a full-record run would take, and the budget they are
held to when :func:`relprop.explain` chooses between keeping them and folding the blocks.

The full-record path keeps, for every attention block, the attention map A, its gradient ∇A and its
relevance R_A (CVPR 2021, Eq. 13: Ā_b = E_h[(∇A_b ⊙ R_A_b)⁺]), each batch × heads × queries × keys
values in at least float32 (:func:`relprop.engine.records.record`). They grow with tokens²: 432 MiB
for BERT-base at 512 tokens, 6.75 GiB at 2048. When ``keep_blocks`` is not given and these records
would exceed the budget, the rollout-style methods fold each block into the query's row instead
(:mod:`relprop.methods.fold_maps`), which needs none of them.
"""
from __future__ import annotations

import math
import os
from typing import Optional, Sequence

import torch

#: the fixed part of the default budget of the kept block records, in bytes (1 GiB)
DEFAULT_RECORDS_BUDGET = 1 << 30
#: the default budget is also at most this fraction of the memory available on the model's device
AVAILABLE_FRACTION = 0.25
#: attention-sized tensors the full-record path keeps per block and per preset: A, ∇A, R_A (R_A only
#: when the methods need relevance)
RECORDS_PER_BLOCK = 3


def _per_sample(block) -> int:
    """Values of one sample's attention map A of ``block`` (heads × queries × keys)."""
    val = block.attention.meta.get("val")
    shape = tuple(val.shape) if isinstance(val, torch.Tensor) else ()
    rest = [d for d in shape[1:]]
    if len(shape) >= 2 and all(isinstance(d, int) for d in rest):
        return math.prod(rest) * (block.folded_heads or 1)
    return max(1, block.queries) * max(1, block.keys) * (block.folded_heads or 1)


def attention_values(blocks: Sequence) -> int:
    """Values of one sample's attention maps, summed over ``blocks`` (Σ heads × queries × keys)."""
    return sum(_per_sample(b) for b in blocks)


def records_bytes(blocks: Sequence, batch: int, itemsize: int, runs: int = 1) -> int:
    """Bytes of the attention-sized records a full-record run keeps: Σ_blocks batch × heads ×
    queries × keys × ``itemsize`` × :data:`RECORDS_PER_BLOCK`, times ``runs`` (one trace per preset;
    ``runs=0``: a run without relevance, A and ∇A only).

    Parameters
    ----------
    blocks : the :class:`relprop.graph.attention_blocks.BlockInfo` of the captured graph.
    batch : samples in the call.
    itemsize : bytes per recorded value (records are at least float32: 4, or 8 for float64).
    runs : how many traces with relevance the call keeps (one per preset the methods need; 0: one
        trace without relevance).
    """
    per_run = RECORDS_PER_BLOCK if runs > 0 else RECORDS_PER_BLOCK - 1
    return attention_values(blocks) * batch * itemsize * per_run * max(1, runs)


def available_bytes(device: torch.device) -> Optional[int]:
    """Memory available on ``device`` now (CUDA: free device memory; CPU: the kernel's MemAvailable,
    else the free physical pages), or None where it cannot be read."""
    try:
        if device.type == "cuda":
            return int(torch.cuda.mem_get_info(device)[0])
        if device.type == "cpu":
            with open("/proc/meminfo", encoding="ascii") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
            return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (OSError, ValueError, RuntimeError, AttributeError):
        return None
    return None


def default_budget(device: torch.device) -> int:
    """The budget of the kept records when ``explain(..., records_budget=None)``:
    :data:`DEFAULT_RECORDS_BUDGET` (1 GiB), or :data:`AVAILABLE_FRACTION` of the memory available on
    ``device`` when that is less."""
    free = available_bytes(device)
    if free is None:
        return DEFAULT_RECORDS_BUDGET
    return min(DEFAULT_RECORDS_BUDGET, int(free * AVAILABLE_FRACTION))


def mib(n: float) -> str:
    """``n`` bytes in MiB (KiB below 1 MiB), for notes."""
    return f"{n / 2**20:.0f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"
