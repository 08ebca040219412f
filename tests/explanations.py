"""Explanations made by hand (no model): for the renderers' and the export's tests, where what is drawn
or written must follow from known scores."""
from __future__ import annotations

import numpy as np
import torch

from relprop.engine.trace import BlockRecord
from relprop.explanation import Explanation


def fake_text(scores, mask=None, *, method: str = "lrp", signed: bool = True, target=(0,), blocks: int = 0,
              heads=None, preset=None) -> Explanation:
    """A text Explanation with ``scores`` ([batch, positions]); ``blocks`` records whose R_h summed over
    the hidden size is the scores times the block's index + 1."""
    s = torch.as_tensor(np.asarray(scores, dtype=np.float32))
    m = torch.ones_like(s, dtype=torch.bool) if mask is None else torch.as_tensor(mask)
    recs = []
    for b in range(blocks):
        h = (s * (b + 1))[..., None].repeat(1, 1, 4) / 4
        recs.append(BlockRecord(index=b, name=f"block{b}", layer=f"layer.{b}", attention=None, gradient=None,
                                relevance=None, hidden=None, hidden_gradient=None, hidden_relevance=h))
    t = None if target is None else torch.as_tensor(list(target) * (s.shape[0] // len(target)))
    return Explanation(method=method, scores=s, map=None, mask=m, matrix=None, blocks=recs, target=t,
                       target_scores=torch.arange(s.shape[0], dtype=torch.float32) + 0.5, conservation=None,
                       input_relevance=None, logits=None, preset=preset, modality="text", signed=signed,
                       heads=heads)


def fake_image(pixel_map, *, method: str = "lrp", signed: bool = True, grid=(2, 2), target=(1,)) -> Explanation:
    """An image Explanation whose map is ``pixel_map`` ([H, W] or [batch, H, W]) and scores its patch sums."""
    m = torch.as_tensor(np.asarray(pixel_map, dtype=np.float32))
    if m.dim() == 2:
        m = m[None]
    b, h, w = m.shape
    gh, gw = grid
    scores = m.reshape(b, gh, h // gh, gw, w // gw).sum((2, 4)).reshape(b, gh * gw)
    t = torch.as_tensor(list(target) * (b // len(target)))
    return Explanation(method=method, scores=scores, map=m, mask=torch.ones_like(scores, dtype=torch.bool),
                       matrix=None, blocks=[], target=t, target_scores=torch.full((b,), 0.25), conservation=None,
                       input_relevance=None, logits=None, preset=None, modality="vision", grid=grid,
                       signed=signed)
