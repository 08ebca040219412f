"""What an :class:`relprop.Explanation` remembers of the call that made it, so that it draws itself:
``exp.show()``, ``exp.save(path)``, ``exp.words()``, ``exp.overlay()`` and the notebook display need no
argument after any input form :func:`relprop.explain` takes.

* ``tokens``: per sample, the token strings of the explained ids, from the tokenizer given to
  ``explain()`` or the pipeline's (raw text is tokenized by it too), else from a fast tokenizer's
  output itself (``BatchEncoding.encodings[i].tokens``, when they match the ids' shape);
* ``labels``: the model's class names: ``config.id2label`` (a pipeline's model's included) unless it is
  only the ``LABEL_i`` defaults, else timm's ``pretrained_cfg["label_names"]``;
* ``target_label``: per sample, the name of what is explained: the label name(s) given as ``target=``,
  else ``labels[target]``, and for a language model the next token as text (``tokenizer.decode``);
  a language model's ``target`` is then that token's id;
* ``image``, ``image_mean``, ``image_std``: the pixels the model was given (a copy on the CPU) and the
  normalisation to undo for display: the image processor's (given, or the pipeline's) or a timm
  model's ``pretrained_cfg`` mean and std. The pixels, not the raw image, are kept, so the overlay
  lies exactly on what the model saw (after its resizing and cropping).

Everything is stored on the Explanation, nothing on the model.
"""
from __future__ import annotations

import re
from typing import Any, List, Optional

import torch

from ..targets import explained_tokens
from ..viz.names import label_name
from ..viz.text import token_strings

_DEFAULT_LABEL = re.compile(r"LABEL_\d+")


def model_labels(model: Any) -> Any:
    """The class names of ``model`` (see the module docstring), or None."""
    id2label = getattr(getattr(model, "config", None), "id2label", None)
    if isinstance(id2label, dict) and id2label:
        if all(_DEFAULT_LABEL.fullmatch(str(v)) for v in id2label.values()):
            return None
        return {int(k): str(v) for k, v in id2label.items()}
    cfg = getattr(model, "pretrained_cfg", None)
    names = cfg.get("label_names") if isinstance(cfg, dict) else None
    return [str(n) for n in names] if names else None


def _normalisation(model: Any, image_processor: Any):
    for source in (image_processor, getattr(model, "pretrained_cfg", None)):
        if source is None:
            continue
        get = source.get if isinstance(source, dict) else lambda k: getattr(source, k, None)
        mean, std = (get("image_mean"), get("image_std")) if not isinstance(source, dict) else (get("mean"),
                                                                                               get("std"))
        if mean is not None and std is not None:
            return tuple(float(m) for m in mean), tuple(float(s) for s in std)
    return None, None


def _named_target(target: Any, batch: int) -> Optional[List[str]]:
    """Per sample, the label names given as ``target=`` (a name, or one per sample), else None."""
    if isinstance(target, str) and target != "next_token":
        return [target] * batch
    if isinstance(target, (list, tuple)) and len(target) == batch and target and all(isinstance(t, str)
                                                                                      for t in target):
        return list(target)
    return None


def _decode(tokenizer: Any, ids: torch.Tensor) -> Optional[List[str]]:
    decode = getattr(tokenizer, "decode", None)
    if decode is None:
        return None
    return [str(decode([int(i)])) for i in ids.tolist()]


def encoding_tokens(encodings: Any, ids: torch.Tensor) -> Optional[List[List[str]]]:
    """Per sample, the token strings a fast tokenizer's ``BatchEncoding.encodings`` carry, if there is
    one per row of ``ids`` [batch, positions] with one token per position; else None."""
    if not isinstance(encodings, (list, tuple)) or len(encodings) != int(ids.shape[0]):
        return None
    rows = [list(getattr(e, "tokens", None) or []) for e in encodings]
    if any(len(r) != int(ids.shape[1]) for r in rows):
        return None
    return [[str(t) for t in r] for r in rows]


def remember(results: list, *, model: Any, inputs: dict, primary: str, tokenizer: Any = None,
             image_processor: Any = None, target: Any = None, spec: Any = None, encodings: Any = None) -> None:
    """Fill ``tokens``, ``labels``, ``target_label``, ``image`` (and its ``image_mean``/``image_std``) of
    each Explanation of ``results`` from the call that made them: the ``model`` explained, its keyword
    ``inputs`` and explained input ``primary``, the ``tokenizer`` / ``image_processor`` (given or the
    pipeline's), ``target`` as the user gave it and ``spec``, the target specified for the model's head
    (:func:`relprop.targets.specify`) and ``encodings``, a fast tokenizer's ``BatchEncoding.encodings``
    (token strings when no tokenizer is given); a language model's ``target`` becomes the explained token ids."""
    if not results:
        return
    x = inputs.get(primary)
    labels = model_labels(model)
    tokens = image = mean = std = None
    if torch.is_tensor(x) and not x.is_floating_point() and x.dim() == 2 and tokenizer is not None \
            and hasattr(tokenizer, "convert_ids_to_tokens"):
        tokens = token_strings(tokenizer, x)
    elif torch.is_tensor(x) and not x.is_floating_point() and x.dim() == 2 and encodings is not None:
        tokens = encoding_tokens(encodings, x)
    elif torch.is_tensor(x) and x.is_floating_point() and x.dim() == 4:
        image = x.detach().to("cpu", copy=True)
        mean, std = _normalisation(model, image_processor)
    first = results[0]
    batch = int(first.scores.shape[0])
    ids = explained_tokens(spec, first.logits)
    names = _named_target(target, batch)
    if ids is not None and tokenizer is not None:
        names = _decode(tokenizer, ids)
    for r in results:
        if ids is not None and r.target is None:
            r.target = ids.to(r.target_scores.device)
        if tokens is not None and r.map is None and int(r.scores.shape[-1]) == int(x.shape[1]):
            r.tokens = [list(t) for t in tokens]
        if image is not None and r.map is not None:
            r.image, r.image_mean, r.image_std = image, mean, std
        r.labels = labels
        if names is not None:
            r.target_label = list(names)
        elif labels is not None and r.target is not None:
            r.target_label = [label_name(labels, int(t)) for t in r.target.tolist()]
