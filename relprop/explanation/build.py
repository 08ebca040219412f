"""An :class:`Explanation` from a method's output and the trace it read: token scores placed on the
patch grid and upsampled for images, padding and special tokens masked for text."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ..errors import RelpropError
from ..rules.stabilize import promote
from .result import Explanation
from .special_tokens import special_positions


def build(info, preset: Optional[str], result: dict, trace, special_tokens_mask=None) -> Explanation:
    """The Explanation of method ``info`` (a :class:`relprop.methods.MethodInfo`) whose output is
    ``result`` on ``trace``; ``preset`` is the preset its relevance came from."""
    session = trace.session
    kwargs, captured, model = session.kwargs, session.captured, session.model
    tokens = result.get("tokens")
    if tokens is not None and getattr(trace, "stages", None) is not None:  # Swin: a stage's tokens → patch grid
        tokens = trace.stages.lift(tokens)
    pixels = result.get("pixels")
    mask = None
    scores = tokens
    smap = None
    prefix = 0
    if trace.modality == "vision" and trace.grid is not None:
        gh, gw = trace.grid
        image = kwargs[captured.primary]
        if pixels is not None:
            smap = promote(pixels)
            scores = patch_sums(smap, gh, gw)
            if tokens is not None:
                prefix = tokens.shape[-1] - gh * gw
        else:
            n = tokens.shape[-1]
            prefix = n - gh * gw
            if prefix < 0:
                raise RelpropError(f"{n} tokens cannot hold a {gh}x{gw} patch grid")
            scores = tokens[:, prefix:]
            smap = F.interpolate(promote(scores.reshape(-1, 1, gh, gw)), size=tuple(image.shape[-2:]),
                                 mode="bilinear", align_corners=False)[:, 0]
        mask = torch.ones_like(scores, dtype=torch.bool)
    elif trace.modality == "text":
        special = special_positions(model, kwargs, captured.primary, tuple(scores.shape), scores.device,
                                    special_tokens_mask)
        mask = ~special
        scores = torch.where(mask, scores, torch.zeros((), dtype=scores.dtype, device=scores.device))
    return Explanation(method=info.name, scores=scores, map=smap, mask=mask, matrix=result.get("matrix"),
                       blocks=trace.blocks, target=trace.target, target_scores=trace.target_scores,
                       conservation=trace.conservation, input_relevance=trace.input_relevance,
                       logits=trace.logits, preset=preset if info.needs_relevance else None,
                       modality=trace.modality, grid=trace.grid, prefix_tokens=prefix, outputs=trace.outputs,
                       signed=info.signed, class_specific=info.class_specific, notes=list(trace.notes))


def patch_sums(pixel_map: torch.Tensor, gh: int, gw: int) -> torch.Tensor:
    """Sum a [batch, H, W] map over the cells of a gh x gw patch grid -> [batch, gh*gw]."""
    b, h, w = pixel_map.shape
    if h % gh == 0 and w % gw == 0:
        cells = pixel_map.reshape(b, gh, h // gh, gw, w // gw).sum((2, 4))
    else:
        cells = F.adaptive_avg_pool2d(pixel_map[:, None], (gh, gw))[:, 0] * (h * w / (gh * gw))
    return cells.reshape(b, gh * gw)
