"""Shared pieces of the rollout-style methods (CVPR 2021, Eq. 13–16)."""
from __future__ import annotations

from typing import List

import torch


def head_mean(t: torch.Tensor) -> torch.Tensor:
    """E_h: mean over the heads of a [batch, heads, tokens, tokens] map."""
    if t.dim() == 3:
        return t
    return t.mean(1)


def chain(matrices: List[torch.Tensor], normalize_rows: bool = False) -> torch.Tensor:
    """``I + M_b`` for every block (input → output order), multiplied output-side first::

        C = (I + M_{B-1}) · ... · (I + M_0)

    which is the paper's C = Ā_1 · ... · Ā_B with its blocks numbered from the output (Eq. 14).
    ``normalize_rows`` divides each ``I + M_b`` by its row sums first (the authors' BERT code).
    """
    eye = torch.eye(matrices[0].shape[-1], dtype=matrices[0].dtype, device=matrices[0].device)
    joint = None
    for m in matrices:
        a = m + eye
        if normalize_rows:
            a = a / a.sum(-1, keepdim=True)
        joint = a if joint is None else a @ joint
    return joint


def query_row(trace, joint: torch.Tensor, query: str = "cls") -> torch.Tensor:
    """The row of an aggregated [batch, tokens, tokens] matrix that explains the output:
    ``"cls"`` → the classification token's row (row 0), or for a causal decoder the row of the
    position its target reads (:mod:`relprop.methods.query`); ``"mean"`` → the mean of the rows of
    the real (non-padding) tokens."""
    from ..errors import MethodError
    if query == "cls":
        from .query import query_rows
        return query_rows(trace, joint)
    if query == "mean":
        mask = trace.token_mask
        if mask is None:
            mask = torch.ones(joint.shape[:2], dtype=torch.bool, device=joint.device)
        w = mask.to(joint.dtype)
        return (joint * w[:, :, None]).sum(1) / w.sum(1, keepdim=True).clamp_min(1)
    raise MethodError(f"query={query!r} is not a choice. Choices: ['cls', 'mean']")
