"""Positive and negative perturbation tests (Chefer, Gur & Wolf, CVPR 2021, §4 "Evaluation settings").

Remove a growing fraction of the input in order of relevance and watch the model's top-1 accuracy:

* **positive**: most relevant first. A good explanation makes the accuracy drop fast (lower area under
  the curve is better);
* **negative**: least relevant first. A good explanation keeps the accuracy (higher area is better).

What "remove" means
-------------------
Images, ``unit="pixel"`` (default, as the authors' ``pertubation_eval_from_hdf5.py``): the H×W
positions of ``exp.map`` (the patch scores upsampled bilinearly to the input resolution, or the
pixel map of input-level methods) are ranked; removing a fraction *f* sets floor(f·H·W) positions,
all colour channels, to the baseline. ``unit="patch"``: the patches of ``exp.scores`` are ranked and
floor(f·patches) whole patches are set to the baseline.

The baseline is a value in the **un-normalized** pixel space (0 = black for images in [0, 1], as the
authors' code, which zeroes pixels before normalizing). Give the model's normalization with
``normalization=(mean, std)`` (or a timm model / its ``pretrained_cfg``, or a HuggingFace image
processor): a removed pixel then becomes ``(baseline - mean) / std`` in the space the model sees.
Without a normalization the model's own input space is taken as un-normalized, so the default
(``baseline=0``) puts **0 in normalized space** (the normalization's mean colour). ``baseline`` may
also be per channel, or a tensor of the input's shape (e.g. a blurred copy), in the same space.

Text: the positions of ``exp.scores`` where ``exp.mask`` is True are ranked (padding and special tokens
such as [CLS]/[SEP] are never removed); removing a fraction *f* of a text with n such tokens removes
floor(f·n) of them. ``removal="pad"`` (default) or ``"mask"`` replaces them by the [PAD] / [MASK] id (the
attention mask is left as it is, so the model reads the replacement token, as AttCAT §5.3), an int
replaces them by that id, and ``"delete"`` removes them: the remaining tokens move left, the freed
positions at the end become padding and the attention mask (and token type ids) follow.

Ties in the ranking are broken by position (the earlier position first) in both modes, so the
result of a sample never depends on the other samples of its batch. For signed methods, "most
relevant" is the most positive score (evidence for the target); pass ``scores.abs()`` to rank by
magnitude instead.

Accuracy and area
-----------------
Each perturbed copy counts as correct when the model's top-1 class is the target: the class given
(``target=``, e.g. the ground truth: the paper's "target" rows) or, by default, the class the model
predicts on the unperturbed input (the "predicted" rows). Copies are evaluated ``batch_size`` at a
time on the inputs' device. ``PerturbationResult.auc`` is the trapezoidal area under the mean accuracy
over the removed fractions (``sklearn.metrics.auc``), by default over 10 %…90 % as in the paper: an
accuracy of 1 everywhere gives 0.8 (multiply by 100 for the paper's percent-style tables). Put 0.0
in ``steps`` to anchor the curve at the unperturbed input.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import numpy as np
import torch

from ..errors import InputError
from . import _util
from .removal import text_plan, vision_plan

#: the paper's removed fractions, 10 % … 90 %
DEFAULT_STEPS = tuple(round(0.1 * i, 1) for i in range(1, 10))
MODES = ("positive", "negative")
UNITS = ("pixel", "patch")


@dataclasses.dataclass
class PerturbationResult:
    """A perturbation curve, per sample and averaged.

    Attributes
    ----------
    mode
        ``"positive"`` (most relevant removed first) or ``"negative"``.
    unit
        what was removed: ``"pixel"``, ``"patch"`` or ``"token"``.
    fractions
        [steps] removed fractions.
    per_sample_correct
        [samples, steps] bool, top-1 class == target on the perturbed copy.
    log_probability
        [samples, steps] log p(target | perturbed copy) (log-softmax of the logits).
    removed
        [samples, steps] number of positions removed.
    target
        [samples] the class the accuracy and probabilities refer to.
    clean_correct, clean_log_probability
        [samples] the same on the unperturbed input.
    """

    mode: str
    unit: str
    fractions: np.ndarray
    per_sample_correct: np.ndarray
    log_probability: np.ndarray
    removed: np.ndarray
    target: np.ndarray
    clean_correct: np.ndarray
    clean_log_probability: np.ndarray

    def __len__(self) -> int:
        return int(self.per_sample_correct.shape[0])

    @property
    def accuracy(self) -> np.ndarray:
        """[steps] mean top-1 accuracy over the samples (the only statistic across samples)."""
        if len(self) == 0:
            return np.full(len(self.fractions), np.nan)
        return self.per_sample_correct.mean(axis=0)

    @property
    def auc(self) -> float:
        """Area under the accuracy curve over ``fractions`` (trapezoid, ``sklearn.metrics.auc``)."""
        if len(self.fractions) < 2 or len(self) == 0:
            return float("nan")
        from sklearn.metrics import auc  # imported when used: `relprop --help` starts without sklearn
        return float(auc(self.fractions, self.accuracy))

    @property
    def per_sample_auc(self) -> np.ndarray:
        """[samples] the area of each sample's 0/1 curve (their mean is ``auc``)."""
        if len(self.fractions) < 2:
            return np.full(len(self), np.nan)
        from scipy.integrate import trapezoid  # imported when used (start-up time)
        return trapezoid(self.per_sample_correct.astype(np.float64), self.fractions, axis=1)

    @property
    def probability(self) -> np.ndarray:
        """[samples, steps] p(target | perturbed copy)."""
        return np.exp(self.log_probability)

    @property
    def clean_probability(self) -> np.ndarray:
        return np.exp(self.clean_log_probability)

    @staticmethod
    def concat(results: Sequence["PerturbationResult"]) -> "PerturbationResult":
        """The results of several batches as one (same mode, unit and fractions)."""
        results = list(results)
        if not results:
            raise InputError("no results to concatenate")
        first = results[0]
        for r in results[1:]:
            if r.mode != first.mode or r.unit != first.unit or not np.array_equal(r.fractions, first.fractions):
                raise InputError("cannot concatenate perturbation results of different modes, units or steps")

        def cat(name):
            return np.concatenate([getattr(r, name) for r in results], axis=0)

        return PerturbationResult(first.mode, first.unit, first.fractions, cat("per_sample_correct"),
                                  cat("log_probability"), cat("removed"), cat("target"), cat("clean_correct"),
                                  cat("clean_log_probability"))

    def __repr__(self) -> str:
        acc = ", ".join(f"{a:.3f}" for a in self.accuracy)
        return (f"PerturbationResult(mode='{self.mode}', unit='{self.unit}', samples={len(self)}, "
                f"auc={self.auc:.4f}, accuracy=[{acc}])")


def perturbation_curve(model: torch.nn.Module, inputs: Any, scores_or_explanation: Any, target: Any = None,
                       mode: str = "positive", steps: Sequence[float] = DEFAULT_STEPS, *, baseline: Any = None,
                       normalization: Any = None, unit: str = "pixel", removal: Any = "pad", tokenizer: Any = None,
                       removable: Optional[torch.Tensor] = None, grid: Optional[tuple] = None,
                       batch_size: Optional[int] = None) -> PerturbationResult:
    """Top-1 accuracy of ``model`` while the most (positive) or least (negative) relevant part of the
    input is removed (CVPR 2021 §4).

    Parameters
    ----------
    model
        the classifier (in eval mode); it is called as ``model(**inputs)`` and not modified.
    inputs
        what the model's forward takes (pixels, or a tokenizer's output), batched.
    scores_or_explanation
        an ``relprop.Explanation`` of these inputs, or a tensor: images
        [batch, H, W] (a pixel map) or [batch, patches] / [batch, gh, gw] (patch scores); text
        [batch, positions].
    target
        None (the class predicted on the unperturbed input), a class index, or one per sample.
    mode
        ``"positive"`` (most relevant first) or ``"negative"`` (least relevant first).
    steps
        removed fractions (default 0.1, …, 0.9).
    baseline
        images: value of a removed pixel in the un-normalized space (scalar, per channel, or a
        tensor of the input's shape); default 0 (black for images in [0, 1]); with ``normalization``
        a removed pixel becomes ``(baseline - mean) / std`` in the space the model sees.
    normalization
        the model's input normalization: ``(mean, std)``, a dict, a HuggingFace image
        processor or a timm model; None: the inputs' own space is the un-normalized space.
    unit
        images: ``"pixel"`` (rank ``exp.map``) or ``"patch"`` (rank ``exp.scores``).
    removal
        text: ``"pad"``, ``"mask"``, a token id, or ``"delete"``.
    tokenizer
        text: where to read the [PAD]/[MASK] ids (else ``model.config.pad_token_id``).
    removable
        text: [batch, positions] bool, the positions that may be removed (default: ``exp.mask``,
        else not padding and not a special id of the model's config).
    grid
        images: (gh, gw) patch grid for tensor patch scores that are not square.
    batch_size
        perturbed copies per forward pass (default: the batch size of ``inputs``).

    Returns
    -------
    PerturbationResult
    """
    if mode not in MODES:
        raise InputError(f"mode '{mode}' is not a choice. Choices: {list(MODES)}")
    fractions = _util.check_fractions(steps)
    kwargs, primary = _util.bind(model, inputs)
    x = kwargs[primary]
    batch = x.shape[0]
    kind = _util.modality_of(x)
    exp, scores = _util.scores_of(scores_or_explanation)
    if scores.shape[0] != batch:
        raise InputError(f"the scores are for {scores.shape[0]} samples, the inputs hold {batch}")
    bs = int(batch_size or batch)
    if bs < 1:
        raise InputError(f"batch_size must be positive, got {batch_size}")

    clean = torch.cat([_util.forward_logits(model, _util.take(kwargs, idx, batch))
                       for idx in torch.arange(batch, device=x.device).split(bs)])
    classes = _util.resolve_classes(target, clean)

    if kind == "vision":
        if unit not in UNITS:
            raise InputError(f"unit '{unit}' is not a choice. Choices: {list(UNITS)}")
        ranked, can_remove, build = vision_plan(exp, scores, kwargs, primary, unit, grid, baseline, normalization)
        unit_name = unit
    else:
        ranked, can_remove, build = text_plan(exp, scores, kwargs, primary, model, removable, removal, tokenizer)
        unit_name = "token"
    rank = removal_ranks(ranked, can_remove, mode)
    n = can_remove.sum(1)
    counts = torch.stack([_util.floor_count(f, n) for f in fractions], dim=1)  # [batch, steps]

    steps_n = len(fractions)
    copies = torch.arange(batch * steps_n, device=x.device)
    logits = []
    for chunk in copies.split(bs):
        ii, ss = chunk // steps_n, chunk % steps_n
        removed = rank.index_select(0, ii) < counts[ii, ss][:, None]
        logits.append(_util.forward_logits(model, build(ii, removed)))
    logits = torch.cat(logits).reshape(batch, steps_n, -1)
    logp = torch.log_softmax(logits, -1).gather(-1, classes[:, None, None].expand(batch, steps_n, 1))[..., 0]
    correct = logits.argmax(-1) == classes[:, None]
    clean_logp = torch.log_softmax(clean, -1).gather(-1, classes[:, None])[:, 0]
    return PerturbationResult(mode=mode, unit=unit_name, fractions=fractions,
                              per_sample_correct=_util.to_numpy(correct).astype(bool),
                              log_probability=_util.to_numpy(logp).astype(np.float64),
                              removed=_util.to_numpy(counts), target=_util.to_numpy(classes),
                              clean_correct=_util.to_numpy(clean.argmax(-1) == classes).astype(bool),
                              clean_log_probability=_util.to_numpy(clean_logp).astype(np.float64))


def removal_ranks(scores: torch.Tensor, removable: torch.Tensor, mode: str) -> torch.Tensor:
    """[batch, positions] long: the order in which each position is removed (0 = first); positions
    that may not be removed come last. Ties go to the earlier position, per sample."""
    s = torch.nan_to_num(scores.float(), nan=0.0)
    key = s if mode == "positive" else -s
    key = torch.where(removable, key, torch.full_like(key, float("-inf")))
    order = torch.sort(key, dim=1, descending=True, stable=True).indices
    ar = torch.arange(key.shape[1], device=key.device).expand_as(order)
    return torch.empty_like(order).scatter_(1, order, ar)
