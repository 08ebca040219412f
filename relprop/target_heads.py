"""Targets for the heads of extractive question answering and token classification.

* ``*ForQuestionAnswering`` (BERT, RoBERTa, DistilBERT, ... for SQuAD) returns ``start_logits`` and
  ``end_logits`` [batch, positions]: :func:`question_answering` explains the start score, the end
  score or the span score (start + end, the score the answer is chosen by), of the predicted span
  or of given positions — what AttCAT (Qiang et al., NeurIPS 2022, §5.3) explains on SQuAD.
* ``*ForTokenClassification`` (NER, POS) returns ``logits`` [batch, positions, labels]:
  :func:`token_classification` explains the score of one label at one position per sample.

Each returns a callable ``target(outputs) -> [batch]`` for :func:`relprop.explain`.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from .errors import TargetError

QA_PARTS = ("start", "end", "span")


def _per_sample(value, batch: int, device, name: str) -> torch.Tensor:
    t = torch.as_tensor(value, dtype=torch.long, device=device).flatten()
    if t.numel() == 1:
        t = t.expand(batch)
    if t.numel() != batch:
        raise TargetError(f"{name} must be one int or one per sample ({batch}), got {t.numel()} values")
    return t


def _field(outputs, name: str) -> torch.Tensor:
    v = getattr(outputs, name, None)
    if v is None and isinstance(outputs, dict):
        v = outputs.get(name)
    if v is None and isinstance(outputs, (tuple, list)):
        v = outputs[0 if name in ("start_logits", "logits") else 1]
    if not torch.is_tensor(v):
        head = "*ForQuestionAnswering" if name != "logits" else "*ForTokenClassification"
        raise TargetError(f"the model's outputs have no '{name}': this target is for a {head} model")
    return v


def best_span(start_logits: torch.Tensor, end_logits: torch.Tensor, max_length: int = 30) -> tuple:
    """([batch] start, [batch] end): the span with start ≤ end < start + ``max_length`` of the largest
    start + end score (the usual SQuAD decoding, over every position)."""
    s, e = start_logits.detach(), end_logits.detach()
    n = s.shape[-1]
    i = torch.arange(n, device=s.device)
    ok = (i[None, :] >= i[:, None]) & (i[None, :] < i[:, None] + max_length)  # [start, end]
    total = s[:, :, None] + e[:, None, :]
    total = total.masked_fill(~ok, float("-inf")).flatten(1)
    best = total.argmax(1)
    return best // n, best % n


def question_answering(part: str = "span", start: Any = None, end: Any = None) -> Callable:
    """Target of an extractive QA model: ``part="start"`` the start logit at ``start``, ``"end"`` the
    end logit at ``end``, ``"span"`` their sum (the span score). Positions: one int or one per sample;
    None takes the predicted span (:func:`best_span`). AttCAT (Qiang et al., NeurIPS 2022) §5.3
    explains these scores on SQuAD."""
    if part not in QA_PARTS:
        raise TargetError(f"part={part!r} is not a choice. Choices: {list(QA_PARTS)}")

    def target(outputs):
        s_logits, e_logits = _field(outputs, "start_logits"), _field(outputs, "end_logits")
        b = s_logits.shape[0]
        rows = torch.arange(b, device=s_logits.device)
        if start is None or end is None:
            bs, be = best_span(s_logits, e_logits)
        st = bs if start is None else _per_sample(start, b, s_logits.device, "start")
        en = be if end is None else _per_sample(end, b, s_logits.device, "end")
        if part == "start":
            return s_logits[rows, st]
        if part == "end":
            return e_logits[rows, en]
        return s_logits[rows, st] + e_logits[rows, en]
    return target


def token_classification(position: Any, label: Optional[Any] = None) -> Callable:
    """Target of a token-classification model: the logit of ``label`` (None: the predicted label) at
    ``position`` — one int or one per sample each."""
    def target(outputs):
        logits = _field(outputs, "logits")
        if logits.dim() != 3:
            raise TargetError(f"token classification logits are [batch, positions, labels]; got {tuple(logits.shape)}")
        b = logits.shape[0]
        rows = torch.arange(b, device=logits.device)
        pos = _per_sample(position, b, logits.device, "position")
        if bool((pos >= logits.shape[1]).any()) or bool((pos < -logits.shape[1]).any()):
            raise TargetError(f"position {pos.tolist()} is outside the {logits.shape[1]} positions")
        at = logits[rows, pos]
        lab = at.detach().argmax(-1) if label is None else _per_sample(label, b, logits.device, "label")
        if bool((lab >= logits.shape[2]).any()) or bool((lab < 0).any()):
            raise TargetError(f"label {lab.tolist()} is not one of the model's {logits.shape[2]} labels")
        return at[rows, lab]
    return target
