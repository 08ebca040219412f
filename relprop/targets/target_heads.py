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

from ..errors import TargetError
from .target_scores import PositionTarget, check_mask_argument

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


def best_span(start_logits: torch.Tensor, end_logits: torch.Tensor, max_length: int = 30,
              mask: Optional[torch.Tensor] = None) -> tuple:
    """([batch] start, [batch] end): the span with start ≤ end < start + ``max_length`` of the largest
    start + end score (the usual SQuAD decoding), over the real positions of ``mask`` ([batch,
    positions], 1 = real, 0 = padding; every position without one): a span never starts or ends in
    padding."""
    s, e = start_logits.detach(), end_logits.detach()
    n = s.shape[-1]
    i = torch.arange(n, device=s.device)
    ok = (i[None, :] >= i[:, None]) & (i[None, :] < i[:, None] + max_length)  # [start, end]
    total = s[:, :, None] + e[:, None, :]
    ok = ok[None].expand(total.shape)
    if mask is not None:
        real = _real_positions(mask, s.shape, "best_span").to(s.device)
        ok = ok & real[:, :, None] & real[:, None, :]
    total = total.masked_fill(~ok, float("-inf")).flatten(1)
    best = total.argmax(1)
    return best // n, best % n


def _real_positions(mask, shape, what: str) -> torch.Tensor:
    """[batch, positions] bool from a mask that must fit the logits' ``shape`` ([batch, positions, ...])."""
    m = torch.as_tensor(mask)
    if m.dim() != 2 or tuple(m.shape) != tuple(shape[:2]):
        raise TargetError(f"{what}: the attention mask has shape {tuple(m.shape)}, and the logits cover "
                          f"{tuple(shape[:2])} (batch, positions)")
    real = m != 0
    if not bool(real.any(1).all()):
        raise TargetError(f"{what}: samples {(~real.any(1)).nonzero().flatten().tolist()} have no real position")
    return real


class QuestionAnswering(PositionTarget):
    """The callable :func:`question_answering` returns (see there)."""

    def __init__(self, part: str = "span", start: Any = None, end: Any = None, attention_mask=None):
        if part not in QA_PARTS:
            raise TargetError(f"part={part!r} is not a choice. Choices: {list(QA_PARTS)}")
        check_mask_argument(attention_mask, "question_answering")
        self.part, self.start, self.end, self.mask = part, start, end, attention_mask

    def __call__(self, outputs):
        s_logits, e_logits = _field(outputs, "start_logits"), _field(outputs, "end_logits")
        b = s_logits.shape[0]
        rows = torch.arange(b, device=s_logits.device)
        if self.start is None or self.end is None:
            bs, be = best_span(s_logits, e_logits, mask=self.mask)
        st = bs if self.start is None else _per_sample(self.start, b, s_logits.device, "start")
        en = be if self.end is None else _per_sample(self.end, b, s_logits.device, "end")
        if self.part == "start":
            return s_logits[rows, st]
        if self.part == "end":
            return e_logits[rows, en]
        return s_logits[rows, st] + e_logits[rows, en]


def question_answering(part: str = "span", start: Any = None, end: Any = None, attention_mask=None) -> Callable:
    """Target of an extractive QA model: ``part="start"`` the start logit at ``start``, ``"end"`` the
    end logit at ``end``, ``"span"`` their sum (the span score). Positions: one int or one per sample;
    None takes the predicted span (``best_span``) over the real positions of ``attention_mask``
    (None: ``relprop.explain`` gives it the inputs' attention mask). AttCAT (Qiang et al.,
    NeurIPS 2022) §5.3 explains these scores on SQuAD. ``explain(qa_model, batch, target="span")``
    (or ``"start"``, ``"end"``, or None for ``"span"``) is the same."""
    return QuestionAnswering(part, start, end, attention_mask)


class TokenClassification(PositionTarget):
    """The callable :func:`token_classification` returns (see there)."""

    def __init__(self, position: Any, label: Optional[Any] = None, attention_mask=None):
        check_mask_argument(attention_mask, "token_classification")
        self.position, self.label, self.mask = position, label, attention_mask

    def __call__(self, outputs):
        logits = _field(outputs, "logits")
        if logits.dim() != 3:
            raise TargetError(f"token classification logits are [batch, positions, labels]; got {tuple(logits.shape)}")
        b = logits.shape[0]
        rows = torch.arange(b, device=logits.device)
        pos = _per_sample(self.position, b, logits.device, "position")
        if bool((pos >= logits.shape[1]).any()) or bool((pos < -logits.shape[1]).any()):
            raise TargetError(f"position {pos.tolist()} is outside the {logits.shape[1]} positions")
        if self.mask is not None:
            real = _real_positions(self.mask, logits.shape, "token_classification").to(logits.device)
            pad = ~real[rows, pos]
            if bool(pad.any()):
                raise TargetError(f"position {pos[pad].tolist()} of sample(s) {pad.nonzero().flatten().tolist()} is "
                                  "padding (attention mask 0): explain a real token")
        at = logits[rows, pos]
        lab = at.detach().argmax(-1) if self.label is None else _per_sample(self.label, b, logits.device, "label")
        if bool((lab >= logits.shape[2]).any()) or bool((lab < 0).any()):
            raise TargetError(f"label {lab.tolist()} is not one of the model's {logits.shape[2]} labels")
        return at[rows, lab]


def token_classification(position: Any, label: Optional[Any] = None, attention_mask=None) -> Callable:
    """Target of a token-classification model: the logit of ``label`` (None: the predicted label) at
    ``position`` — one int or one per sample each; a padding position of ``attention_mask`` (None:
    ``relprop.explain`` gives it the inputs') is refused."""
    return TokenClassification(position, label, attention_mask)
