"""Precision@K for extractive question answering (AttCAT, Qiang et al., NeurIPS 2022, §5.3)."""
from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch

from ..errors import InputError
from .text_metrics import _overlap


def answer_mask(start: Any, end: Any, positions: int) -> torch.Tensor:
    """[samples, positions] bool, True at the answer's tokens start..end (inclusive)."""
    s = torch.as_tensor(start).long().flatten()
    e = torch.as_tensor(end).long().flatten()
    if s.shape != e.shape or bool((e < s).any()) or bool((s < 0).any()) or bool((e >= positions).any()):
        raise InputError(f"answer spans must be 0 <= start <= end < {positions}, one per sample; got "
                         f"start={s.tolist()}, end={e.tolist()}")
    i = torch.arange(positions)
    return (i[None, :] >= s[:, None]) & (i[None, :] <= e[:, None])


def qa_precision_at_k(scores: Any, start: Any, end: Any, k: int = 20, mask: Optional[Any] = None) -> np.ndarray:
    """[samples] the number of answer tokens (positions ``start``..``end``) among the ``k``
    top-scored tokens — AttCAT §5.3's Precision@K for SQuAD, a count (their Fig. 3 uses K = 20;
    higher is better). ``scores``: an Explanation or [samples, positions]; ``mask``: the positions
    that count (default ``exp.mask``: special tokens and padding left out)."""
    s = scores.scores if hasattr(scores, "scores") else torch.as_tensor(scores)
    truth = answer_mask(start, end, s.shape[-1]).to(s.device)
    hit, _, _ = _overlap(scores, truth, k, mask)
    return hit.cpu().numpy()
