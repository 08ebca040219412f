"""What a vision-language model's Explanation remembers of its prompt, so that ``show()``/``save()`` and
the notebook draw the prompt's tokens beside the image (:mod:`relprop.viz.vision_text`).

For a supported family (:mod:`relprop.models.vision_language`) explained with its image, each Explanation
that holds both the image's and the prompt's relevance (``streams["pixel_values"]`` and
``streams["input_ids"]``) gets ``image_tokens`` ([batch, tokens] True at the image placeholders) and
``prompt_tokens`` (per sample the token strings from the tokenizer, else the ids as strings); one
explained onto the language model's tokens (rollouts, no pixel map) also gets ``image``, the pixels
(a copy on the CPU) the heatmap is drawn over.
"""
from __future__ import annotations

from typing import Any, List

import torch

from .vision_language import IDS, PIXELS, SUPPORTED, image_token_id, model_type


def _strings(tokenizer: Any, ids: torch.Tensor) -> List[List[str]]:
    convert = getattr(tokenizer, "convert_ids_to_tokens", None) or getattr(getattr(tokenizer, "tokenizer", None),
                                                                         "convert_ids_to_tokens", None)
    rows = ids.tolist()
    if convert is not None:
        return [[str(t) for t in convert(r)] for r in rows]
    return [[str(i) for i in r] for r in rows]


def remember_prompt(results: list, *, model: Any, inputs: dict, tokenizer: Any = None) -> None:
    """Fill ``image_tokens``, ``prompt_tokens`` (and for a run without a pixel map ``image``) of each
    Explanation of ``results`` of a supported vision-language model (module docstring)."""
    ids, pixels = inputs.get(IDS), inputs.get(PIXELS)
    if model_type(model) not in SUPPORTED or not torch.is_tensor(ids) or not torch.is_tensor(pixels):
        return
    at = (ids == image_token_id(model.config)).detach().to("cpu")
    names = _strings(tokenizer, ids.detach().to("cpu"))
    for r in results:
        streams = r.streams or {}
        if IDS not in streams or PIXELS not in streams or tuple(streams[IDS].shape) != tuple(ids.shape):
            continue
        r.image_tokens = at.clone()
        r.prompt_tokens = [list(row) for row in names]
        if r.image is None and pixels.dim() == 4 and pixels.shape[0] == ids.shape[0]:
            r.image = pixels.detach().to("cpu", copy=True)
