"""A batch of several prompts for the vision-language families relprop explains one sample per call:
Qwen2-VL and Qwen2.5-VL (:mod:`relprop.models.qwen_images`: the vision tower packs all images into one
sequence), LLaVA-NeXT and LLaVA-OneVision (:mod:`relprop.models.vlm_anyres`: the vision tower's rows are
all samples' tiles). ``relprop.explain`` explains such a batch **sample by sample**:

1. each sample is cut out of the batch as the processor would have made it alone: its positions without
   the padding (left or right: the ones of its ``attention_mask``) of ``input_ids``, ``attention_mask``
   and ``mm_token_type_ids``; Qwen: its rows of ``pixel_values`` (``image_grid_thw``'s t·h·w rows per
   image, in order) and its ``image_grid_thw`` row; LLaVA-NeXT / -OneVision: its tiles (as many as its
   ``image_sizes`` row makes, the processor's zero tiles of the padding left out) and its
   ``image_sizes`` row. ``target=`` and ``special_tokens_mask=`` are cut alike (one per sample, or
   the same for all);
2. the cut is **checked**: the model's logits on the sample alone must equal the batch's logits of that
   row at the sample's positions (to float tolerance), else relprop refuses (the batch computes
   something else for that row than the sample alone, e.g. left padding that shifts the language
   model's positions);
3. each sample is explained alone by the one-sample path, and the Explanations are put back into one
   batch Explanation (:func:`relprop.explanation.joined.join`): per-token fields on the batch's padded
   positions (0 at the padding, ``mask`` False), per-pixel and per-patch fields stacked.

Samples whose images make different grids (per-pixel maps of different shapes) cannot be stacked and
are refused before any work: explain each prompt with its own call.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
from typing import Any, List, Mapping, Optional, Tuple

import torch

from ..errors import MethodError
from ..explanation.joined import join
from ..targets import Contrast, NextToken, PredictedNextToken
from .qwen_images import QWEN
from .vlm_anyres import ANYRES

#: config.model_type -> name of the families whose batches are explained sample by sample
FAMILIES = {**QWEN, **ANYRES}
IDS, MASK, TYPES, PIXELS, THW, SIZES = ("input_ids", "attention_mask", "mm_token_type_ids", "pixel_values",
                                        "image_grid_thw", "image_sizes")
_PER_TOKEN = (IDS, MASK, TYPES)
_KNOWN = {**{k: {IDS, MASK, TYPES, PIXELS, THW} for k in QWEN},
          **{k: {IDS, MASK, PIXELS, SIZES} for k in ANYRES},
          "llava_onevision": {IDS, MASK, PIXELS, SIZES, "batch_num_images", "vision_aspect_ratio"}}
#: the any-resolution families' modelling modules (their get_anyres_image_grid_shape, image_size_to_num_patches)
_MODELLING = {"llava_next": "transformers.models.llava_next.modeling_llava_next",
              "llava_onevision": "transformers.models.llava_onevision.modeling_llava_onevision"}
#: relative tolerance of the check of a cut sample against its row of the batch (float32 logits)
RTOL = 1e-4


@dataclasses.dataclass
class Sample:
    """One sample cut out of a batch: its inputs as the processor makes them alone, the batch positions
    of its positions (``keep``), its ``target`` and ``special_tokens_mask``."""

    inputs: dict
    keep: torch.Tensor
    target: Any = None
    special_tokens_mask: Optional[torch.Tensor] = None


def kind(model: Any) -> Optional[str]:
    """The model's family (``config.model_type``) when it is one explained here, else None."""
    cfg = getattr(model, "config", None)
    k = getattr(cfg, "model_type", None)
    return k if k in FAMILIES and getattr(cfg, "vision_config", None) is not None else None


def is_batch(model: Any, inputs: Any) -> bool:
    """True for the processor's outputs of several prompts with images for a family explained here."""
    if kind(model) is None or not isinstance(inputs, Mapping) or not torch.is_tensor(inputs.get(PIXELS)):
        return False
    ids = inputs.get(IDS)
    return torch.is_tensor(ids) and ids.dim() == 2 and ids.shape[0] > 1


def _refuse(model, why: str) -> MethodError:
    return MethodError(f"{type(model).__name__} ({FAMILIES[kind(model)]}), a batch of prompts: {why}")


def _positions(mask: Optional[torch.Tensor], i: int, length: int, model) -> torch.Tensor:
    """The batch positions of sample i: the ones of its attention mask, one run (left or right padding)."""
    if mask is None:
        return torch.arange(length)
    keep = torch.nonzero(mask[i].to("cpu") != 0).reshape(-1)
    if keep.numel() == 0 or not torch.equal(keep, torch.arange(int(keep[0]), int(keep[-1]) + 1)):
        raise _refuse(model, f"the attention_mask of sample {i} is not one run of ones (padding on the left or "
                      "the right only), so relprop cannot cut the sample out")
    return keep


def _image_parts(model, inputs: Mapping, n: int) -> List[dict]:
    """Each sample's image inputs (module docstring); refuses a batch whose images make different grids."""
    k = kind(model)
    pixels = inputs[PIXELS]
    if k in QWEN:
        thw = inputs.get(THW)
        if not torch.is_tensor(thw) or thw.dim() != 2 or thw.shape[0] != n:
            raise _refuse(model, f"image_grid_thw {None if thw is None else tuple(thw.shape)} does not give one image "
                          f"per prompt for the {n} prompts; relprop explains one image per prompt")
        if not bool((thw == thw[:1]).all()):
            raise _refuse(model, f"the images make different grids ({thw.tolist()}), so their per-pixel maps cannot "
                          "be stacked into one batch: explain each prompt with its image in its own relprop.explain "
                          "call")
        rows = thw.prod(1).tolist()
        if sum(rows) != pixels.shape[0]:
            raise _refuse(model, f"pixel_values has {pixels.shape[0]} rows, image_grid_thw makes {sum(rows)}")
        starts = [sum(rows[:i]) for i in range(n)]
        return [{PIXELS: pixels[s:s + r], THW: thw[i:i + 1]} for i, (s, r) in enumerate(zip(starts, rows))]
    sizes = inputs.get(SIZES)
    if sizes is None or pixels.dim() != 5 or pixels.shape[0] != n or len(sizes) != n:
        raise _refuse(model, f"pixel_values {tuple(pixels.shape)} and image_sizes must give one image per prompt for "
                      f"the {n} prompts")
    family = importlib.import_module(_MODELLING[k])
    cfg = model.config
    tile = int(cfg.vision_config.image_size)
    size_rows = [[int(x) for x in r] for r in (sizes.tolist() if torch.is_tensor(sizes) else sizes)]
    grids = [tuple(family.get_anyres_image_grid_shape(s, cfg.image_grid_pinpoints, tile)) for s in size_rows]
    if len(set(grids)) != 1:
        raise _refuse(model, f"the images are cut into different crop grids ({grids} tiles for image_sizes "
                      f"{size_rows}), so their per-pixel maps cannot be stacked into one batch: explain each prompt "
                      "with its image in its own relprop.explain call")
    tiles = [family.image_size_to_num_patches(s, cfg.image_grid_pinpoints, tile) for s in size_rows]
    parts = [{PIXELS: pixels[i:i + 1, :t], SIZES: sizes[i:i + 1] if torch.is_tensor(sizes) else [size_rows[i]]}
             for i, t in enumerate(tiles)]
    per_prompt = inputs.get("batch_num_images")
    if per_prompt is not None:
        if torch.as_tensor(per_prompt).reshape(-1).tolist() != [1] * n:
            raise _refuse(model, f"batch_num_images = {per_prompt!r}: relprop explains one image per prompt")
        for p in parts:
            p["batch_num_images"] = torch.ones(1, dtype=torch.long)
    if "vision_aspect_ratio" in inputs:
        for p in parts:
            p["vision_aspect_ratio"] = inputs["vision_aspect_ratio"]
    return parts


def _one(value: Any, i: int, n: int) -> Any:
    """Sample i's part of a per-sample value (a tensor or list of n), else the value itself."""
    if torch.is_tensor(value) and value.dim() >= 1 and value.shape[0] == n:
        return value[i:i + 1]
    if isinstance(value, (list, tuple)) and len(value) == n:
        return [value[i]]
    return value


def target_of(target: Any, i: int, n: int, model) -> Any:
    """Sample i's ``target=`` (module docstring): one per sample cut, a next-token target for the sample
    without the batch's mask (the sample has no padding), the same target for all kept."""
    if isinstance(target, Contrast):
        return Contrast(target_of(target.a, i, n, model), target_of(target.b, i, n, model))
    if isinstance(target, PredictedNextToken):
        return PredictedNextToken()
    if isinstance(target, NextToken):
        return NextToken(None, _one(target.token, i, n))
    if callable(target):
        raise _refuse(model, "a callable target= reads the batch's outputs, which relprop cannot cut per sample "
                      "(each sample is explained alone): give the target as indices, token ids, 'next_token', "
                      "relprop.next_token(...) or relprop.contrast(...), or explain each prompt in its own call")
    return _one(target, i, n)


@contextlib.contextmanager
def _left_as_it_was(model):
    """The model's eager forward changes it on the way: Qwen-VL caches ``rope_deltas`` on its inner model,
    transformers installs output-capturing hooks on the first call (and marks the modules). Afterwards every
    module's attributes and hooks are put back as they were (attributes added removed, values restored,
    hook dicts emptied of the hooks added), so that the model is left untouched."""
    held = []
    for m in model.modules():
        hooks = {k: dict(v) for k, v in m.__dict__.items() if k.endswith("hooks") and isinstance(v, dict)}
        held.append((m, dict(m.__dict__), hooks))
    try:
        yield
    finally:
        for m, attrs, hooks in held:
            for k in [k for k in m.__dict__ if k not in attrs]:
                del m.__dict__[k]
            for k, v in attrs.items():
                if k in hooks:
                    v.clear()
                    v.update(hooks[k])
                elif m.__dict__.get(k) is not v:
                    m.__dict__[k] = v


def _logits(out) -> torch.Tensor:
    return (out.logits if hasattr(out, "logits") else out[0]).detach().float()


def check_rows(model, inputs: Mapping, samples: List[Sample]) -> None:
    """Each sample's logits alone equal its row of the batch's logits at its positions (to ``RTOL`` of the
    batch's largest logit), else refuse (module docstring, step 2)."""
    with torch.no_grad(), _left_as_it_was(model):
        whole = _logits(model(**inputs, use_cache=False))
        for i, s in enumerate(samples):
            alone = _logits(model(**s.inputs, use_cache=False))[0]
            row = whole[i, s.keep.to(whole.device)]
            scale = float(whole[i].abs().max()) + 1e-12
            if alone.shape != row.shape or float((alone - row).abs().max()) > RTOL * scale:
                gap = float((alone - row).abs().max()) if alone.shape == row.shape else float("inf")
                raise _refuse(model, f"sample {i} cut out of the batch does not compute what the batch computes for "
                              f"its row (logits differ by {gap:.3g}, {gap / scale:.2g} of the largest): the batch's "
                              "padding changes that row (left padding shifts the language model's positions?). "
                              "Explain each prompt in its own relprop.explain call, or pad on the right")


def split(model, inputs: Mapping, target: Any, special_tokens_mask: Optional[torch.Tensor]) -> Tuple[
        List[Sample], int]:
    """(the samples of the batch ``inputs``, cut and checked, the batch's padded length) (module docstring).

    Raises
    ------
    MethodError
        inputs relprop cannot cut per sample, images of different grids, a callable target, or a cut sample
        whose logits differ from its row of the batch.
    """
    k = kind(model)
    extra = sorted(key for key, v in inputs.items() if v is not None and key not in _KNOWN[k])
    if extra:
        raise _refuse(model, f"relprop cuts the processor's {sorted(_KNOWN[k])} per sample, not {extra}: explain each "
                      "prompt in its own relprop.explain call")
    ids = inputs[IDS]
    n, length = int(ids.shape[0]), int(ids.shape[1])
    for key in _PER_TOKEN[1:]:
        v = inputs.get(key)
        if v is not None and tuple(v.shape) != (n, length):
            raise _refuse(model, f"{key} of shape {tuple(v.shape)}, input_ids {(n, length)}")
    if special_tokens_mask is not None and tuple(special_tokens_mask.shape) != (n, length):
        raise _refuse(model, f"special_tokens_mask of shape {tuple(special_tokens_mask.shape)}, input_ids "
                      f"{(n, length)}")
    parts = _image_parts(model, inputs, n)
    samples = []
    for i in range(n):
        keep = _positions(inputs.get(MASK), i, length, model)
        one = {key: inputs[key][i:i + 1, keep.to(inputs[key].device)] for key in _PER_TOKEN if inputs.get(key)
               is not None}
        stm = None if special_tokens_mask is None else special_tokens_mask[i:i + 1, keep.to(
            special_tokens_mask.device)]
        samples.append(Sample({**one, **parts[i]}, keep, target_of(target, i, n, model), stm))
    check_rows(model, inputs, samples)
    return samples, length


def joined(runs: List[Any], samples: List[Sample], length: int, many: bool, model) -> Any:
    """The batch's Explanation (a list, one per method, when ``many``) from each sample's ``runs``
    (:func:`relprop.explanation.joined.join`)."""
    keeps = [s.keep for s in samples]
    note = (f"{FAMILIES[kind(model)]}: a batch of {len(samples)} prompts explained sample by sample (this family's "
            "captured call takes one sample): each sample cut out without its padding, checked against the batch's "
            "logits of its row, explained alone, and laid back on the batch's padded positions (0 at the padding)")
    if not many:
        return join(runs, keeps, length, note)
    return [join([r[j] for r in runs], keeps, length, note) for j in range(len(runs[0]))]
