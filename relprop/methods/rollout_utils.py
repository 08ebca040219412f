"""Shared pieces of the rollout-style methods (CVPR 2021, Eq. 13–16)."""
from __future__ import annotations

from typing import List, Optional

import torch

from ..errors import MethodError
from .query import query_rows


def head_mean(t: torch.Tensor) -> torch.Tensor:
    """E_h: mean over the heads of a [batch, heads, tokens, tokens] map."""
    if t.dim() == 3:
        return t
    return t.mean(1)


def chain(matrices: List[torch.Tensor], normalize_rows: bool = False,
          transitions: Optional[List[Optional[torch.Tensor]]] = None) -> torch.Tensor:
    """``I + M_b`` for every block (input → output order), multiplied output-side first::

        C = (I + M_{B-1}) · ... · (I + M_0)

    which is the paper's C = Ā_1 · ... · Ā_B with its blocks numbered from the output (Eq. 14).
    ``normalize_rows`` divides each ``I + M_b`` by its row sums first (the authors' BERT code).

    ``transitions`` (hierarchical models such as Swin, see :mod:`relprop.graph.windows`): one entry
    per consecutive pair of blocks, None within a stage, or the merge matrix D [tokens_{b+1},
    tokens_b] where block b+1 starts a stage with fewer tokens; then C = ... (I + M_{b+1}) D (I + M_b)
    ... and C is [tokens of the last block, tokens of the first].
    """
    joint = None
    for i, m in enumerate(matrices):
        a = m + torch.eye(m.shape[-1], dtype=m.dtype, device=m.device)
        if normalize_rows:
            a = a / a.sum(-1, keepdim=True)
        if joint is not None and transitions is not None and transitions[i - 1] is not None:
            joint = transitions[i - 1].to(joint.dtype) @ joint
        joint = a if joint is None else a @ joint
    return joint


def stage_transitions(trace, start_block: int = 0):
    """The ``transitions`` argument of :func:`chain` for blocks ``start_block``.. of ``trace``
    (None for models whose blocks share one token sequence)."""
    stages = getattr(trace, "stages", None)
    return None if stages is None else stages.transitions(start_block)


def query_row(trace, joint: torch.Tensor, query: str = "cls") -> torch.Tensor:
    """The row of an aggregated [batch, tokens, tokens] matrix that explains the output:
    ``"cls"`` → the classification token's row (row 0), or for a causal decoder the row of the
    position its target reads (:mod:`relprop.methods.query`); ``"mean"`` → the mean of the rows of
    the real (non-padding) tokens."""
    if query == "cls":
        return query_rows(trace, joint)
    if query == "mean":
        mask = trace.token_mask
        if mask is None or tuple(mask.shape) != tuple(joint.shape[:2]):  # e.g. Swin's last stage: every row
            mask = torch.ones(joint.shape[:2], dtype=torch.bool, device=joint.device)
        w = mask.to(joint.dtype)
        return (joint * w[:, :, None]).sum(1) / w.sum(1, keepdim=True).clamp_min(1)
    raise MethodError(f"query={query!r} is not a choice. Choices: ['cls', 'mean']")
