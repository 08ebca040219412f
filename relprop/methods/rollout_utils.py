"""Shared pieces of the rollout-style methods (CVPR 2021, Eq. 13–16)."""
from __future__ import annotations

from typing import List, Optional

import torch

from ..errors import MethodError
from .identity import with_identity
from .query import query_rows, query_vector
from .method_registry import all_methods


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

    ``transitions`` (hierarchical models such as Swin, see :mod:`relprop.graph.window_attention`): one entry
    per consecutive pair of blocks, None within a stage, or the merge matrix D [tokens_{b+1},
    tokens_b] where block b+1 starts a stage with fewer tokens; then C = ... (I + M_{b+1}) D (I + M_b)
    ... and C is [tokens of the last block, tokens of the first].
    """
    joint = None
    for i, m in enumerate(matrices):
        a = with_identity(m, normalize_rows)
        if joint is not None and transitions is not None and transitions[i - 1] is not None:
            joint = transitions[i - 1].to(joint.dtype) @ joint
        joint = a if joint is None else a @ joint
    return joint


def stage_transitions(trace, start_block: int = 0):
    """The ``transitions`` argument of :func:`chain` for blocks ``start_block``.. of ``trace``
    (None for models whose blocks share one token sequence)."""
    stages = getattr(trace, "stages", None)
    return None if stages is None else stages.transitions(start_block)


def query_row(trace, joint: torch.Tensor, query: str = "cls"):
    """(row, weights): the row of an aggregated [batch, tokens, tokens] matrix that explains the
    output, and the [batch, tokens] weights of the rows it combines. ``"cls"`` → the row of the
    token states the target reads (:mod:`relprop.methods.query`: the class token's row, the mean of
    the pooled tokens' rows, a decoder's last position); ``"mean"`` → the mean of the rows of the
    real (non-padding) tokens."""
    if query == "cls":
        return query_rows(trace, joint), query_vector(trace, joint.shape[-2], joint.device, joint.dtype)
    if query == "mean":
        mask = trace.token_mask
        if mask is None or tuple(mask.shape) != tuple(joint.shape[:2]):  # e.g. Swin's last stage: every row
            mask = torch.ones(joint.shape[:2], dtype=torch.bool, device=joint.device)
        w = mask.to(joint.dtype)
        row = (joint * w[:, :, None]).sum(1) / w.sum(1, keepdim=True).clamp_min(1)
        return row, w / w.sum(1, keepdim=True).clamp_min(1)
    raise MethodError(f"query={query!r} is not a choice. Choices: ['cls', 'mean']")


def rollout_blocks(trace, name: str, start_block: int = 0, end_block: Optional[int] = None) -> list:
    """The blocks ``start_block``..``end_block - 1`` of ``trace`` (all from ``start_block`` when
    ``end_block`` is None) when a rollout over them is defined, else a
    :class:`MethodError` that says why and names the methods that apply: every block a square map
    of one token sequence (or of stages linked by a token merging, Swin), and no op mixing tokens
    outside the attention blocks (:func:`relprop.graph.attention_blocks.token_mixing`)."""
    blocks = trace.blocks[start_block:end_block]
    for b in blocks:
        check_square(b, name)
    stages = getattr(trace, "stages", None)
    for prev, nxt in zip(blocks, blocks[1:]):
        check_neighbours(prev, nxt, name, stages)
    check_mixing(getattr(trace, "token_mixing", None), name)
    return blocks


def _others() -> str:
    """The methods that are not rollouts (``@method(..., rollout=True)``), for a rollout's refusal."""
    return "Methods that apply: " + ", ".join(sorted(n for n, m in all_methods().items() if not m.rollout))


def check_square(b, name: str) -> None:
    """A :class:`MethodError` when block record ``b`` maps its keys to another number of queries."""
    q, k = b.attention.shape[-2], b.attention.shape[-1]
    if q != k:
        raise MethodError(f"{name} multiplies the token-to-token maps of the blocks, and block {b.index} "
                          f"('{b.name}') maps {k} tokens to {q} queries (class attention, attention pooling or "
                          f"downsampling), which a rollout does not cover. {_others()}")


def check_neighbours(prev, nxt, name: str, stages=None) -> None:
    """A :class:`MethodError` when consecutive blocks ``prev``, ``nxt`` have different token counts
    with no token merging between them (``stages``, Swin)."""
    n0, n1 = prev.attention.shape[-1], nxt.attention.shape[-1]
    if n0 != n1 and (stages is None or prev.index not in stages.links):
        raise MethodError(f"{name} multiplies the token-to-token maps of the blocks, and block {prev.index} "
                          f"('{prev.name}') has {n0} tokens while block {nxt.index} ('{nxt.name}') has {n1}, "
                          f"with no token merging relprop can read off the graph between them. {_others()}")


def check_mixing(mixing: Optional[str], name: str) -> None:
    """A :class:`MethodError` when tokens mix outside the attention blocks (``mixing``: the op, in words)."""
    if mixing is not None:
        raise MethodError(f"{name} multiplies the attention maps of the blocks, and the tokens of this model also mix "
                          f"outside them: {mixing}; a rollout of the attention maps would leave that out. {_others()}")
