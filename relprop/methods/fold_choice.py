"""Whether :func:`relprop.explain` keeps every block's records or folds the blocks into the query row.

With ``keep_blocks=None`` (the default) the records are kept while they fit a budget: when the
attention-sized records of a full-record run (A, ∇A, R_A of every block, CVPR 2021 Eq. 13;
:func:`relprop.engine.budget.records_bytes`) would exceed ``records_budget``, the rollout-style
methods fold each block into the query's row during the reverse walk (Eq. 13–14 associated from
the query, :mod:`relprop.methods.fold_maps`), with the same scores to float32 rounding and no
``exp.blocks`` / ``exp.matrix``; ``exp.notes`` says so. ``keep_blocks=True`` always keeps them,
``keep_blocks=False`` always folds where folding applies.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from ..engine.budget import default_budget, mib, records_bytes
from . import fold_maps


def why_not_folded(jobs, analysis) -> Optional[str]:
    """None when every method of ``jobs`` ((info, options) pairs) can be folded block by block, else
    why not (:func:`relprop.methods.fold_maps.why_not`)."""
    for info, options in jobs:
        why = fold_maps.why_not(info, options, analysis)
        if why is not None:
            return why
    return None


def choose(jobs: Sequence, analysis, batch: int, device: torch.device, keep_blocks: Optional[bool],
           budget: Optional[float], runs: int = 1) -> Tuple[bool, Optional[str]]:
    """``(fold, note)``: whether the call folds the blocks (the folded run), and the note the
    Explanations get about that choice (None: nothing to say).

    Parameters
    ----------
    jobs : (MethodInfo, options) pairs of the call.
    analysis : the captured graph's analysis (its ``blocks`` give the attention shapes).
    batch : samples in the call.
    device : where the model runs (the default budget reads the memory available there).
    keep_blocks : None (keep within the budget), True (keep), False (fold where it applies).
    budget : bytes the kept records may take; None: :func:`relprop.engine.budget.default_budget`.
    runs : traces with relevance the full-record path would keep (one per preset the methods need;
        0 when no method needs relevance).
    """
    if keep_blocks is True:
        return False, None
    if keep_blocks is False:
        why = why_not_folded(jobs, analysis)
        if why is None:
            return True, None
        return False, (f"keep_blocks=False: not folded block by block ({why}); the full-record path ran and "
                       "exp.blocks holds every block's records")
    if not analysis.blocks or not any(info.needs_blocks for info, _ in jobs):
        return False, None
    val = analysis.blocks[0].attention.meta.get("val")
    itemsize = 8 if isinstance(val, torch.Tensor) and val.dtype == torch.float64 else 4
    size = records_bytes(analysis.blocks, batch, itemsize, runs)
    limit = default_budget(device) if budget is None else budget
    if size <= limit:
        return False, None
    over = (f"the block records (A, dA, R_A of {len(analysis.blocks)} blocks) would take {mib(size)}, over "
            f"records_budget={mib(limit)}")
    why = why_not_folded(jobs, analysis)
    if why is not None:
        return False, f"{over}; they were kept because folding does not apply ({why})"
    return True, (f"{over}: each attention block was folded into the scores during the reverse walk and its "
                  "records dropped (exp.blocks and exp.matrix are not kept; explain with keep_blocks=True to "
                  "keep them, or raise records_budget)")
