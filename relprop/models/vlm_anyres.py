"""LLaVA-NeXT's and LLaVA-OneVision's any-resolution tiles: the crops composed back into one map, the base
image kept apart.

LLaVA-NeXT's image processor picks, from ``config.image_grid_pinpoints``, the resolution that fits the
image best (``rows x cols`` tiles of the vision tower's size), resizes the image into it keeping its
aspect, pads it to the centre, and cuts it into ``rows x cols`` **crops**; before them it puts the
**base image**, the whole image resized to one tile: ``pixel_values`` is ``[batch, 1 + rows·cols, C,
H, W]`` and ``image_sizes`` the original (height, width). The model runs each tile through the vision
tower, lays the crops' patch features out as one ``rows·gh x cols·gw`` grid, **unpads** it (drops the
rows or columns of patches that the padding added, computed from ``image_sizes``), appends an
``image_newline`` token after each row, and puts the base image's ``gh·gw`` tokens first.

LLaVA-OneVision packs the same way, except that it **shrinks** an unpadded crop grid of more than
about N tiles' worth of patches (``vision_aspect_ratio = "anyres_max_N"``) by bilinear interpolation
before the newlines (:mod:`relprop.models.anyres_packing`): each of its crop tokens then mixes up to 2 x 2
patches' features.

relprop takes the layout from the model's own functions (``get_anyres_image_grid_shape`` and
``unpad_image`` of transformers, run on patch indices), so each image token's patch is the model's, and
checks the whole packing against the model's ``pack_image_features`` run on random tile features
(:func:`relprop.models.anyres_packing.check_packing`).
``image_sizes`` is handed to the model as plain ints: ``torch.export`` cannot trace the tile selection
from the values of a tensor, and as ints each image size is its own capture.

* **Pixels** (``lrp`` and the other methods that read the input relevance): ``exp.map`` is the crops'
  pixel relevance (summed over colours) put back together, ``[batch, rows·H, cols·W]`` (the image as
  the processor resized and padded it); ``exp.scores`` / ``exp.streams["pixel_values"]`` its sums per
  patch (``exp.grid`` = ``(rows·gh, cols·gw)``). The **base image is kept apart**:
  ``exp.streams["base_image"]`` is its ``[batch, H, W]`` map (it is the whole image squashed to one
  tile, on another scale than the crops, so it is not added into ``exp.map``). Σ ``exp.map`` + Σ base
  image = Σ pixels, and the ledger counts them all with the prompt: Σ pixels + Σ prompt + absorbed =
  the score. An image that fits one tile (``rows·cols`` = 0) is the base image alone, the map itself.
  LLaVA-OneVision's shrinking is ``aten.upsample_bilinear2d`` in the captured graph, a linear map
  without bias, and relevance passes through it by its rule (relprop.rules.pooling).
* **Tokens** (rollouts): a crop token's score goes to the patch of the composed grid it came from
  (the unpadded rows or columns hold none; a token of a shrunk grid spreads its score over the
  patches it interpolates, by their bilinear weights), a base-image token's to its patch of the base
  image (``exp.streams["base_image"]``, ``[batch, gh·gw]``); the ``image_newline`` tokens hold no patch.

A batch of several prompts is explained sample by sample (the vision tower's rows are all samples'
tiles, which a static capture cannot attribute per sample: :mod:`relprop.models.vlm_batches`). Refused with
a :class:`relprop.MethodError`: pixel_values of more than one sample reaching this one-sample path,
several images in a prompt (``batch_num_images``), a video (``pixel_values_videos``), no
``image_sizes``, a number of tiles other than the pinpoint grid's, vision features other than each
tile's patches (a class token kept, or a patch dropped), a packing unlike relprop's picture, and a
prompt whose placeholder count is not the image's token count.
"""
from __future__ import annotations

import importlib
from typing import Any, Mapping, Tuple

import torch

from ..errors import MethodError
from .anyres_packing import AnyresLayout, check_packing, shrunk_size, spread

#: config.model_type of the any-resolution families explained here -> their name
ANYRES = {"llava_next": "LLaVA-NeXT", "llava_onevision": "LLaVA-OneVision"}
#: their modelling modules, whose get_anyres_image_grid_shape and unpad_image relprop runs
_MODULES = {"llava_next": "transformers.models.llava_next.modeling_llava_next",
            "llava_onevision": "transformers.models.llava_onevision.modeling_llava_onevision"}
PIXELS, IDS, SIZES, BASE = "pixel_values", "input_ids", "image_sizes", "base_image"
#: LLaVA-OneVision's inputs besides the image's: the images per prompt (dropped when it is [1]: the
#: model's default), videos (refused)
IMAGES_PER_PROMPT, VIDEOS, ASPECT = "batch_num_images", "pixel_values_videos", "vision_aspect_ratio"


def model_kind(model: Any):
    kind = getattr(getattr(model, "config", None), "model_type", None)
    return kind if kind in ANYRES else None


def _sizes(v: Any, name: str):
    if torch.is_tensor(v):
        v = v.tolist()
    try:
        return [[int(x) for x in row] for row in v]
    except (TypeError, ValueError):
        raise MethodError(f"image_sizes = {v!r}: {name} reads one (height, width) per image") from None


def plain_sizes(model: Any, inputs: Any):
    """The inputs with ``image_sizes`` as plain ints (module docstring) and LLaVA-OneVision's
    ``batch_num_images`` of ``[1]`` (the model's default: one image, cut into tiles) and a
    ``vision_aspect_ratio`` equal to the config's (the model reads the config's) dropped, after
    :func:`layout` checked them; unchanged for another model or inputs without pixels."""
    kind = model_kind(model)
    if kind is None or not isinstance(inputs, Mapping) or not torch.is_tensor(inputs.get(PIXELS)):
        return inputs
    layout(model, inputs)
    dropped = (IMAGES_PER_PROMPT, ASPECT) if kind == "llava_onevision" else ()
    return {**{k: v for k, v in inputs.items() if k not in dropped},
            SIZES: _sizes(inputs[SIZES], ANYRES[kind])}


def _check_inputs(name: str, kwargs: Mapping[str, Any], cfg) -> None:
    """LLaVA-OneVision's other inputs: one image per prompt, no video, the config's aspect rule."""
    per_prompt = kwargs.get(IMAGES_PER_PROMPT)
    if per_prompt is not None and torch.as_tensor(per_prompt).reshape(-1).tolist() != [1]:
        raise MethodError(f"{name}: batch_num_images = {per_prompt!r}; relprop explains one prompt with one image "
                          "(several images in a prompt are not cut into tiles, a layout relprop does not place)")
    if kwargs.get(VIDEOS) is not None:
        raise MethodError(f"{name}: pixel_values_videos given; relprop places an image's tokens, not a video's "
                          "(pooled frames): explain the image and the prompt without the video")
    given = kwargs.get(ASPECT)
    if given is not None and given != getattr(cfg, ASPECT, None):
        raise MethodError(f"{name}: vision_aspect_ratio={given!r} in the inputs, {getattr(cfg, ASPECT, None)!r} in "
                          "the config; the model's get_image_features reads the config's: set "
                          "model.config.vision_aspect_ratio instead")


def _features_per_tile(model: Any, cfg, name: str, patches: int) -> None:
    """Refuse a feature selection that keeps other than the tile's ``patches`` features: a class token
    (CLIP's, kept by ``"full"``) is on no patch; a tower without one (SigLIP) loses a patch to
    ``"default"``."""
    strategy = getattr(cfg, "vision_feature_select_strategy", "default")
    tower = getattr(getattr(model, "model", model), "vision_tower", None)
    embeddings = getattr(tower, "embeddings", None) or getattr(getattr(tower, "vision_model", None), "embeddings", None)
    emitted = getattr(embeddings, "num_positions", None)
    if emitted is None:  # a tower relprop cannot count: transformers' assumption, a class token first
        if strategy == "default":
            return
        emitted = patches + 1
    kept = int(emitted) - int(strategy == "default")
    if kept != patches:
        raise MethodError(f"{name}: vision_feature_select_strategy={strategy!r} keeps {kept} features per tile (the "
                          f"vision tower gives {emitted}) for its {patches} patches: a class token would be placed on "
                          "no patch, or a patch dropped; supported: the strategy that keeps exactly the patches "
                          "('default' for a tower with a class token, 'full' for one without)")


def layout(model: Any, kwargs: Mapping[str, Any]) -> AnyresLayout:
    """The :class:`AnyresLayout` of the inputs, checked against them and against the model's own
    ``pack_image_features`` (:func:`relprop.models.anyres_packing.check_packing`; module docstring).

    Raises
    ------
    MethodError
        what is missing or does not fit (module docstring's list).
    """
    kind = model.config.model_type
    family = importlib.import_module(_MODULES[kind])
    cfg, name = model.config, ANYRES[kind]
    pv = kwargs[PIXELS]
    if pv.dim() != 5 or int(pv.shape[0]) != 1:
        raise MethodError(f"{name}: pixel_values of shape {tuple(pv.shape)}; relprop explains one sample at a time "
                          "([1, tiles, channels, H, W]): the vision tower's rows are all samples' tiles, which its "
                          "static capture cannot attribute per sample")
    if kind == "llava_onevision":
        _check_inputs(name, kwargs, cfg)
    if kwargs.get(SIZES) is None:
        raise MethodError(f"{name}: no image_sizes, so the tile grid and the unpadding are not known")
    sizes = _sizes(kwargs[SIZES], name)
    if len(sizes) != 1 or len(sizes[0]) != 2:
        raise MethodError(f"{name}: image_sizes = {sizes}: one (height, width) for the one image")
    v = cfg.vision_config
    tile, patch = int(v.image_size), int(v.patch_size)
    gh = gw = tile // patch
    _features_per_tile(model, cfg, name, gh * gw)
    rows, cols = family.get_anyres_image_grid_shape(sizes[0], cfg.image_grid_pinpoints, tile)
    n = int(pv.shape[1])
    shrunk = None
    if n == 1:
        rows = cols = 0
        kept = torch.zeros(0, 0, dtype=torch.long)
    elif n != rows * cols + 1:
        raise MethodError(f"{name}: an image of {sizes[0][0]}x{sizes[0][1]} pixels is cut into {rows}x{cols} tiles "
                          f"by the pinpoints of its config, and a base image: {rows * cols + 1} tiles; pixel_values "
                          f"holds {n}")
    else:
        index = torch.arange(rows * gh * cols * gw).reshape(1, rows * gh, cols * gw)
        kept = family.unpad_image(index, sizes[0])[0]
        shrunk = shrunk_size(getattr(cfg, ASPECT, None) if kind == "llava_onevision" else None, tuple(kept.shape), gh)
    lay = AnyresLayout(rows, cols, (int(pv.shape[-2]), int(pv.shape[-1])), patch, kept, shrunk)
    extra = {ASPECT: getattr(cfg, ASPECT)} if kind == "llava_onevision" else {
        "vision_feature_select_strategy": getattr(cfg, "vision_feature_select_strategy", "default")}
    check_packing(model, lay, sizes[0], extra, name)
    ids = kwargs.get(IDS)
    image_token = cfg.image_token_id if getattr(cfg, "image_token_id", None) is not None else cfg.image_token_index
    if torch.is_tensor(ids):
        count = int((ids == image_token).sum())
        if count != lay.tokens:
            raise MethodError(f"{name}: the image needs {lay.tokens} placeholders (id {image_token}): the base "
                              f"image's {gh * gw}, the unpadded crops' "
                              + (f"(shrunk to {shrunk[0]}x{shrunk[1]}) " if shrunk else "")
                              + f"and one newline per row; the prompt holds {count}")
    return lay


def compose_pixels(pixels: torch.Tensor, lay: AnyresLayout) -> torch.Tensor:
    """[batch, rows·H, cols·W]: the crops of [batch, tiles, ...] put back together (the base image,
    tile 0, left out); the base image itself when the image is one tile."""
    if not lay.rows:
        return pixels[:, 0]
    b = pixels.shape[0]
    rest = pixels.shape[2:]
    crops = pixels[:, 1:].reshape(b, lay.rows, lay.cols, *rest)
    if len(rest) == 2:  # [b, r, c, H, W]
        return crops.permute(0, 1, 3, 2, 4).reshape(b, lay.rows * rest[0], lay.cols * rest[1])
    ch, h, w = rest  # [b, r, c, C, H, W]
    return crops.permute(0, 3, 1, 4, 2, 5).reshape(b, ch, lay.rows * h, lay.cols * w)


def token_patches(tokens: torch.Tensor, lay: AnyresLayout) -> Tuple[torch.Tensor, torch.Tensor]:
    """(crop patches [batch, rows·gh·cols·gw], base patches [batch, gh·gw]) from the image tokens'
    scores [batch, tokens] in order (base, then each row of crop tokens and its newline). A crop token
    of a shrunk grid (LLaVA-OneVision) spreads its score over the unpadded patches it interpolates, by
    their bilinear weights (:func:`relprop.models.anyres_packing.spread`; Σ unchanged)."""
    gh, gw = lay.tile_grid
    base = tokens[:, :gh * gw]
    if not lay.rows:
        return base, base
    oh, ow = lay.token_grid
    uh, uw = lay.kept.shape
    crops = spread(tokens[:, gh * gw:].reshape(-1, oh, ow + 1)[:, :, :ow], lay).reshape(tokens.shape[0], uh * uw)
    H, W = lay.grid
    out = tokens.new_zeros(tokens.shape[0], H * W)
    out[:, lay.kept.reshape(-1).to(tokens.device)] = crops
    return out, base


def compose(results, model, kwargs, primary: str) -> None:
    """Each Explanation of LLaVA-NeXT or LLaVA-OneVision placed on the image (module docstring)."""
    kind = model_kind(model)
    if kind is None or not torch.is_tensor(kwargs.get(PIXELS)):
        return
    lay = layout(model, kwargs)
    name, (gh, gw) = ANYRES[kind], lay.grid
    for exp in results:
        if primary == PIXELS and exp.input_relevance is not None and exp.input_relevance.dim() == 5:
            pixels = exp.input_relevance.sum(2)
            smap = compose_pixels(pixels, lay)
            p = lay.patch
            scores = smap.reshape(smap.shape[0], gh, p, gw, p).sum((2, 4)).reshape(smap.shape[0], gh * gw)
            exp.map, exp.scores, exp.grid, exp.modality = smap, scores, (gh, gw), "vision"
            exp.mask = torch.ones_like(scores, dtype=torch.bool)
            exp.image = compose_pixels(kwargs[PIXELS].detach().to("cpu", copy=True), lay)
            exp.streams = {**(exp.streams or {}), PIXELS: scores}
            if lay.rows:
                exp.streams[BASE] = pixels[:, 0]
            exp.notes.append(f"{name}: pixels and prompt explained in one run; exp.map is the {lay.rows}x{lay.cols} "
                             "crops put back together (the image as the processor resized and padded it), "
                             "exp.scores its sums per patch; the base image (the whole image squashed to one tile) "
                             "is kept apart in exp.streams['base_image'], not added into exp.map"
                             + (f"; the model shrinks the {lay.kept.shape[0]}x{lay.kept.shape[1]} unpadded crop "
                                f"patches to {lay.shrunk[0]}x{lay.shrunk[1]} tokens (bilinear interpolation, "
                                "vision_aspect_ratio), and relevance passed back through it by the preset's rule for "
                                "upsample_bilinear2d" if lay.shrunk else "")
                             if lay.rows else f"{name}: one tile (the base image alone) explained")
        elif primary == IDS and exp.scores.dim() == 2 and exp.scores.shape == kwargs[IDS].shape:
            ids = kwargs[IDS].to(exp.scores.device)
            cfg = model.config
            token = cfg.image_token_id if getattr(cfg, "image_token_id", None) is not None else cfg.image_token_index
            tokens = exp.scores[ids == token].reshape(exp.scores.shape[0], -1)
            crops, base = token_patches(tokens, lay)
            exp.streams = {IDS: exp.scores, PIXELS: crops}
            if lay.rows:
                exp.streams[BASE] = base
            exp.notes.append(f"{name}: the language model's blocks explained; each crop token's score placed on the "
                             f"{gh}x{gw} patch grid of the crops put back together (exp.streams['pixel_values']; "
                             "unpadded patches hold none"
                             + (f"; each of the {lay.shrunk[0]}x{lay.shrunk[1]} interpolated crop tokens spread over "
                                "the patches it interpolates by their bilinear weights" if lay.shrunk else "")
                             + "), each base-image token's on the base image's patches "
                             "(exp.streams['base_image']); the image_newline tokens hold no patch")
