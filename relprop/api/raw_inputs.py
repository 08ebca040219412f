"""Inputs users already have, turned into the tensors :func:`relprop.explain` captures.

* A HuggingFace ``pipeline`` as the model (text-classification, image-classification, ...): its model
  is explained, its tokenizer or image processor prepares raw inputs, its labels name the targets.
  Zero-shot pipelines (text and image) explain the input they build for the label named by
  ``target=`` (:mod:`relprop.api.zero_shot`).
* Raw text (a string or a list of strings) for a text model, given a ``tokenizer=`` (or a pipeline):
  tokenized with padding, as one batch.
* Images: a ``PIL.Image``, a file path, or a list of them, prepared by the model's own preprocessing:
  the ``image_processor=`` given (or the pipeline's), else, for a timm model, the transform of its
  pretrained configuration (``timm.data.resolve_data_config`` + ``create_transform``: resize, centre
  crop, normalisation).

Nothing here imports transformers or timm at module level (relprop itself needs torch alone); the
pipeline is recognised by what it has (``.model``, ``.task``).
"""
from __future__ import annotations

import os
from typing import Any, List, NamedTuple, Optional, Tuple

import torch

from . import zero_shot
from ..errors import InputError

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")


class Adapted(NamedTuple):
    """What :func:`adapt` returns: the model to capture, its inputs, the tokenizer (or None), and the
    target and ``wrt`` (the caller's, or those a zero-shot pipeline implies)."""

    model: Any
    inputs: Any
    tokenizer: Any
    target: Any = None
    wrt: Optional[str] = None


def is_pipeline(obj: Any) -> bool:
    """A HuggingFace ``Pipeline`` (or anything shaped like one): an ``nn.Module`` in ``.model`` and a
    ``.task`` string."""
    return (not isinstance(obj, torch.nn.Module) and isinstance(getattr(obj, "model", None), torch.nn.Module)
            and isinstance(getattr(obj, "task", None), str))


def _is_image(x: Any) -> bool:
    if type(x).__module__.startswith("PIL.") and hasattr(x, "convert"):
        return True
    return isinstance(x, (str, os.PathLike)) and str(x).lower().endswith(IMAGE_EXTENSIONS)


def _items(inputs: Any) -> Optional[List[Any]]:
    """The raw items of ``inputs`` (a single one or a list), or None for tensors/dicts/tuples of tensors."""
    if isinstance(inputs, (str, os.PathLike)) or _is_image(inputs):
        return [inputs]
    if isinstance(inputs, list) and inputs and all(isinstance(x, (str, os.PathLike)) or _is_image(x)
                                                   for x in inputs):
        return list(inputs)
    return None


def is_image_model(model: Any) -> bool:
    """A model whose input is pixels: timm (a ``pretrained_cfg``) or HF (``main_input_name``)."""
    return getattr(model, "main_input_name", None) == "pixel_values" or isinstance(
        getattr(model, "pretrained_cfg", None), dict)


def open_image(item: Any):
    """A PIL image in RGB from a PIL image or a file path; a missing or unreadable file is an InputError."""
    from PIL import Image, UnidentifiedImageError
    if not isinstance(item, (str, os.PathLike)):
        return item.convert("RGB")
    if not os.path.isfile(item):
        raise InputError(f"image file {os.fspath(item)!r} does not exist")
    try:
        with Image.open(item) as im:
            return im.convert("RGB")
    except (UnidentifiedImageError, OSError) as err:
        raise InputError(f"cannot read image {os.fspath(item)!r}: {err}") from None


def model_image_size(model: torch.nn.Module) -> Optional[Tuple[int, int]]:
    """(H, W) the model takes: a HuggingFace config's ``image_size``, a timm model's patch embedding
    ``img_size`` or ``pretrained_cfg["input_size"]``; None if unknown."""
    cfg = getattr(model, "config", None)
    size = getattr(cfg, "image_size", None)
    if size is None:
        size = getattr(getattr(model, "patch_embed", None), "img_size", None)
    if size is None and isinstance(getattr(model, "pretrained_cfg", None), dict):
        inp = model.pretrained_cfg.get("input_size")
        size = tuple(inp[-2:]) if inp else None
    if size is None:
        return None
    if isinstance(size, int):
        return (size, size)
    return (int(size[0]), int(size[1]))


def timm_transform(model: Any):
    """The evaluation transform of a timm model's pretrained configuration (resize, crop, normalise), at
    the image size its patch embedding takes (a model created with ``img_size=`` keeps the pretrained
    configuration's size in ``pretrained_cfg``)."""
    from timm.data import create_transform, resolve_data_config
    args = {}
    size = getattr(getattr(model, "patch_embed", None), "img_size", None)
    if isinstance(size, (tuple, list)) and len(size) == 2:
        args["input_size"] = (3, int(size[0]), int(size[1]))
    return create_transform(**resolve_data_config(args, model=model))


def pixels(model: Any, images: List[Any], image_processor: Any = None) -> torch.Tensor:
    """[batch, 3, H, W] pixels of ``images`` as the model's own preprocessing makes them."""
    pil = [open_image(x) for x in images]
    if image_processor is not None:
        return image_processor(images=pil, return_tensors="pt")["pixel_values"]
    if isinstance(getattr(model, "pretrained_cfg", None), dict):
        t = timm_transform(model)
        return torch.stack([t(im) for im in pil])
    raise InputError(f"{type(model).__name__} takes pixels: to explain images or image files pass "
                     "image_processor= (e.g. AutoImageProcessor for the checkpoint), a pipeline, or pixel tensors")


def adapt(model: Any, inputs: Any, tokenizer: Any = None, image_processor: Any = None, target: Any = None,
          wrt: Optional[str] = None) -> Adapted:
    """The model, inputs, tokenizer, target and ``wrt`` :func:`relprop.explain` works with, from a
    pipeline and/or raw text or images (see the module docstring; zero-shot pipelines:
    :mod:`relprop.api.zero_shot`). Tensors, dicts and tuples pass through unchanged."""
    pipe = model if is_pipeline(model) else None
    if pipe is not None:
        model = pipe.model
        tokenizer = tokenizer if tokenizer is not None else getattr(pipe, "tokenizer", None)
        if image_processor is None:
            image_processor = getattr(pipe, "image_processor", None)
        if pipe.task.startswith("zero-shot") and not zero_shot.is_zero_shot(pipe):
            raise InputError(f"relprop explains the pipelines {', '.join(zero_shot.TASKS)} among the zero-shot "
                             f"ones, not {pipe.task!r}; explain its model on the inputs it builds (pipe.preprocess)")
    items = _items(inputs)
    if pipe is not None and zero_shot.is_zero_shot(pipe):
        if items is None:
            raise InputError(f"a {pipe.task!r} pipeline builds its model's inputs from raw "
                             f"{'images' if 'image' in pipe.task else 'text'}: pass those (a string / an image, "
                             "or a list), not tensors")
        if "image" in pipe.task:
            call = zero_shot.image_call(pipe, pixels(model, _images(model, items), image_processor), target, wrt)
            return Adapted(call.model, call.inputs, None, call.target, call.wrt)
        call = zero_shot.text_call(pipe, [os.fspath(x) for x in items], target, wrt)
        return Adapted(call.model, call.inputs, tokenizer, call.target, call.wrt)
    if items is None:
        return Adapted(model, inputs, tokenizer, target, wrt)
    if is_image_model(model) or any(not isinstance(x, (str, os.PathLike)) for x in items):
        return Adapted(model, pixels(model, _images(model, items), image_processor), tokenizer, target, wrt)
    if tokenizer is None:
        raise InputError("raw text needs the model's tokenizer: pass tokenizer= (or a pipeline as the model), "
                         "or the tokenizer's output")
    texts = [os.fspath(x) for x in items]
    batch = tokenizer(texts, padding=True, truncation=True, return_tensors="pt")
    return Adapted(model, dict(batch), tokenizer, target, wrt)


def _images(model: Any, items: List[Any]) -> List[Any]:
    if not all(_is_image(x) for x in items):
        raise InputError(f"{type(model).__name__} takes images: give PIL images or image file paths "
                         f"(extensions {', '.join(IMAGE_EXTENSIONS)}), or pixel tensors")
    return items
