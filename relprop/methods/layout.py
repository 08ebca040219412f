"""Which tokens of a vision model hold a patch of the image, and where on the patch grid.

The engine traces, for the tokens entering the first attention block, the input position each one
comes from (``trace.token_map``, :mod:`relprop.graph.tokens`): a row-major patch index, or -1 for the
class, distillation and register tokens. Without a trace the tokens are taken to be the constants
first and the patches after them, row-major (the convention of ViT, DeiT and their kin).
"""
from __future__ import annotations

from typing import Optional

import torch

from ..errors import MethodError


def positions(trace, n: int) -> Optional[torch.Tensor]:
    """[batch, n] long: the traced input position of each of ``n`` tokens (-1: none) — of the first
    block's tokens when it has ``n``, else of the last block (or any block) whose input has ``n``
    tokens; None when no traced block input has ``n`` tokens."""
    maps = dict(getattr(trace, "token_maps", None) or {})
    first = getattr(trace, "token_map", None)
    if torch.is_tensor(first):
        maps.setdefault(0, first)
    for index in sorted(maps, key=lambda i: (i != 0, -i)):  # the first block, then from the output back
        if tuple(maps[index].shape) == (trace.batch_size, n):
            return maps[index]
    return None


def patch_index(trace, n: int, device=None) -> Optional[torch.Tensor]:
    """[batch, n] long: the patch each of ``n`` tokens holds (-1: none), for a vision model with a
    patch grid; None otherwise."""
    if trace.modality != "vision" or trace.grid is None:
        return None
    tm = positions(trace, n)
    if tm is not None:
        return tm.to(device)
    cells = trace.grid[0] * trace.grid[1]
    if n < cells:
        return None
    idx = torch.arange(n, device=device) - (n - cells)
    return idx.clamp_min(-1).expand(trace.batch_size, n)


def patch_tokens(trace, n: int, device) -> Optional[torch.Tensor]:
    """[batch, n] bool: True at the tokens that hold a patch (None for models without a patch grid).
    Without a traced map, and for a stage with fewer tokens than the grid (Swin), the last
    ``gh·gw`` tokens (all of them when there are fewer)."""
    idx = patch_index(trace, n, device)
    if idx is not None:
        return idx >= 0
    if trace.modality != "vision" or trace.grid is None:
        return None
    cells = trace.grid[0] * trace.grid[1]
    cols = torch.zeros(trace.batch_size, n, dtype=torch.bool, device=device)
    cols[:, n - cells:] = True
    return cols


def grid_tokens(trace, values: torch.Tensor, name: str) -> torch.Tensor:
    """[batch, gh·gw, ...]: the rows of ``values`` ([batch, tokens, ...], the first block's tokens)
    in patch-grid order; a :class:`MethodError` when some patch has no token."""
    n = values.shape[1]
    idx = patch_index(trace, n, values.device)
    gh, gw = trace.grid
    if idx is None:
        raise MethodError(f"{name}: {n} tokens cannot hold a {gh}x{gw} patch grid")
    cells = gh * gw
    out = values.new_zeros((values.shape[0], cells) + tuple(values.shape[2:]))
    seen = torch.zeros(values.shape[0], cells, dtype=torch.long, device=values.device)
    for b in range(values.shape[0]):
        keep = idx[b] >= 0
        out[b, idx[b][keep]] = values[b][keep]
        seen[b, idx[b][keep]] += 1
    if not bool((seen == 1).all()):
        raise MethodError(f"{name} needs one token per patch of the {gh}x{gw} grid, and this model's tokens cover "
                          f"some patches {'twice' if bool((seen > 1).any()) else 'not at all'}")
    return out


def per_position(trace, values: torch.Tensor) -> torch.Tensor:
    """[batch, positions] from a [batch, a, b] attribution of a floating input: summed over the axis the
    model's first weight contracts (``GraphAnalysis.feature_axis``: the embedding size of input embeddings,
    the mel bins of Whisper's channels-first features), the last one when relprop found none."""
    session = getattr(trace, "session", None)
    analysis = getattr(getattr(session, "captured", None), "analysis", None)
    axis = getattr(analysis, "feature_axis", None)
    return values.sum(axis if axis in (1, 2) else -1)
