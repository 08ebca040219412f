"""Qwen2-VL and Qwen2.5-VL: their flattened, 2x2-merged patches put back on the image, and the model
called on the image.

Their processor cuts an image of H x W pixels into a gh x gw grid of P x P patches (gh = H / P), copies
each patch ``temporal_patch_size`` times along a time axis (an image is a video of identical frames),
and writes the patches as rows of ``pixel_values`` [gh·gw, C·T·P·P] in the order of the 2x2 merge: the
m x m blocks of patches row-major over the (gh/m) x (gw/m) block grid, the patches of a block row-major
inside it (m = ``spatial_merge_size``). ``image_grid_thw`` = [[1, gh, gw]] says the sizes. The vision
tower packs the images of a batch into one sequence and splits its attention by ``cu_seqlens``
(Qwen2.5-VL: within windows of ``window_size`` pixels in most blocks); the merger turns each 2x2 block
into one image token; the language model reads them with 3-D rotary positions (``get_rope_index``).

relprop explains such a model through :class:`QwenImage`, a module that shares the unmodified model's
submodules and calls the model on one image given as pixels [1, C, H, W]: it cuts them into the processor's rows (views
only: reshape, permute, expand over the time axis) and passes the integer side-products the model
would compute from ``image_grid_thw`` with data-dependent Python (``.tolist()`` splits, loops over
the grid) precomputed, so that ``torch.export`` sees only fixed sizes: the vision tower's rotary
positions, ``cu_seqlens``, Qwen2.5-VL's window order and window bounds (transformers'
``vision_utils``), and the language model's 3-D positions (the model's own ``get_rope_index``). The
relevance of the pixels then flows back through the model's own graph and the cut, so each pixel
gets the relevance of its place in the image: the time axis's copies are summed by the rule of the
expansion (a copy's relevance goes back to its source).

The cut is checked on every call: the given rows are rebuilt from the image relprop reads out of them
and must be equal, element for element (which also checks that the time copies are equal, i.e. that
the rows are an image's, not a video's); otherwise relprop refuses.
"""
from __future__ import annotations

import functools
import weakref
from typing import Any, Dict, Mapping, Tuple

import torch

from ..errors import MethodError

#: config.model_type -> the family's name
QWEN = {"qwen2_vl": "Qwen2-VL", "qwen2_5_vl": "Qwen2.5-VL"}

#: the inputs the explained call takes besides the prompt's ids and mask
PIXELS, POSITIONS = "pixel_values", "rope_positions"

_WRAPPERS: "weakref.WeakKeyDictionary[torch.nn.Module, Dict[tuple, QwenImage]]" = weakref.WeakKeyDictionary()


def patch_layout(config) -> Tuple[int, int, int, int]:
    """(patch size P, temporal_patch_size T, spatial_merge_size m, channels C) of the vision tower."""
    v = config.vision_config
    return int(v.patch_size), int(v.temporal_patch_size), int(v.spatial_merge_size), int(v.in_channels)


def rows_of(images: torch.Tensor, config) -> torch.Tensor:
    """The processor's rows [b·gh·gw, C·T·P·P] of images [b, C, H, W] (module docstring: the m x m
    blocks row-major, the patches of a block row-major, each patch copied T times along time)."""
    p, t, m, _ = patch_layout(config)
    b, c, h, w = images.shape
    gh, gw = h // p, w // p
    x = images.reshape(b, c, gh // m, m, p, gw // m, m, p).permute(0, 2, 5, 3, 6, 1, 4, 7)
    x = x.unsqueeze(6).expand(-1, -1, -1, -1, -1, -1, t, -1, -1)
    return x.reshape(b * gh * gw, c * t * p * p)


def image_of(rows: torch.Tensor, grid: Tuple[int, int], config) -> torch.Tensor:
    """The image [1, C, gh·P, gw·P] whose rows (:func:`rows_of`) are ``rows`` [gh·gw, C·T·P·P]: the first
    time copy of each patch, put back at its place."""
    p, t, m, c = patch_layout(config)
    gh, gw = grid
    x = rows.reshape(gh // m, gw // m, m, m, c, t, p, p)[..., 0, :, :]  # [gh/m, gw/m, m, m, C, P, P]
    return x.permute(4, 0, 2, 5, 1, 3, 6).reshape(1, c, gh * p, gw * p)


class QwenImage(torch.nn.Module):
    """A Qwen2-VL / Qwen2.5-VL model called on one image of ``grid`` = (gh, gw) patches given as pixels
    [1, C, H, W] (module docstring). The model is not changed: this module shares its submodules (the
    same dict of children, so parameter names and module paths are the model's own) and refers to the
    model object weakly, so that caching it does not keep a model alive; ``layout`` (plain values) is
    everything its precomputed constants depend on."""

    #: torch.export at the given sizes only (the constants are those of one image of one grid)
    static_sizes_only = True

    def __init__(self, model: torch.nn.Module, grid: Tuple[int, int]):
        import numpy as np  # a dependency of transformers; relprop itself needs torch alone
        from transformers import vision_utils  # optional dependency (relprop[hf])

        super().__init__()
        object.__setattr__(self, "_modules", model._modules)  # the model's children, shared (not copied)
        self._model = weakref.ref(model)
        cfg = model.config
        p, t, m, c = patch_layout(cfg)
        self.layout = (model.config.model_type, int(grid[0]), int(grid[1]), p, t, m, c)
        thw = torch.tensor([[1, grid[0], grid[1]]])
        self._grid_thw = np.array(thw.tolist())  # numpy: the model's .tolist() and .prod() on it stay Python
        extra: Dict[str, Any] = {
            "image_position_ids": vision_utils.get_vision_position_ids(thw, m),
            "image_cu_seqlens": np.array(vision_utils.get_vision_cu_seqlens(thw).tolist()),
        }
        if cfg.model_type == "qwen2_5_vl":
            v = cfg.vision_config
            index, bounds = vision_utils.get_vision_window_index(thw, m, v.window_size, p)
            extra["image_window_index"] = index
            extra["image_cu_window_seqlens"] = np.array(bounds.tolist())
        self._extra = extra

    @property
    def config(self):
        """The held model's config."""
        return self._held().config

    def _held(self) -> torch.nn.Module:
        model = self._model()
        if model is None:  # cannot happen while relprop caches this module: its cache is keyed by the model
            raise MethodError("the Qwen-VL model this QwenImage called is gone")
        return model

    def forward(self, input_ids, pixel_values, rope_positions, attention_mask=None):
        """The held model's logits on the prompt ``input_ids`` and the image ``pixel_values`` [1, C, H, W],
        the language model's 3-D positions ``rope_positions`` [1, 3, tokens]."""
        model = self._held()
        extra = {k: v.to(pixel_values.device) if torch.is_tensor(v) else v for k, v in self._extra.items()}
        return model(input_ids=input_ids, attention_mask=attention_mask, pixel_values=rows_of(pixel_values,
                     model.config), image_grid_thw=self._grid_thw, position_ids=rope_positions.permute(1, 0, 2),
                     use_cache=False, **extra).logits


@functools.lru_cache(maxsize=None)
def _named(model_class: type) -> type:
    """A :class:`QwenImage` class named as ``model_class``, so that relprop's warnings and notes, which name
    the class of the module they explain, name the model the user gave."""
    return type(model_class.__name__, (QwenImage,), {"__module__": __name__, "__doc__": QwenImage.__doc__})


def wrapper(model: torch.nn.Module, grid: Tuple[int, int]) -> QwenImage:
    """The :class:`QwenImage` of ``model`` for images of ``grid`` (one per model and grid, so that its
    captured graph is reused)."""
    per_model = _WRAPPERS.setdefault(model, {})
    w = per_model.get(grid)
    if w is None:
        w = _named(type(model))(model, grid)
        _check_order(model, grid, w._extra["image_position_ids"])
        per_model[grid] = w
    return w


def _check_order(model, grid: Tuple[int, int], positions: torch.Tensor) -> None:
    """The vision tower's own (row, column) of each row (its 2-D rotary positions, transformers'
    ``get_vision_position_ids``) must be the patch :func:`rows_of` cut that row from; else refuse: relprop
    and the model would disagree on where a patch is."""
    p, _, _, c = patch_layout(model.config)
    gh, gw = grid
    where = torch.zeros(1, c, gh * p, gw * p, dtype=torch.long)
    where[0, 0] = torch.arange(gh).repeat_interleave(p)[:, None]
    where[0, 1 % c] = torch.arange(gw).repeat_interleave(p)[None, :]
    rows = rows_of(where, model.config).reshape(gh * gw, c, -1)[:, :2, 0]
    if positions.shape != rows.shape or not torch.equal(positions.to(rows.dtype), rows):
        raise _refuse(model, f"the vision tower's rotary positions of the {gh}x{gw} patches do not follow the "
                      "processor's 2x2-merged patch order that relprop reads the rows in, so it cannot say which "
                      "patch each row is")


def _refuse(model, why: str) -> MethodError:
    name = QWEN.get(getattr(model.config, "model_type", None), "Qwen-VL")
    return MethodError(f"{type(model).__name__} ({name}): {why}")


def adapt(model: torch.nn.Module, inputs: Mapping[str, Any]):
    """(the :class:`QwenImage` of ``model``, its inputs) for the processor's outputs ``inputs`` of one
    prompt with one image: the image read back from the rows and checked (module docstring), the
    language model's 3-D positions from the model's ``get_rope_index`` (unless ``position_ids`` are
    given).

    Raises
    ------
    MethodError
        a batch of several prompts (``relprop.explain`` cuts a batch into its samples first:
        :mod:`relprop.models.vlm_batches`), several images, a video, or rows that are not the cut of an image
        with the config's patch layout.
    """
    cfg = model.config
    ids, rows, thw = inputs.get("input_ids"), inputs.get(PIXELS), inputs.get("image_grid_thw")
    known = {"input_ids", "attention_mask", PIXELS, "image_grid_thw", "mm_token_type_ids", "position_ids"}
    extra = sorted(k for k, v in inputs.items() if k not in known and v is not None)
    if extra:
        raise _refuse(model, f"relprop explains a prompt with one image; it does not take {extra} (videos, "
                      "precomputed features)")
    if not torch.is_tensor(ids) or ids.dim() != 2 or not torch.is_tensor(thw):
        raise _refuse(model, "pass the processor's input_ids, pixel_values and image_grid_thw")
    if ids.shape[0] != 1:
        raise _refuse(model, f"a batch of {ids.shape[0]} prompts: explain one prompt with its image per call. The "
                      "vision tower packs a batch's images into one sequence of patches (split by cu_seqlens), "
                      "whose rows relprop's per-sample conservation ledger cannot assign to their samples")
    if thw.shape != (1, 3) or int(thw[0, 0]) != 1:
        raise _refuse(model, f"image_grid_thw {thw.tolist()}: relprop explains exactly one image (one frame) per "
                      "prompt")
    p, t, m, c = patch_layout(cfg)
    gh, gw = int(thw[0, 1]), int(thw[0, 2])
    if gh % m or gw % m or tuple(rows.shape) != (gh * gw, c * t * p * p):
        raise _refuse(model, f"pixel_values {tuple(rows.shape)} are not the rows of a {gh}x{gw} grid of patches "
                      f"(expected ({gh * gw}, {c * t * p * p}) with {m}x{m} merges)")
    image = image_of(rows, (gh, gw), cfg)
    if not torch.equal(rows_of(image, cfg), rows):
        raise _refuse(model, "pixel_values are not the cut of one image: the time copies of a patch differ (a "
                      "video's frames?), so relprop cannot place them on one image")
    tokens = gh * gw // (m * m)
    n = int((ids == cfg.image_token_id).sum())
    if n != tokens:
        raise _refuse(model, f"the prompt holds {n} image placeholders (id {cfg.image_token_id}) and the image makes "
                      f"{tokens} image tokens")
    mask = inputs.get("attention_mask")
    positions = inputs.get("position_ids")
    if positions is None:
        types = inputs.get("mm_token_type_ids")
        if types is None:
            types = (ids == cfg.image_token_id).int()
        with torch.no_grad():
            positions, _ = model.model.get_rope_index(ids, types, thw, attention_mask=mask)
    out = {"input_ids": ids, PIXELS: image.to(rows.dtype), POSITIONS: positions.permute(1, 0, 2).contiguous()}
    if mask is not None:
        out["attention_mask"] = mask
    return wrapper(model, (gh, gw)), out


def explained_call(model: torch.nn.Module, inputs: Any):
    """(model, inputs) as relprop captures them: a Qwen2-VL / Qwen2.5-VL model called with an image
    (``pixel_values``) becomes its :class:`QwenImage` with the image read back (:func:`adapt`); anything
    else is returned as given."""
    kind = getattr(getattr(model, "config", None), "model_type", None)
    if kind in QWEN and getattr(model.config, "vision_config", None) is not None and isinstance(inputs, Mapping) \
            and torch.is_tensor(inputs.get(PIXELS)):
        return adapt(model, inputs)
    return model, inputs
