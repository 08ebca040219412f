"""Vision-language models that cut the image into tiles (Idefics3, SmolVLM): the tiles composed back into one map.

Idefics3's and SmolVLM's image processor resizes the image to ``rows x cols`` tiles of the vision
tower's size, cuts them out row by row, and appends the whole image downscaled to one tile (the
**global image**): ``pixel_values`` is ``[batch, rows·cols + 1, C, H, W]``, tiles first, the global
image last (one image of one tile: ``rows = cols = 0``, the global image alone). Each tile runs through
the vision tower on its own; the connector's **pixel shuffle** (``scale_factor`` s) merges each s x s
cell of the tile's patch grid into one image token, row-major, and the image tokens of the tiles and
then of the global image fill the prompt's placeholders in order.

The processor drops ``rows`` and ``cols`` from its output, and no input or config says them (7 images
are 2 x 3 or 3 x 2 tiles), so relprop reads them from ``inputs["rows"]`` and ``inputs["cols"]`` (what
the image processor returns with ``return_row_col_info=True``; taken out before the model is called)
and refuses a tiled image without them.

* **Pixels** (``lrp`` and the other methods that read the input relevance): relevance reaches every
  tile's pixels and the global image's through the vision tower. ``exp.map`` is ``[batch, rows·H,
  cols·W]``: each tile's pixel relevance (summed over colours) at its place, plus the global image's
  relevance spread evenly over the ``rows x cols`` pixels of the map each of its pixels covers (its
  sum unchanged). ``exp.streams["global_image"]`` is the global image's own ``[batch, H, W]`` share (a
  part of ``exp.map``, not an addition to it); ``exp.scores`` and ``exp.streams["pixel_values"]`` are
  ``exp.map`` summed per patch of the composed grid (``exp.grid`` = ``(rows·H/p, cols·W/p)``).
  ``exp.input_relevance`` stays the pixels' relevance as the model read them (``[batch, images, C,
  H, W]``), which the ledger counts: Σ pixels + Σ prompt + absorbed = the score; Σ ``exp.map`` = Σ
  pixels. ``exp.image`` is the tiles put back together (what ``exp.overlay()`` draws the map on).
* **Tokens** (rollouts on the language model's blocks): each image placeholder's score goes to the
  s x s patches of its tile that its pixel shuffle merged; a global-image token's to the (s·rows) x
  (s·cols) patches of the composed grid those patches cover; evenly (Σ patch scores = Σ image-token
  scores). Text tokens between the tiles (``<row_1_col_1>``, newlines) are not image placeholders
  and hold no patch.

Refused, with a :class:`relprop.MethodError` saying what is missing: a tiled image without
``rows``/``cols``, ``rows·cols + 1`` not the number of images, samples with different tile grids, a
padding image (all zeros: the model drops it, so samples with different numbers of tiles, which are
explained one at a time), a ``pixel_attention_mask`` that masks pixels (images padded to another's
size), and a prompt whose placeholder count is not the images' token count.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional, Tuple

import torch

from ..errors import MethodError

#: config.model_type of the tiled families explained here -> their name
TILED = {"idefics3": "Idefics3", "smolvlm": "SmolVLM"}
#: the input keys of the tile grid (the image processor's ``return_row_col_info=True`` output)
GRID_KEYS = ("rows", "cols")
PIXELS, IDS, GLOBAL = "pixel_values", "input_ids", "global_image"


@dataclasses.dataclass(frozen=True)
class TileLayout:
    """Where a tiled model's image tokens and pixels sit: ``rows x cols`` tiles (0 x 0: the global
    image alone) of ``size`` (H, W) pixels and ``patch`` pixels per patch, ``shuffle`` s (s x s
    patches per image token)."""

    rows: int
    cols: int
    size: Tuple[int, int]
    patch: int
    shuffle: int

    @property
    def images(self) -> int:
        return self.rows * self.cols + 1

    @property
    def tile_grid(self) -> Tuple[int, int]:
        """The patch grid of one tile."""
        return self.size[0] // self.patch, self.size[1] // self.patch

    @property
    def canvas(self) -> Tuple[int, int]:
        """The tiles' rows and columns of the composed map (1 x 1 for the global image alone)."""
        return max(self.rows, 1), max(self.cols, 1)

    @property
    def grid(self) -> Tuple[int, int]:
        """The patch grid of the composed map."""
        (gh, gw), (r, c) = self.tile_grid, self.canvas
        return gh * r, gw * c

    @property
    def tokens_per_image(self) -> int:
        gh, gw = self.tile_grid
        return (gh // self.shuffle) * (gw // self.shuffle)


def model_kind(model: Any) -> Optional[str]:
    """``config.model_type`` when ``model`` is a tiled vision-language model (:data:`TILED`), else None."""
    kind = getattr(getattr(model, "config", None), "model_type", None)
    return kind if kind in TILED else None


def _grid_value(v: Any, key: str) -> int:
    """One int from an image processor's ``rows``/``cols`` (an int, a tensor, a list per sample of
    lists per image); the same for every sample."""
    if torch.is_tensor(v):
        v = v.tolist()
    flat = []
    stack = [v]
    while stack:
        x = stack.pop()
        if isinstance(x, (list, tuple)):
            stack.extend(x)
        else:
            flat.append(x)
    if not flat or not all(isinstance(x, int) and x >= 0 for x in flat):
        raise MethodError(f"inputs[{key!r}] = {v!r}: the tile grid needs a non-negative int (or one per sample, as the "
                          "image processor returns with return_row_col_info=True)")
    if len(set(flat)) != 1:
        raise MethodError(f"inputs[{key!r}] = {v!r}: the samples' images are cut into different tile grids, whose maps "
                          "cannot be stacked; explain them one at a time")
    return flat[0]


def split_grid_keys(model: Any, inputs: Any):
    """(the inputs without ``rows``/``cols``, (rows, cols) or None) for a tiled model; the inputs
    unchanged and None for another model."""
    if model_kind(model) is None or not isinstance(inputs, Mapping) or not any(k in inputs for k in GRID_KEYS):
        return inputs, None
    missing = [k for k in GRID_KEYS if k not in inputs]
    if missing:
        raise MethodError(f"inputs has {[k for k in GRID_KEYS if k in inputs]} but not {missing}: the tile grid needs "
                          "both rows and cols")
    grid = tuple(_grid_value(inputs[k], k) for k in GRID_KEYS)
    return {k: v for k, v in inputs.items() if k not in GRID_KEYS}, grid


def layout(model: Any, kwargs: Mapping[str, Any], grid: Optional[Tuple[int, int]]) -> TileLayout:
    """The :class:`TileLayout` of a tiled model's inputs, checked against them (module docstring).

    Raises
    ------
    MethodError
        what is missing or does not fit (module docstring's list).
    """
    name = TILED[model.config.model_type]
    pv = kwargs[PIXELS]
    if pv.dim() != 5:
        raise MethodError(f"{name}: pixel_values of shape {tuple(pv.shape)}; the tiles are read from "
                          "[batch, images, channels, H, W] (the image processor's output)")
    n = int(pv.shape[1])
    if grid is None:
        if n != 1:
            raise MethodError(f"{name}: pixel_values holds {n} images per sample, the tiles of an image cut into "
                              "rows x cols and its global image, and nothing says rows and cols (the processor drops "
                              "them), so relprop cannot place the tiles on the image. Pass inputs['rows'] and "
                              "inputs['cols'] "
                              "(the image processor's output with return_row_col_info=True)")
        grid = (0, 0)
    rows, cols = grid
    if (rows == 0) != (cols == 0) or rows * cols + 1 != n:
        raise MethodError(f"{name}: {rows} x {cols} tiles and a global image are {rows * cols + 1} images, and "
                          f"pixel_values holds {n} per sample")
    if bool(((pv == 0).flatten(2).all(2)).any()):
        raise MethodError(f"{name}: an image of pixel_values is all zeros, which the model drops as padding (samples "
                          "with different numbers of tiles): explain the samples one at a time")
    mask = kwargs.get("pixel_attention_mask")
    if torch.is_tensor(mask) and not bool(mask.bool().all()):
        raise MethodError(f"{name}: pixel_attention_mask masks pixels (images padded to another's size), so the tiles "
                          "do not cover the image as the grid says: explain the samples one at a time")
    v = model.config.vision_config
    out = TileLayout(rows, cols, (int(pv.shape[-2]), int(pv.shape[-1])), int(v.patch_size),
                     int(model.config.scale_factor))
    ids = kwargs.get(IDS)
    if torch.is_tensor(ids):
        counts = (ids == model.config.image_token_id).sum(1)
        want = n * out.tokens_per_image
        if not bool((counts == want).all()):
            raise MethodError(f"{name}: every sample must hold {want} image placeholders ({n} images of "
                              f"{out.tokens_per_image} tokens, id {model.config.image_token_id}); found "
                              f"{counts.tolist()}")
    return out


def check(model: Any, inputs: Any, grid: Optional[Tuple[int, int]]) -> None:
    """Refuse, before any work, the inputs of a tiled model whose tile layout relprop cannot verify
    (:func:`layout`); nothing for other models or inputs without pixels."""
    if model_kind(model) is not None and isinstance(inputs, Mapping) and torch.is_tensor(inputs.get(PIXELS)):
        layout(model, inputs, grid)


def compose_pixels(pixels: torch.Tensor, lay: TileLayout) -> Tuple[torch.Tensor, torch.Tensor]:
    """(map [batch, rows·H, cols·W], global image's map [batch, H, W]) from per-pixel relevance
    [batch, images, H, W]: the tiles at their places plus the global image spread evenly over the
    pixels each of its pixels covers (module docstring)."""
    b, _, h, w = pixels.shape
    glob = pixels[:, -1]
    if lay.rows == 0:
        return glob, glob
    r, c = lay.rows, lay.cols
    tiles = pixels[:, :-1].reshape(b, r, c, h, w).permute(0, 1, 3, 2, 4).reshape(b, r * h, c * w)
    spread = glob.repeat_interleave(r, 1).repeat_interleave(c, 2) / (r * c)
    return tiles + spread, glob


def compose_image(pixel_values: torch.Tensor, lay: TileLayout) -> torch.Tensor:
    """[batch, C, rows·H, cols·W]: the tiles of ``pixel_values`` [batch, images, C, H, W] put back
    together (the image as the processor resized it; the global image alone when it is not split),
    the picture ``exp.overlay()`` draws the map on."""
    pv = pixel_values.detach().to("cpu", copy=True)
    if lay.rows == 0:
        return pv[:, -1]
    b, _, ch, h, w = pv.shape
    r, c = lay.rows, lay.cols
    return pv[:, :-1].reshape(b, r, c, ch, h, w).permute(0, 3, 1, 4, 2, 5).reshape(b, ch, r * h, c * w)


def token_placement(lay: TileLayout, dtype=torch.float32) -> torch.Tensor:
    """[images·tokens per image, gh·gw] of the composed patch grid (row-major): row k holds where image
    token k's score goes, evenly (each row sums to 1; module docstring)."""
    gh, gw = lay.tile_grid
    s = lay.shuffle
    n_r, n_c = gh // s, gw // s
    (r, c), (H, W) = lay.canvas, lay.grid
    out = torch.zeros(lay.images * n_r * n_c, H, W, dtype=dtype)
    for i in range(lay.images):
        is_global = i == lay.images - 1
        for t in range(n_r * n_c):
            tr, tc = divmod(t, n_c)
            k = i * n_r * n_c + t
            if is_global:  # its s x s patches cover (s·rows) x (s·cols) patches of the composed grid
                out[k, tr * s * r:(tr + 1) * s * r, tc * s * c:(tc + 1) * s * c] = 1.0
            else:
                y, x = divmod(i, c)
                out[k, y * gh + tr * s:y * gh + (tr + 1) * s, x * gw + tc * s:x * gw + (tc + 1) * s] = 1.0
            out[k] /= out[k].sum()
    return out.reshape(out.shape[0], H * W)


def compose(results, model, kwargs, primary: str, grid: Optional[Tuple[int, int]]) -> None:
    """Each Explanation of a tiled model placed on the composed image (module docstring): explained
    onto the pixels, its map, patch scores and grid; onto the language model's tokens, its image
    placeholders' scores on the composed patch grid (``exp.streams["pixel_values"]``)."""
    kind = model_kind(model)
    if kind is None or not torch.is_tensor(kwargs.get(PIXELS)):
        return
    lay = layout(model, kwargs, grid)
    name = TILED[kind]
    how = (f"the {lay.rows}x{lay.cols} tiles at their places plus the global image's relevance spread evenly over "
           f"the {lay.rows}x{lay.cols} pixels each of its pixels covers (its own map: exp.streams['global_image'])"
           if lay.rows else "one image, not cut into tiles")
    gh, gw = lay.grid
    for exp in results:
        if primary == PIXELS and exp.input_relevance is not None and exp.input_relevance.dim() == 5:
            smap, glob = compose_pixels(exp.input_relevance.sum(2), lay)
            p = lay.patch
            scores = smap.reshape(smap.shape[0], gh, p, gw, p).sum((2, 4)).reshape(smap.shape[0], gh * gw)
            exp.map, exp.scores, exp.grid, exp.modality = smap, scores, (gh, gw), "vision"
            exp.image = compose_image(kwargs[PIXELS], lay)
            exp.mask = torch.ones_like(scores, dtype=torch.bool)
            exp.streams = {**(exp.streams or {}), PIXELS: scores, GLOBAL: glob}
            exp.notes.append(f"{name}: pixels and prompt explained in one run; exp.map is the image's map composed "
                             f"from {how}; exp.scores/exp.streams['pixel_values'] its sums per patch of the {gh}x{gw} "
                             "grid; exp.streams['input_ids'] the prompt tokens' (0 at the image placeholders); "
                             "exp.input_relevance the pixels as the model read them [batch, images, C, H, W]")
        elif primary == IDS and exp.scores.dim() == 2 and exp.scores.shape == kwargs[IDS].shape:
            ids = kwargs[IDS].to(exp.scores.device)
            at = ids == model.config.image_token_id
            tokens = exp.scores[at].reshape(exp.scores.shape[0], -1)
            place = token_placement(lay, tokens.dtype).to(tokens.device)
            exp.streams = {IDS: exp.scores, PIXELS: tokens @ place}
            exp.notes.append(f"{name}: the language model's blocks explained; each image placeholder's score placed "
                             f"on the {gh}x{gw} patch grid of the composed image (exp.streams['pixel_values'], "
                             f"row-major): a tile's token over the {lay.shuffle}x{lay.shuffle} patches its pixel "
                             f"shuffle merged, a global-image token over the patches they cover, evenly")
