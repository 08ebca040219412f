"""How a rollout's scores treat the query rows' own identity share (option ``identity=``).

A rollout multiplies one factor per block, Ā_b = I + M_b (Chefer et al., CVPR 2021, Eq. 13–14;
attention rollout, Eq. 15–16, divides each factor by its row sums s_b), and reads the query's row,
scores = q · C with C = Ā_{B-1} · … · Ā_0. Each factor is an identity part and a map part,
Ā_b = S_b + N_b (S_b = I and N_b = M_b; with the row sums, S_b = diag(1 / s_b), N_b = M_b / s_b), and
expanding the product,

    C = P + D,    P = S_{B-1} · … · S_0 (diagonal),    D = every path through at least one N_b,

so q · C = q · P + q · D: the identity path carries the query weights q to the scores, only
rescaled (unchanged without row sums, P = I). For the
paper's models q is the [CLS] row, q = e_cls, and that share lands on [CLS] alone, which the map
leaves out: the scores are q · D on every token shown. When the query is spread over the tokens
(mean pooling: q = 1/N on every real row; DINOv2's class + mean) or is a token the map shows (a
decoder's last position), the same identity share is q itself — uniform over the pooled tokens, or
+1 on the last token — and where the blocks' maps add little row mass (Transformer Attribution's
(∇A ⊙ R_A)⁺ adds 1e-7–1e-2 of it on trained models) it is the whole picture: every token the same
colour.

``identity`` picks what the scores keep (``exp.matrix`` is C in every case):

``"exclude"`` (default)
    q · D: each query row's identity share left out, as the paper's map leaves out [CLS]'s. P is
    diagonal, so on a [CLS] model the scores shown are those of Eq. 14 unchanged (they differ at
    [CLS] alone, which is not shown); on a mean-pooled one they are q · C less a share q_j P_jj per
    token (a constant without row sums). q · D is folded without forming P + D and subtracting P
    (:func:`excluded_row`), so block terms far below float32's resolution of 1 are kept exactly,
    and it is ≥ 0 wherever the maps are.
``"keep"``
    q · C, Eq. 14 as printed.
``"exclude_self"``
    Σ_{i≠j} q_i C_ij: each query row's whole own entry left out (its identity share and the paths
    that return to it), the closest reading of "leave out the query token" for a pooled query.
    Needs C (no folding) and one token sequence (no token merging between stages).

``benchmarks/faithfulness/pooling.py`` compares the three on mean-pooled models; ``docs/methods.md``
has the figures behind the default.
"""
from __future__ import annotations

from typing import List, Optional

import torch

from ..errors import MethodError

#: the values of the rollout-style methods' ``identity=`` option, the default first
IDENTITY_CHOICES = ("exclude", "keep", "exclude_self")
DEFAULT_IDENTITY = IDENTITY_CHOICES[0]


def with_identity(m: torch.Tensor, normalize_rows: bool = False) -> torch.Tensor:
    """One block's factor of the rollout, I + M_b (Eq. 13's residual), divided by its row sums with
    ``normalize_rows``."""
    a = m + torch.eye(m.shape[-1], dtype=m.dtype, device=m.device)
    return a / a.sum(-1, keepdim=True) if normalize_rows else a


def split(m: torch.Tensor, normalize_rows: bool = False):
    """One block's factor Ā_b = S_b + N_b split into its identity part S_b = diag(d_b) and its map
    part N_b: (None, M_b) for I + M_b (S_b = I); with ``normalize_rows`` (I + M_b divided by its
    row sums s_b = 1 + Σ_j M_b[i, j]) (1 / s_b, M_b / s_b). Returns (d_b [batch, N] or None, N_b)."""
    if not normalize_rows:
        return None, m
    s = 1 + m.sum(-1, keepdim=True)
    return 1 / s[..., 0], m / s


def fold_step(excluded: torch.Tensor, path: torch.Tensor, m: torch.Tensor, normalize_rows: bool = False):
    """One block of the fold of :func:`excluded_row`, from the output back: the query row
    q · (factors so far) is ``path`` (its identity path) + ``excluded`` (the rest); after block b,
    excluded ← excluded · Ā_b + path · N_b and path ← path · S_b (rows [batch, k, N], map
    [batch, N, N]). Returns (excluded, path)."""
    d, n = split(m, normalize_rows)
    excluded = torch.matmul(excluded, with_identity(m, normalize_rows)) + torch.matmul(path, n)
    return excluded, (path if d is None else path * d[:, None, :])


def excluded_row(w: torch.Tensor, maps: List[torch.Tensor], normalize_rows: bool = False,
                 transitions: Optional[List[Optional[torch.Tensor]]] = None) -> torch.Tensor:
    """q · (C − P) for the query weights ``w`` [batch, N_last] and the fused maps of the blocks
    (input → output order): with each factor Ā_b = S_b + N_b (:func:`split`), P = S_{B-1} · … · S_0
    is the identity path (I without ``normalize_rows``; the stage transitions of a hierarchical
    model between the factors), so q · (C − P) is every path through at least one block's map.
    Folded from the output block back (:func:`fold_step`), never as a difference of two large
    numbers: every term is ≥ 0 when the maps are."""
    e = torch.zeros_like(w)[:, None, :]
    p = w[:, None, :]
    for i in range(len(maps) - 1, -1, -1):
        e, p = fold_step(e, p, maps[i].to(w.dtype), normalize_rows)
        if i > 0 and transitions is not None and transitions[i - 1] is not None:
            t = transitions[i - 1].to(w.dtype)
            e, p = e @ t, p @ t
    return e[:, 0]


def treat(identity: str, row: torch.Tensor, w: torch.Tensor, joint: torch.Tensor, maps: List[torch.Tensor],
          normalize_rows: bool = False, transitions=None, name: str = "rollout") -> torch.Tensor:
    """The scores of a rollout under ``identity`` (see the module docstring) from the query row
    ``row`` = q · C, the query weights ``w``, C (``joint``) and the fused maps.

    On one token sequence the scores of the tokens off the query rows are q · C's bit for bit
    (:func:`merge_rows`): a [CLS] model's shown scores do not change."""
    if identity == "keep":
        return row
    hierarchical = transitions is not None and any(t is not None for t in transitions)
    if identity == "exclude_self":
        if hierarchical or joint.shape[-1] != joint.shape[-2]:
            raise MethodError(f"{name}: identity='exclude_self' leaves out each query row's own column of C, and "
                              "this model's C maps the tokens of one stage to those of another (token merging); "
                              "use identity='exclude' or 'keep'")
        eye = torch.eye(joint.shape[-1], dtype=torch.bool, device=joint.device)
        return merge_rows(row, (w[:, :, None].to(joint.dtype) * joint.masked_fill(eye, 0)).sum(-2), w)
    if identity != "exclude":
        raise MethodError(f"identity={identity!r} is not a choice. Choices: {list(IDENTITY_CHOICES)}")
    excluded = excluded_row(w.to(row.dtype), maps, normalize_rows, transitions)
    if hierarchical:
        return excluded
    return merge_rows(row, excluded, w)


def merge_rows(row: torch.Tensor, excluded: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The scores of identity="exclude": ``excluded`` (q · (C − P)) at the query rows (w ≠ 0) and
    ``row`` (q · C) elsewhere, where the two agree (P is diagonal: q · P is 0 off the query rows)
    and ``row`` is Eq. 14's value bit for bit: a [CLS] model's shown scores are those of "keep"."""
    return torch.where(w != 0, excluded, row)


def flat_cause(identity: str, w: torch.Tensor) -> tuple:
    """In words, why a rollout's scores can be uniform (for the flat-map warning of
    :mod:`relprop.explanation.flatness`): with ``identity="keep"`` and a query spread over several
    rows, the identity share q dominates; otherwise the blocks' maps give every token the same share.
    Returns ``(describe, spread)``: ``spread`` the most rows a sample's query weights spread over (a
    tensor, read with the call's other checks only when the warning is given), ``describe(values)`` the
    words from its value."""
    spread = (w != 0).sum(-1).amax() if w.numel() else torch.zeros((), dtype=torch.long, device=w.device)

    def describe(values) -> str:
        rows = int(values[0])
        if identity == "keep" and rows > 1:
            return (f"identity='keep' carries the query weights (spread over {rows} rows: the model pools over "
                    "tokens) through each block's identity to the scores unchanged, and the blocks' maps add too "
                    "little to that to show; identity='exclude' (the default) leaves that share out")
        return "the blocks' aggregated maps give every token the same share (e.g. maps near zero for this target)"
    return describe, spread
