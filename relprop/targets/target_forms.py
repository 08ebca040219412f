"""Every form of ``explain(target=...)`` resolved through one path per kind of model head.

A target can be given as None, a string (a label name, ``"next_token"``, a token, ``"span"``), an int
or one per sample, a :func:`relprop.contrast`, or a callable (:func:`relprop.targets.next_token`,
:func:`relprop.targets.question_answering`, ...). :func:`specify` turns each into what
:func:`relprop.targets.resolve` takes, the same way for every form, by the head the model has
(:func:`head_kind`):

``classification``
    class indices: None (the predicted class), ints, label names (``config.id2label``).
``language_model`` (a decoder that generates: ``model.can_generate()``)
    the next token at the last real position of the logits' positions: None / ``"next_token"`` the
    predicted one, an int / ints / a one-token string a given one.
``encoder_decoder`` (``config.is_encoder_decoder``)
    the same, on the decoder's positions: the mask is ``decoder_attention_mask`` (none: every decoder
    position is real), never the source's ``attention_mask``.
``question_answering`` (``*ForQuestionAnswering``)
    None / ``"span"`` / ``"start"`` / ``"end"``: that score of the predicted span, decoded over the real
    positions only.
``token_classification`` (``*ForTokenClassification``)
    a position must be named: :func:`relprop.targets.token_classification`.

The mask of the output's positions (:func:`positions_mask`) is given to every position target made
without one (:class:`relprop.targets.PositionTarget`), so the string form and the callable form of a
target read the same positions and give the same scores.
"""
from __future__ import annotations

from typing import Any, Dict, Mapping, Optional

import torch

from ..errors import TargetError
from .target_heads import QA_PARTS, question_answering
from .target_scores import Contrast, PositionTarget, next_token, predicted_next_token

#: the kinds of heads :func:`head_kind` tells apart
HEADS = ("classification", "language_model", "encoder_decoder", "question_answering", "token_classification")


def is_language_model(model: Any) -> bool:
    """True for a HuggingFace model that generates text (``model.can_generate()``), whose logits are
    [batch, positions, vocabulary]: its targets are read at the last non-padding position."""
    can = getattr(model, "can_generate", None)
    try:
        return bool(can()) if callable(can) else False
    except Exception:  # noqa: BLE001 - a model whose can_generate() fails is not treated as a language model
        return False


def head_kind(model: Any) -> str:
    """Which of :data:`HEADS` the model's output is (see the module docstring)."""
    config = getattr(model, "config", None)
    name = type(model).__name__
    if name.endswith("ForQuestionAnswering"):
        return "question_answering"
    if name.endswith("ForTokenClassification"):
        return "token_classification"
    if is_language_model(model):
        return "encoder_decoder" if bool(getattr(config, "is_encoder_decoder", False)) else "language_model"
    return "classification"


def positions_mask(head: str, inputs: Any) -> Optional[torch.Tensor]:
    """The [batch, positions] mask of the positions the head's logits cover, from the model's inputs
    (a dict of keyword arguments; None when they have none): the decoder's mask of an
    encoder–decoder, the attention mask otherwise."""
    if not isinstance(inputs, Mapping):
        return None
    key = "decoder_attention_mask" if head == "encoder_decoder" else "attention_mask"
    mask = inputs.get(key)
    return mask if torch.is_tensor(mask) and mask.dim() == 2 else None


def label_ids(model: Any) -> Dict[str, int]:
    """Label name (lower case) → class index, from the model's ``config.id2label`` (HuggingFace) or
    ``pretrained_cfg["label_names"]`` (timm); empty when the model names no labels."""
    config = getattr(model, "config", None)
    id2label = getattr(config, "id2label", None) if config is not None else None
    if isinstance(id2label, dict) and id2label:
        return {str(v).lower(): int(k) for k, v in id2label.items()}
    cfg = getattr(model, "pretrained_cfg", None)
    names = cfg.get("label_names") if isinstance(cfg, dict) else None
    return {str(v).lower(): i for i, v in enumerate(names)} if names else {}


def _class_of(name: str, labels: Dict[str, int], model: Any) -> int:
    key = name.strip().lower()
    if key in labels:
        return labels[key]
    if not labels:
        raise TargetError(f"target {name!r} is a label name but {type(model).__name__} names no labels "
                          "(no config.id2label); pass the class index")
    shown = ", ".join(sorted(labels, key=labels.get)[:30]) + (", ..." if len(labels) > 30 else "")
    raise TargetError(f"target {name!r} is not a label of {type(model).__name__}; its labels are: {shown}")


def _token_of(text: str, tokenizer: Any) -> int:
    if tokenizer is None:
        raise TargetError(f"target {text!r} is a string for a language model: pass tokenizer= to turn it into "
                          "a token id, or pass the token id")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        raise TargetError(f"target {text!r} is {len(ids)} tokens for this tokenizer ({ids}); a next-token "
                          "target must be one token (e.g. ' Paris' with its leading space for GPT-2)")
    return int(ids[0])


def _bind(target: Any, mask: Optional[torch.Tensor]) -> Any:
    """A position target made without a mask, given ``mask``; anything else as it is."""
    if isinstance(target, PositionTarget):
        return target.bound(mask)
    if isinstance(target, Contrast):
        return Contrast(_bind(target.a, mask), _bind(target.b, mask))
    return target


def specify(target: Any, model: Any, tokenizer: Any = None, inputs: Any = None) -> Any:
    """The ``target=`` of :func:`relprop.explain` in the form :func:`relprop.targets.resolve` takes,
    for the model's head (:func:`head_kind`, the module docstring); ``inputs`` are the model's
    keyword inputs (or the attention mask itself), from which the positions' mask is
    read (:func:`positions_mask`).

    For a language model (decoder or encoder–decoder) None and ``"next_token"`` are the token
    predicted on the inputs, chosen once (:func:`relprop.targets.predicted_next_token`), so a method
    that runs the model on changed inputs keeps scoring that token; an int / ints / a one-token
    string a given one. A :class:`relprop.targets.Contrast` is specified part by part."""
    head = head_kind(model)
    if torch.is_tensor(inputs):
        inputs = {"attention_mask": inputs}
    mask = positions_mask(head, inputs)
    if head in ("language_model", "encoder_decoder"):
        return _bind(_language_model(target, tokenizer, mask), mask)
    if head == "question_answering":
        return _bind(_question_answering(target, model), mask)
    if head == "token_classification":
        return _bind(_token_classification(target, model), mask)
    labels = label_ids(model)

    def one(t):
        if isinstance(t, str):
            # "next_token" on a model without generate(): the next token of its [batch, positions, vocabulary]
            # logits, if it has them (else resolve() says what it has)
            return predicted_next_token(mask) if t == "next_token" else _class_of(t, labels, model)
        if isinstance(t, (list, tuple)) and t and all(isinstance(x, str) for x in t):
            return [one(x) for x in t]
        return t

    if isinstance(target, Contrast):
        return Contrast(one(target.a), one(target.b))
    return _bind(one(target), mask)


def _language_model(target: Any, tokenizer: Any, mask) -> Any:
    def one(t):
        if isinstance(t, str) and t != "next_token":
            return next_token(mask, _token_of(t, tokenizer))
        if isinstance(t, (list, tuple)) and t and all(isinstance(x, str) for x in t):
            return next_token(mask, [_token_of(x, tokenizer) for x in t])
        if t is None or (isinstance(t, str) and t == "next_token"):
            return predicted_next_token(mask)
        if callable(t) or isinstance(t, bool):
            return t
        return next_token(mask, t)

    if isinstance(target, Contrast):
        return Contrast(one(target.a), one(target.b))
    return one(target)


def _question_answering(target: Any, model: Any) -> Any:
    if target is None:
        return question_answering("span")
    if isinstance(target, str):
        if target not in QA_PARTS:
            raise TargetError(f"target {target!r} is not a score of {type(model).__name__}'s answer span. Choices: "
                              f"None or {list(QA_PARTS)} (the predicted span), or "
                              "relprop.targets.question_answering(part, start=, end=) for given positions")
        return question_answering(target)
    if isinstance(target, Contrast) or callable(target):
        return target
    raise TargetError(f"{type(model).__name__} answers with a span, not a class: target={target!r} has no meaning "
                      "there; pass None or 'span' / 'start' / 'end' (the predicted span), or "
                      "relprop.targets.question_answering(part, start=, end=) for given positions")


def _token_classification(target: Any, model: Any) -> Any:
    if callable(target) and not torch.is_tensor(target) or isinstance(target, Contrast):
        return target
    raise TargetError(f"{type(model).__name__} labels every token: target={target!r} names no position. Pass "
                      "relprop.targets.token_classification(position, label) (label None: the predicted one)")
