"""Whether the one-backward fast path runs whole or segment by segment (``memory="low"``).

The fast path (:mod:`relprop.engine.fast_path`: AttnLRP's and CP-LRP's rules as one modified
backward pass, Achtibat et al., ICML 2024, Sec. 3.3) runs the captured graph with autograd, and the
graph evaluates attention unfused: every block's scores, softmax and their modified-gradient
companions are heads × tokens² tensors held until the backward pass reaches them. Measured on a
LLaMA-style decoder (``benchmarks/memory_scaling.py --model llama --what fwdbwd lrp``: 879 MiB at
1024 tokens, 2746 MiB at 2048, 4.0× and 6.6× one forward+backward pass) the growth is
:data:`MAPS_PER_BLOCK` float32 attention maps per block. With ``memory="default"``, when those maps
would exceed the budget (``explain(..., records_budget=)``, default
:func:`relprop.engine.budget.default_budget`), the fast path runs segment by segment with the
attention cores in chunks of query rows instead (:mod:`relprop.engine.fast_low`: the same relevance
to float rounding, a peak near one forward+backward pass), and ``exp.notes`` says so.
``memory="low"`` always segments, ``memory="high"`` never does.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from .budget import attention_values, default_budget, mib

#: attention-sized float32 tensors per block the whole fast path holds at its peak (measured: the
#: peak grows by 4.9 maps per block from 1024 to 2048 tokens on the LLaMA-style decoder above)
MAPS_PER_BLOCK = 5


def maps_bytes(blocks: Sequence, batch: int, itemsize: int = 4) -> int:
    """Bytes of the attention-sized tensors the whole fast path holds: Σ_blocks batch × heads ×
    queries × keys × ``itemsize`` × :data:`MAPS_PER_BLOCK`."""
    return attention_values(blocks) * batch * itemsize * MAPS_PER_BLOCK


def choose(memory: str, blocks: Sequence, batch: int, device: torch.device,
           budget: Optional[float], path: str = "the one-backward fast path") -> Tuple[bool, Optional[str]]:
    """``(segmented, note)``: whether the fast path runs segment by segment with row-chunked
    attention cores (:func:`relprop.engine.fast_low.run_fast_low`), and the note the Explanations
    get about an automatic choice (None: nothing to say).

    Parameters
    ----------
    memory : the call's ``memory=`` (:data:`relprop.engine.request.MEMORY_MODES`): ``"low"``
        segments, ``"high"`` does not, ``"default"`` segments when the maps exceed ``budget``.
    blocks : the attention blocks of the captured graph (their ``attention`` node gives the shape).
    batch : samples in the call.
    device : where the model runs (the default budget reads the memory available there).
    budget : bytes the attention maps may take; None: :func:`relprop.engine.budget.default_budget`.
    path : the run the note names: the fast path, or the rule-by-rule walk of a preset without one
        (which holds at least as many maps: every block's A, dA and R_A and the forward pass's
        attention-sized values kept for autograd).
    """
    if memory == "low":
        return True, None
    if memory != "default" or not blocks:
        return False, None
    size = maps_bytes(blocks, batch)
    limit = default_budget(device) if budget is None else budget
    if size <= limit:
        return False, None
    return True, (f"{path} would hold {MAPS_PER_BLOCK} attention maps per block "
                  f"({len(blocks)} blocks: {mib(size)}), over records_budget={mib(limit)}: it ran segment by "
                  "segment with the attention cores in chunks of query rows (memory='low'; the same relevance "
                  "to float rounding); raise records_budget to run it whole")
