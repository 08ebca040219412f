"""Vision-language models (LLaVA, PaliGemma, Gemma-3, Qwen2-VL, Qwen2.5-VL; tiled: Idefics3, SmolVLM;
any-resolution: LLaVA-NeXT, LLaVA-OneVision): which input is explained, and the families refused.

A vision-language model (VLM) runs its image through a vision tower and a projector and writes the
resulting image tokens into the placeholder positions of the prompt (``masked_scatter``); its language
model then reads one sequence of prompt and image tokens. relprop explains such a model in one run
with two relevance sources (:func:`relprop.graph.streams.merges`):

* the **pixels** (``wrt="pixel_values"``, the default for a VLM when every method reads the input
  relevance: ``lrp``, ``input_x_gradient``, ...): the relevance of the image tokens flows back through
  the projector, any pooling or merging of patches, and the vision tower to the pixels. ``exp.scores``
  are the pixel relevance summed per patch of the vision tower's grid, ``exp.map`` the pixel map, and
  ``exp.streams`` holds both the patch scores (``"pixel_values"``) and the prompt's per-token relevance
  (``"input_ids"``; 0 at the image placeholders, whose embeddings the image tokens replace). The
  conservation ledger counts both: Σ pixels + Σ prompt tokens + absorbed = the explained score.
* the **language model's tokens** (``wrt="input_ids"``, the default when a method reads the attention
  blocks: the rollouts, ``transformer_attribution``): the blocks are the language model's, image
  placeholders included, and the vision tower is a constant of the explanation.

Qwen2-VL and Qwen2.5-VL give their image as flattened rows of 2x2-merged patches: they are explained
through :class:`relprop.models.qwen_images.QwenImage` (the model called on the image read back from the
rows, one prompt with one image per explained call), and their image tokens are 2x2 blocks of the patch grid.
A batch of several prompts of these families (and of LLaVA-NeXT / -OneVision) is explained sample by sample
(:mod:`relprop.models.vlm_batches`).
Idefics3 and SmolVLM, which cut the image into tiles, are placed back on the image by
:mod:`relprop.models.vlm_tiles`; LLaVA-NeXT's and LLaVA-OneVision's any-resolution crops by
:mod:`relprop.models.vlm_anyres`. Families whose image tokens relprop cannot place back on the image
(``REFUSED``) are refused with a :class:`relprop.MethodError` that names the family and what is missing,
and a family relprop does not know is refused unless ``wrt=`` says which input to explain: never
explained with a wrong map.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import torch

from ..errors import MethodError
from ..explanation.build import patch_sums
from .qwen_images import PIXELS as _PIXELS, QWEN, patch_layout
from .vlm_anyres import ANYRES
from .vlm_tiles import TILED

#: config.model_type of the families explained (their image tokens merged with masked_scatter)
SUPPORTED = {"llava": "LLaVA", "paligemma": "PaliGemma", "gemma3": "Gemma-3", **QWEN}
#: every family placed on the image: these, the tiled ones (vlm_tiles), LLaVA-NeXT and -OneVision (vlm_anyres)
EXPLAINED = {**SUPPORTED, **TILED, **ANYRES}

#: config.model_type of the families refused -> (name, what is missing); none at present (a family relprop
#: does not know is refused below unless wrt= says which input to explain)
REFUSED: dict = {}

PIXELS, IDS = "pixel_values", "input_ids"


def model_type(model: Any) -> Optional[str]:
    """``model.config.model_type`` when the model is a vision-language model (its config has a
    ``vision_config``, a ``text_config`` and an image placeholder token id), else None."""
    cfg = getattr(model, "config", None)
    if cfg is None or getattr(cfg, "vision_config", None) is None or getattr(cfg, "text_config", None) is None \
            or image_token_id(cfg) is None:  # two-tower models (CLIP, SigLIP) merge no image tokens
        return None
    return getattr(cfg, "model_type", None)


def explained_input(model: Any, inputs: Any, infos: Sequence[Any], wrt: Optional[str]) -> Optional[str]:
    """The input a vision-language model is explained onto (module docstring): ``wrt`` when given,
    ``"pixel_values"`` when every method reads only the input relevance, ``"input_ids"`` when every
    method reads the attention blocks; unchanged for other models.

    Raises
    ------
    MethodError
        the family is refused (``REFUSED``: what is missing), is not known and no ``wrt`` says which input
        to explain, or the methods need both inputs.
    """
    kind = model_type(model)
    if kind is None or not isinstance(inputs, Mapping) or not torch.is_tensor(inputs.get(PIXELS)):
        return wrt
    if kind in REFUSED:
        name, missing = REFUSED[kind]
        raise MethodError(f"{type(model).__name__} ({name}) is not explained with its image: {missing}, so relprop "
                          "would draw a wrong map. Supported vision-language families: "
                          f"{', '.join(EXPLAINED.values())}")
    if wrt is not None:
        return wrt
    if kind not in EXPLAINED:
        raise MethodError(f"{type(model).__name__} is a vision-language model (model_type {kind!r}) whose image-token "
                          "layout relprop does not know, so it cannot say which patch each image token is. Pass "
                          "wrt='input_ids' to explain the prompt's tokens with the image as a constant (image "
                          "placeholders scored as tokens), or wrt='pixel_values' for the pixels through the vision "
                          f"tower. Families relprop places on the image: {', '.join(EXPLAINED.values())}")
    blocks = {bool(getattr(i, "needs_blocks", True)) for i in infos}
    if blocks == {False}:
        return PIXELS
    if blocks == {True}:
        return IDS
    raise MethodError(f"{type(model).__name__} ({EXPLAINED[kind]}): the methods "
                      f"{sorted(i.name for i in infos)} explain different inputs (those that read the input relevance "
                      "the pixels and the prompt, those that read the attention blocks the language model's tokens); "
                      "explain them in two calls, or pass wrt=")


def image_token_id(config) -> Optional[int]:
    """The id of the image placeholder token (``image_token_id`` or ``image_token_index``)."""
    for name in ("image_token_id", "image_token_index"):
        v = getattr(config, name, None)
        if isinstance(v, int):
            return v
    return None


def token_layout(config, image_shape=None):
    """(patch grid (gh, gw) of the vision tower, image tokens per image, cell: patches per image token
    along each side, whether a class token comes first) for the supported families; Qwen2-VL and
    Qwen2.5-VL: of the image of ``image_shape`` (its pixels [1, C, H, W], relprop.models.qwen_images),
    each image token a merged m x m block of patches, the blocks row-major."""
    v = config.vision_config
    kind = config.model_type
    if kind in QWEN:
        p, _, m, _ = patch_layout(config)
        gh, gw = int(image_shape[-2]) // p, int(image_shape[-1]) // p
        return (gh, gw), gh * gw // (m * m), m, False
    side = v.image_size // v.patch_size
    if kind == "gemma3":
        per_side = int(round(config.mm_tokens_per_image ** 0.5))
        return (side, side), per_side * per_side, side // per_side, False
    cls_first = kind == "llava" and getattr(config, "vision_feature_select_strategy", "default") == "full"
    return (side, side), side * side + int(cls_first), 1, cls_first


def patch_scores(scores: torch.Tensor, ids: torch.Tensor, config, image_shape=None) -> torch.Tensor:
    """[batch, gh·gw] row-major patch scores from [batch, tokens] scores of the language model's
    sequence: the k-th image placeholder of sample b is image token k of image b, which holds a cell of
    ``cell x cell`` patches (1x1 for LLaVA and PaliGemma; Gemma-3 pools the patch grid to
    ``mm_tokens_per_image`` tokens; Qwen2-VL and Qwen2.5-VL merge 2x2 patches into a token, the image of
    ``image_shape``) and spreads its score evenly over them (Σ patch scores = Σ image-token scores); a
    class token (LLaVA's ``"full"`` features) holds no patch.

    Raises
    ------
    MethodError
        a sample does not hold exactly one image's placeholders.
    """
    (gh, gw), n, cell, cls_first = token_layout(config, image_shape)
    at = ids == image_token_id(config)
    counts = at.sum(1)
    if not bool((counts == n).all()):
        raise MethodError(f"{SUPPORTED[config.model_type]}: every sample must hold one image's {n} placeholder tokens "
                          f"(id {image_token_id(config)}) to place the image tokens on the patches; found "
                          f"{counts.tolist()}")
    tokens = scores[at].reshape(scores.shape[0], n)[:, int(cls_first):]
    side = gw // cell
    grid = tokens.reshape(-1, gh // cell, side) / (cell * cell)
    grid = grid.repeat_interleave(cell, 1).repeat_interleave(cell, 2)
    return grid.reshape(scores.shape[0], gh * gw)


def place_image_tokens(results, model, kwargs, primary: str) -> None:
    """For a supported VLM explained onto its pixels (``wrt="pixel_values"``): a note saying where the
    prompt tokens' relevance is. Explained onto its language model's tokens (``wrt="input_ids"``): each
    Explanation's ``streams`` gets the prompt's scores (``"input_ids"``) and the image tokens' scores
    on the vision tower's patch grid (``"pixel_values"``, :func:`patch_scores`), with a note."""
    kind = model_type(model)
    if kind not in SUPPORTED or not torch.is_tensor(kwargs.get(PIXELS)):
        return
    if primary == PIXELS:
        for exp in results:
            if kind in QWEN:
                _on_patch_grid(exp, model.config)
            if IDS in (exp.streams or {}):
                exp.notes.append(f"{SUPPORTED[kind]}: pixels and prompt explained in one run; exp.scores/exp.map are "
                                 "the pixels' relevance (per patch / per pixel), exp.streams['input_ids'] the prompt "
                                 "tokens' (0 at the image placeholders, whose embeddings the image tokens replace)")
        return
    if primary != IDS:
        return
    ids = kwargs[IDS]
    shape = tuple(kwargs[PIXELS].shape)
    (gh, gw), _, cell, _ = token_layout(model.config, shape)
    for exp in results:
        if exp.scores.dim() != 2 or exp.scores.shape != ids.shape:
            continue
        exp.streams = {IDS: exp.scores, PIXELS: patch_scores(exp.scores, ids.to(exp.scores.device), model.config,
                                                               shape)}
        exp.notes.append(f"{SUPPORTED[kind]}: the language model's blocks explained; each image placeholder's score "
                         f"placed on the {gh}x{gw} patch grid of the vision tower (exp.streams['pixel_values'], "
                         f"row-major) through the placeholder -> patch order"
                         + (f", each image token spread evenly over its {cell}x{cell} "
                            f"{'merged' if kind in QWEN else 'pooled'} patches" if cell > 1 else ""))


def _on_patch_grid(exp, config) -> None:
    """A Qwen2-VL / Qwen2.5-VL Explanation onto the pixels [1, C, H, W] (relprop.models.qwen_images): the
    pixel map (relevance summed over the colour channels), the per-patch scores on the gh x gw grid of
    the vision tower's P x P patches (row-major), also ``exp.streams['pixel_values']``."""
    r = exp.input_relevance
    if r is None or r.dim() != 4:
        return
    p = patch_layout(config)[0]
    gh, gw = r.shape[-2] // p, r.shape[-1] // p
    exp.map = r.sum(1)
    exp.scores = patch_sums(exp.map, gh, gw)
    exp.mask = torch.ones_like(exp.scores, dtype=torch.bool)
    exp.grid = (gh, gw)
    if exp.streams is not None:
        exp.streams[_PIXELS] = exp.scores
    exp.notes.append(f"{SUPPORTED[config.model_type]}: the image read back from the processor's 2x2-merged rows "
                     f"(pixel_values, image_grid_thw) and explained as pixels [1, C, H, W] through "
                     f"relprop.models.qwen_images.QwenImage; exp.scores on its {gh}x{gw} grid of {p}x{p} patches, "
                     "row-major, each pixel's relevance summed over its time copies")
