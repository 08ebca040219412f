"""Zero-shot HuggingFace pipelines as the model of :func:`relprop.explain`.

A zero-shot pipeline scores each candidate label with a separate input built from a template, so
"the explanation of label ``t``" is the explanation of the model on the input the pipeline builds for
``t``:

* ``zero-shot-classification`` (an NLI model): the pair (text, hypothesis), the hypothesis being the
  pipeline's template filled with the label (``"This example is {}."`` unless the pipeline was made
  with another ``hypothesis_template``); the explained score is the NLI model's *entailment* logit of
  that pair (``pipe.entailment_id``), the quantity the pipeline's softmax over labels is taken of. The
  scores cover the pair's tokens (the text's and the hypothesis').
* ``zero-shot-image-classification`` (a dual image and text encoder): the image and the label's prompt
  (``"This is a photo of {}."`` by default); the explained score is the image–prompt similarity ``logits_per_image`` of
  the pair, explained onto the pixels (``wrt="pixel_values"``; pass ``wrt="input_ids"`` for the
  prompt's tokens).

``target=`` names the label: one label for every input, or one per input. There is no predicted
label without a list of candidates, so ``target=None`` is an error.
"""
from __future__ import annotations

import inspect
from typing import Any, List, NamedTuple, Optional

import torch

from ..errors import InputError, TargetError

TASKS = ("zero-shot-classification", "zero-shot-image-classification")


class ZeroShot(NamedTuple):
    """The model call a zero-shot pipeline makes for the explained labels."""

    model: Any
    inputs: Any
    target: Any
    wrt: Optional[str]


def is_zero_shot(pipe: Any) -> bool:
    """True for the zero-shot pipelines this module explains."""
    return getattr(pipe, "task", None) in TASKS


def hypothesis_template(pipe: Any) -> str:
    """The template the pipeline fills with a label: the one it was made with, else its default."""
    given = getattr(pipe, "_preprocess_params", {}).get("hypothesis_template")
    if given:
        return str(given)
    return str(inspect.signature(pipe.preprocess).parameters["hypothesis_template"].default)


def labels_per_input(target: Any, n: int, task: str) -> List[str]:
    """One candidate label per input from ``target`` (a string, or a list of ``n`` strings)."""
    if isinstance(target, str):
        return [target] * n
    if isinstance(target, (list, tuple)) and len(target) == n and all(isinstance(t, str) for t in target):
        return list(target)
    raise TargetError(f"a {task!r} pipeline scores a label you name: pass target= one candidate label (a string) "
                      f"or one per input ({n} strings), e.g. target='sports'; got {target!r}")


def _filled(template: str, labels: List[str]) -> List[str]:
    if template.format("<label>") == template:
        raise InputError(f"the pipeline's hypothesis_template {template!r} has no '{{}}' for the label")
    return [template.format(label) for label in labels]


class PairSimilarity:
    """Target for a dual image and text encoder: ``logits_per_image[b, b]``, image ``b`` against prompt ``b``."""

    def __call__(self, outputs: Any) -> torch.Tensor:
        logits = getattr(outputs, "logits_per_image", None)
        if logits is None:
            raise TargetError(f"a zero-shot image model's outputs have no logits_per_image "
                              f"({type(outputs).__name__}); explain its model with a target callable instead")
        return logits.diagonal()


def text_call(pipe: Any, texts: List[str], target: Any, wrt: Optional[str]) -> ZeroShot:
    """The (text, hypothesis) pairs of a ``zero-shot-classification`` pipeline and its entailment id."""
    entailment = int(pipe.entailment_id)
    if entailment < 0:
        raise InputError(f"{type(pipe.model).__name__} names no 'entailment' label (config.id2label = "
                         f"{pipe.model.config.id2label}); a zero-shot-classification pipeline needs an NLI model")
    labels = labels_per_input(target, len(texts), pipe.task)
    batch = pipe.tokenizer(texts, _filled(hypothesis_template(pipe), labels), padding=True,
                           truncation="only_first", return_tensors="pt")
    return ZeroShot(pipe.model, dict(batch), entailment, wrt)


def image_call(pipe: Any, pixel_values: torch.Tensor, target: Any, wrt: Optional[str]) -> ZeroShot:
    """The images and label prompts of a ``zero-shot-image-classification`` pipeline, with the
    image–prompt similarity as target, explained onto the pixels unless ``wrt`` says otherwise."""
    labels = labels_per_input(target, int(pixel_values.shape[0]), pipe.task)
    prompts = pipe.tokenizer(_filled(hypothesis_template(pipe), labels), padding=True, return_tensors="pt")
    inputs = {"pixel_values": pixel_values, **dict(prompts)}
    if "token_type_ids" not in inspect.signature(pipe.model.forward).parameters:
        inputs.pop("token_type_ids", None)  # such text towers take ids and a mask only
    return ZeroShot(pipe.model, inputs, PairSimilarity(), wrt or "pixel_values")
