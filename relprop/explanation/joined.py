"""Explanations of one sample each put back into the Explanation of their batch: the inverse of
``exp[i]`` (:func:`relprop.explanation.data_export.select`), with each sample's token positions laid
out on the batch's padded positions.

A family that relprop explains one sample per call (``relprop.models.vlm_batches``) explains a batch
sample by sample, each sample cut out of the batch without its padding (``t_i`` positions, kept at
the batch positions ``keep_i`` of ``T``). The batch's Explanation then holds, for every per-sample
tensor, the samples' values concatenated along the batch axis, each token axis (an axis whose size is
the sample's ``t_i`` for every sample) widened to ``T`` with the sample's values at ``keep_i`` and 0 at
its padding, as a padded batch of text has (``mask`` False there). Tensors on the image (maps, patch
scores, pixels) have no token axis and are concatenated as they are; samples whose image tensors
differ in shape cannot be stacked and are refused. A tensor with several rows per sample (LLaVA-NeXT's
vision-tower records and outputs, one row per tile) holds the samples' rows one sample after the other,
as the batch's own vision tower lays them out (``exp[i]`` then leaves it whole).
"""
from __future__ import annotations

import dataclasses
from typing import Any, List, Optional, Sequence

import torch

from ..engine.trace import NotKept
from ..errors import MethodError
from .data_export import PER_SAMPLE_LISTS
from .result import Explanation

#: fields on the image in an Explanation of pixels (modality "vision"): never on the prompt's tokens
_ON_IMAGE = {"scores", "mask", "input_relevance", "heads", "query", "matrix"}
#: fields always on the image
_IMAGE = {"map", "image"}
#: the stream of the prompt's tokens (the others are on the image's patches)
TOKEN_STREAM = "input_ids"
#: per-model fields: the same for every sample (taken from the first)
_PER_MODEL = {"method", "preset", "modality", "grid", "prefix_tokens", "signed", "class_specific", "labels",
              "image_mean", "image_std", "output_stream", "out_proj_weight"}
#: token-string lists padded with this at the padding positions
PAD_TEXT = ""


class Unstackable(MethodError):
    """The samples' explanations cannot be stacked into one batch (their image tensors differ in shape)."""


def _place(x: torch.Tensor, keep: torch.Tensor, length: int, axes: Sequence[int]) -> torch.Tensor:
    """``x`` with each axis of ``axes`` widened to ``length``, its values at ``keep`` (0 elsewhere)."""
    for d in axes:
        shape = list(x.shape)
        shape[d] = length
        out = x.new_zeros(shape)
        index = [slice(None)] * x.dim()
        index[d] = keep.to(x.device)
        out[tuple(index)] = x
        x = out
    return x


def _tensors(xs: List[torch.Tensor], keeps, length: int, tokens: bool, what: str) -> torch.Tensor:
    """The samples' ``xs`` (batch axis of size 1) concatenated; their token axes placed when ``tokens``."""
    sizes = [len(k) for k in keeps]
    padded = any(n != length for n in sizes)
    axes = [d for d in range(1, xs[0].dim()) if tokens and padded
            and all(x.dim() == xs[0].dim() and x.shape[d] == n for x, n in zip(xs, sizes))]
    placed = [_place(x, k, length, axes) for x, k in zip(xs, keeps)]
    if any(p.shape[1:] != placed[0].shape[1:] for p in placed):
        raise Unstackable(f"{what}: the samples give shapes {[tuple(x.shape) for x in xs]}, which cannot be stacked "
                          "into one batch")
    return torch.cat(placed)


def _rows(xs: List[torch.Tensor], what: str) -> torch.Tensor:
    """Tensors whose first axis holds several rows per sample (a vision tower's tiles) concatenated along
    it, sample after sample, as the batch's own vision tower lays them out."""
    if any(x.shape[1:] != xs[0].shape[1:] for x in xs):
        raise Unstackable(f"{what}: the samples give shapes {[tuple(x.shape) for x in xs]}, which cannot be stacked "
                          "into one batch")
    return torch.cat(xs)


def _join(values: List[Any], keeps, length: int, tokens: bool, what: str) -> Any:
    """The samples' ``values`` of one field joined, recursively through lists, tuples, dicts and
    dataclasses (block records, conservation), as :func:`relprop.explanation.data_export.select` walks them."""
    first = values[0]
    if torch.is_tensor(first):
        if all(v is first for v in values):
            return first  # one tensor for all: the model's, not the samples'
        if first.dim() == 0:
            return torch.stack(values)
        if first.shape[0] != 1:  # rows of several per sample (LLaVA-NeXT's vision tower: the tiles)
            return _rows(values, what)
        return _tensors(values, keeps, length, tokens, what)
    if first is None or type(first) is NotKept or isinstance(first, (str, int, float, bool)):
        return first
    if isinstance(first, list):
        return [_join([v[j] for v in values], keeps, length, tokens, f"{what}[{j}]") for j in range(len(first))]
    if isinstance(first, tuple) and not hasattr(first, "_fields"):
        return tuple(_join([v[j] for v in values], keeps, length, tokens, what) for j in range(len(first)))
    if dataclasses.is_dataclass(first) and not isinstance(first, type) and not hasattr(first, "keys"):
        return dataclasses.replace(first, **{
            f.name: _join([getattr(v, f.name) for v in values], keeps, length, tokens, f"{what}.{f.name}")
            for f in dataclasses.fields(first) if f.init and f.name not in _PER_MODEL})
    if hasattr(first, "keys") and hasattr(first, "items"):
        joined = {k: _join([v[k] for v in values], keeps, length, tokens, f"{what}[{k!r}]") for k in first.keys()}
        try:
            return type(first)(**joined)
        except TypeError:
            return joined
    return first


def _strings(rows: List[Optional[List[List[str]]]], keeps, length: int):
    """Per-sample token strings laid out on the batch's positions (``PAD_TEXT`` at the padding)."""
    if any(r is None for r in rows):
        return None
    out = []
    for r, keep in zip(rows, keeps):
        for row in r:
            if len(row) != len(keep):
                return [list(x) for rr in rows for x in rr]  # not one per position: left as they are
            placed = [PAD_TEXT] * length
            for j, s in zip(keep.tolist(), row):
                placed[j] = s
            out.append(placed)
    return out


def join(exps: Sequence[Explanation], keeps: Sequence[torch.Tensor], length: int, note: str) -> Explanation:
    """One Explanation of a batch from the Explanations ``exps`` of its samples (one sample each, in
    order): the inverse of ``exp[i]`` (module docstring). ``keeps[i]`` are the batch positions (of
    ``length``) of sample i's positions; ``note`` is added to the notes.

    Raises
    ------
    MethodError
        (:class:`Unstackable`) the samples' image tensors differ in shape, or their methods differ.
    """
    first = exps[0]
    if any(e.method != first.method or e.modality != first.modality or e.grid != first.grid for e in exps):
        raise Unstackable(f"the samples' explanations differ in method, modality or grid "
                          f"({[(e.method, e.modality, e.grid) for e in exps]}), so they cannot be stacked")
    on_image = first.modality == "vision"
    values = {}
    for f in dataclasses.fields(Explanation):
        name = f.name
        column = [object.__getattribute__(e, name) for e in exps]
        if name in _PER_MODEL:
            values[name] = column[0]
        elif name == "notes":
            values[name] = list(dict.fromkeys(n for e in exps for n in e.notes)) + [note]
        elif name in ("tokens", "prompt_tokens"):
            values[name] = _strings(column, keeps, length)
        elif name in PER_SAMPLE_LISTS:
            values[name] = None if any(v is None for v in column) else [x for v in column for x in v]
        elif name == "streams" and column[0] is not None:
            values[name] = {k: _join([v[k] for v in column], keeps, length, k == TOKEN_STREAM, f"streams[{k!r}]")
                            for k in column[0]}
        else:
            values[name] = _join(column, keeps, length, name not in _IMAGE and not (on_image and name in _ON_IMAGE),
                                 name)
    return Explanation(**values)
