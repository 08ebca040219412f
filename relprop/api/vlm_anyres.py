"""LLaVA-NeXT's any-resolution tiles: the crops composed back into one map, the base image kept apart.

LLaVA-NeXT's image processor picks, from ``config.image_grid_pinpoints``, the resolution that fits the
image best (``rows x cols`` tiles of the vision tower's size), resizes the image into it keeping its
aspect, pads it to the centre, and cuts it into ``rows x cols`` **crops**; before them it puts the
**base image**, the whole image resized to one tile: ``pixel_values`` is ``[batch, 1 + rows·cols, C,
H, W]`` and ``image_sizes`` the original (height, width). The model runs each tile through the vision
tower, lays the crops' patch features out as one ``rows·gh x cols·gw`` grid, **unpads** it (drops the
rows or columns of patches that the padding added, computed from ``image_sizes``), appends an
``image_newline`` token after each row, and puts the base image's ``gh·gw`` tokens first.

relprop takes the layout from the model's own functions (``get_anyres_image_grid_shape`` and
``unpad_image`` of transformers, run on patch indices), so each image token's patch is the model's.
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
* **Tokens** (rollouts): a crop token's score goes to the patch of the composed grid it came from
  (the unpadded rows or columns hold none), a base-image token's to its patch of the base image
  (``exp.streams["base_image"]``, ``[batch, gh·gw]``); the ``image_newline`` tokens hold no patch.

Refused with a :class:`relprop.MethodError`: a batch of more than one sample (the vision tower's rows
are all samples' tiles, which a static capture cannot attribute per sample: explain one at a time),
no ``image_sizes``, a number of tiles other than the pinpoint grid's, ``"full"`` vision features (a
class token per tile), and a prompt whose placeholder count is not the image's token count.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Tuple

import torch

from ..errors import MethodError

#: config.model_type of the any-resolution families explained here -> their name
ANYRES = {"llava_next": "LLaVA-NeXT"}
PIXELS, IDS, SIZES, BASE = "pixel_values", "input_ids", "image_sizes", "base_image"


@dataclasses.dataclass(frozen=True)
class AnyresLayout:
    """``rows x cols`` crops of ``size`` pixels in ``patch``-pixel patches; ``kept``: the composed
    grid's patch index (row-major over ``rows·gh x cols·gw``) of each crop token after unpadding,
    ``[uh, uw]`` (empty when the image is one tile)."""

    rows: int
    cols: int
    size: Tuple[int, int]
    patch: int
    kept: torch.Tensor

    @property
    def tile_grid(self) -> Tuple[int, int]:
        return self.size[0] // self.patch, self.size[1] // self.patch

    @property
    def grid(self) -> Tuple[int, int]:
        gh, gw = self.tile_grid
        return (gh * self.rows, gw * self.cols) if self.rows else (gh, gw)

    @property
    def tokens(self) -> int:
        """Image tokens of the image: the base image's, the crops' after unpadding and one newline
        per row (one newline for an image of one tile)."""
        gh, gw = self.tile_grid
        if not self.rows:
            return gh * gw + 1
        uh, uw = self.kept.shape
        return gh * gw + uh * (uw + 1)


def model_kind(model: Any):
    kind = getattr(getattr(model, "config", None), "model_type", None)
    return kind if kind in ANYRES else None


def _sizes(v: Any):
    if torch.is_tensor(v):
        v = v.tolist()
    try:
        return [[int(x) for x in row] for row in v]
    except (TypeError, ValueError):
        raise MethodError(f"image_sizes = {v!r}: LLaVA-NeXT reads one (height, width) per image") from None


def plain_sizes(model: Any, inputs: Any):
    """The inputs with ``image_sizes`` as plain ints (module docstring), after :func:`layout` checked
    them; unchanged for another model or inputs without pixels."""
    if model_kind(model) is None or not isinstance(inputs, Mapping) or not torch.is_tensor(inputs.get(PIXELS)):
        return inputs
    layout(model, inputs)
    return {**inputs, SIZES: _sizes(inputs[SIZES])}


def layout(model: Any, kwargs: Mapping[str, Any]) -> AnyresLayout:
    """The :class:`AnyresLayout` of the inputs, checked against them (module docstring).

    Raises
    ------
    MethodError
        what is missing or does not fit (module docstring's list).
    """
    from transformers.models.llava_next.modeling_llava_next import get_anyres_image_grid_shape, unpad_image

    cfg, name = model.config, ANYRES[model.config.model_type]
    pv = kwargs[PIXELS]
    if pv.dim() != 5 or int(pv.shape[0]) != 1:
        raise MethodError(f"{name}: pixel_values of shape {tuple(pv.shape)}; relprop explains one sample at a time "
                          "([1, tiles, channels, H, W]): the vision tower's rows are all samples' tiles, which its "
                          "static capture cannot attribute per sample")
    if kwargs.get(SIZES) is None:
        raise MethodError(f"{name}: no image_sizes, so the tile grid and the unpadding are not known")
    sizes = _sizes(kwargs[SIZES])
    if len(sizes) != 1 or len(sizes[0]) != 2:
        raise MethodError(f"{name}: image_sizes = {sizes}: one (height, width) for the one image")
    if getattr(cfg, "vision_feature_select_strategy", "default") != "default":
        raise MethodError(f"{name}: vision_feature_select_strategy={cfg.vision_feature_select_strategy!r} keeps a "
                          "class token per tile, which relprop does not place; supported: 'default'")
    v = cfg.vision_config
    tile, patch = int(v.image_size), int(v.patch_size)
    rows, cols = get_anyres_image_grid_shape(sizes[0], cfg.image_grid_pinpoints, tile)
    n = int(pv.shape[1])
    gh = gw = tile // patch
    if n == 1:
        rows = cols = 0
        kept = torch.zeros(0, 0, dtype=torch.long)
    elif n != rows * cols + 1:
        raise MethodError(f"{name}: an image of {sizes[0][0]}x{sizes[0][1]} pixels is cut into {rows}x{cols} tiles "
                          f"by the pinpoints of its config, and a base image: {rows * cols + 1} tiles; pixel_values "
                          f"holds {n}")
    else:
        index = torch.arange(rows * gh * cols * gw).reshape(1, rows * gh, cols * gw)
        kept = unpad_image(index, sizes[0])[0]
    lay = AnyresLayout(rows, cols, (int(pv.shape[-2]), int(pv.shape[-1])), patch, kept)
    ids = kwargs.get(IDS)
    image_token = cfg.image_token_id if getattr(cfg, "image_token_id", None) is not None else cfg.image_token_index
    if torch.is_tensor(ids):
        count = int((ids == image_token).sum())
        if count != lay.tokens:
            raise MethodError(f"{name}: the image needs {lay.tokens} placeholders (id {image_token}): the base "
                              f"image's {gh * gw}, the unpadded crops' and one newline per row; the prompt holds "
                              f"{count}")
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
    scores [batch, tokens] in order (base, then each unpadded row of crop tokens and its newline)."""
    gh, gw = lay.tile_grid
    base = tokens[:, :gh * gw]
    if not lay.rows:
        return base, base
    uh, uw = lay.kept.shape
    crops = tokens[:, gh * gw:].reshape(-1, uh, uw + 1)[:, :, :uw].reshape(tokens.shape[0], uh * uw)
    H, W = lay.grid
    out = tokens.new_zeros(tokens.shape[0], H * W)
    out[:, lay.kept.reshape(-1).to(tokens.device)] = crops
    return out, base


def compose(results, model, kwargs, primary: str) -> None:
    """Each Explanation of LLaVA-NeXT placed on the image (module docstring)."""
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
                             "unpadded patches hold none), each base-image token's on the base image's patches "
                             "(exp.streams['base_image']); the image_newline tokens hold no patch")
