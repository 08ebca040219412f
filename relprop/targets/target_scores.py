"""Resolve the ``target`` argument of :func:`relprop.explain` into per-sample scores.

``target`` may be None (each sample's predicted class), an int (the same class for every sample),
one int per sample (a list or a tensor), or a callable ``target(outputs) -> [batch]`` returning
any differentiable score per sample (a logit difference, a similarity, ...). For language models,
:func:`next_token` builds the callable for the next token's logit at the last non-padding position
(``target="next_token"`` in :func:`relprop.explain`; a language model given ``target=None`` explains
its predicted next token the same way). :func:`contrast` makes the target ``score(a) − score(b)`` of two
classes or tokens; :func:`relprop.targets.target_forms.specify` turns every form of ``target=`` into one of
these for the model's head. The relevance
seed is
the gradient of the summed scores with respect to the model's outputs: for a class index that is
exactly the one-hot vector of that class (CVPR 2021, §3.3: relevance 1 at the target logit).
"""
from __future__ import annotations

import copy
from typing import Any, Callable, Dict, NamedTuple, Optional

import torch

from ..errors import TargetError
from ..graph.host_reads import refuse_if


class Target(NamedTuple):
    """A resolved target: ``score(outputs)`` -> [batch] differentiable target scores, and
    ``classes(outputs)`` -> [batch] class indices explained (None for a callable target).

    :attr:`rows` says how many rows of the model's output the score reads at most, where that is known."""

    score: Callable[[Any], torch.Tensor]
    classes: Callable[[Any], Optional[torch.Tensor]]

    @property
    def rows(self) -> Optional[int]:
        """The most rows of the model's output (its positions of all samples, every axis but the last) the
        score reads (a next token's logit: one per sample), or None where it is not known: the score's
        ``rows`` attribute. The engine computes the rules of the layers next to the output on those rows
        only, found on the device."""
        return getattr(self.score, "rows", None)


def rows_read(target: Any, batch: int) -> Optional[int]:
    """The most rows of the model's output a callable ``target`` reads: its ``rows_read(batch)`` where it
    says (:class:`NextToken`, the teacher-forced copies of generation), else None."""
    says = getattr(target, "rows_read", None)
    return says(batch) if callable(says) else None


def _reading(score: Callable, rows: Optional[int]) -> Callable:
    """``score`` with the number of rows it reads as its ``rows`` attribute (:attr:`Target.rows`)."""
    if rows is not None:
        score.rows = rows
    return score


def find_logits(outputs: Any) -> Optional[torch.Tensor]:
    """The class scores of a classifier's output: the output itself when it is a tensor,
    ``outputs.logits``, or the first entry of a tuple; None when there are none (a CLIP model's
    similarity matrices are read by :func:`logits_of`, which knows the explained tower)."""
    if torch.is_tensor(outputs):
        return outputs
    logits = getattr(outputs, "logits", None)
    if torch.is_tensor(logits):
        return logits
    if isinstance(outputs, (tuple, list)) and outputs and torch.is_tensor(outputs[0]):
        return outputs[0]
    return None


def require_input_dependence(scores: torch.Tensor) -> None:
    """Refuse target scores that do not depend on the explained input (nothing to explain)."""
    if not scores.requires_grad:
        raise TargetError("the target score does not depend on the explained input; nothing to explain. "
                          "A callable target must compute its score from the model's outputs")


def logits_of(outputs: Any, wrt: Optional[str] = None) -> torch.Tensor:
    """The class scores of a model output: a tensor, ``outputs.logits`` or ``outputs[0]``; for CLIP
    (``logits_per_image`` and ``logits_per_text``) the similarities of the explained tower's items
    with the other tower's: ``logits_per_image`` when the explained input ``wrt`` is
    ``"pixel_values"``, else ``logits_per_text``."""
    found = find_logits(outputs)
    if found is not None:
        return found
    per_image, per_text = getattr(outputs, "logits_per_image", None), getattr(outputs, "logits_per_text", None)
    if torch.is_tensor(per_image) and torch.is_tensor(per_text):
        # CLIP: the similarities of the explained tower's items (rows) with the other tower's (classes)
        return per_image if wrt == "pixel_values" else per_text
    raise TargetError(
        f"cannot find class scores in the model's output ({type(outputs).__name__}); "
        "pass target=callable(outputs) -> [batch] scores"
    )


def resolve(target: Any, batch: int, wrt: Optional[str] = None) -> Target:
    """The :class:`Target` of ``explain(target=...)``: the [batch] target scores and the [batch]
    class indices (None for a callable target) as functions of the model's outputs; ``wrt`` is the
    explained input (it decides which similarity matrix of a CLIP model holds the classes).
    A :class:`Contrast` scores ``score(a) − score(b)`` and, like a callable, explains no single class."""
    if isinstance(target, Contrast):
        ta, tb = resolve(target.a, batch, wrt), resolve(target.b, batch, wrt)
        rows = ta.rows + tb.rows if ta.rows is not None and tb.rows is not None else None

        def difference(outputs):
            return ta.score(outputs) - tb.score(outputs)
        return Target(_reading(difference, rows), lambda outputs: None)
    if callable(target) and not torch.is_tensor(target):
        def score_fn(outputs):
            s = target(outputs)
            if not torch.is_tensor(s) or s.dim() != 1 or s.shape[0] != batch:
                shape = tuple(s.shape) if torch.is_tensor(s) else type(s).__name__
                raise TargetError(f"target callable must return one score per sample, shape [{batch}]; got {shape}")
            return s
        return Target(_reading(score_fn, rows_read(target, batch)), lambda outputs: None)

    def target_of(outputs) -> torch.Tensor:
        logits = logits_of(outputs, wrt)
        if logits.dim() != 2:
            raise TargetError(
                f"the model's class scores have shape {tuple(logits.shape)}, not [batch, classes]; "
                "for a language model pass target='next_token' (or relprop.targets.next_token(mask, token)); "
                "for other token-level outputs target=callable(outputs) -> [batch]"
            )
        if logits.shape[0] != batch:  # e.g. CLIP's logits_per_image [images, texts] with the text tower explained
            raise TargetError(
                f"the model's first output has {logits.shape[0]} rows but the explained input has {batch} samples; "
                "pass target=callable(outputs) -> [batch] (for CLIP's text tower: "
                "target=lambda o: o.logits_per_text[:, image_index])"
            )
        n = logits.shape[1]
        if target is None:
            return logits.detach().argmax(-1)
        if isinstance(target, bool):
            raise TargetError("target must be an int, a sequence of ints, a tensor or a callable, not bool")
        if isinstance(target, int):
            t = torch.full((batch,), target, dtype=torch.long, device=logits.device)
        else:
            try:
                t = torch.as_tensor(target, device=logits.device)
            except (TypeError, ValueError):
                raise TargetError(f"target must be an int, ints per sample or a callable, "
                                  f"not {type(target).__name__}") from None
            if t.dtype.is_floating_point or t.dtype == torch.bool:
                raise TargetError(f"target indices must be integers, got dtype {t.dtype}")
            t = t.long().reshape(-1)
            if t.numel() == 1:
                t = t.expand(batch).clone()
            if t.numel() != batch:
                raise TargetError(f"target has {t.numel()} entries but the batch has {batch} samples")
        def out_of_range(flags, classes):
            bad = [c for c, f in zip(classes, flags) if f]
            return TargetError(f"target {bad} out of range: valid class indices are 0..{n - 1} "
                               f"(the model has {n} classes)")
        refuse_if((t < 0) | (t >= n), out_of_range, t)  # (read with the call's other checks)
        return t.clamp(0, n - 1)

    def score_fn(outputs):
        t = target_of(outputs)
        logits = logits_of(outputs, wrt)
        return logits.gather(1, t[:, None]).squeeze(1)

    return Target(_reading(score_fn, batch), target_of)


def fixed(classes: torch.Tensor, wrt: Optional[str] = None) -> Target:
    """The target ``logits[b, classes[b]]`` for fixed class indices (e.g. the classes an
    explanation was computed for, when a method re-runs the model on perturbed inputs)."""
    def score(outputs):
        logits = logits_of(outputs, wrt)
        return logits.gather(1, classes[:, None].to(logits.device)).squeeze(1)
    return Target(_reading(score, classes.numel()), lambda outputs: classes)


def teacher_forced(positions: torch.Tensor, tokens: torch.Tensor,
                   other: Optional[torch.Tensor] = None) -> Callable:
    """The score of a batch of teacher-forced copies of one sequence (``relprop.explain_generation``):
    copy i's logit of ``tokens[i]`` at position ``positions[i]``, minus that of ``other[i]`` when given."""
    rows = torch.arange(tokens.numel())

    def score(outputs):
        logits = logits_of(outputs)  # outputs.logits, or the logits themselves (a wrapper's output)
        s = logits[rows, positions, tokens]
        return s if other is None else s - logits[rows, positions, other]
    score.rows_read = lambda batch: tokens.numel()  # one row (its position) per copy
    return score


def last_positions(attention_mask: Optional[torch.Tensor], batch: int, length: int) -> torch.Tensor:
    """[batch] index of the last non-padding position of each sample (``length - 1`` without a
    mask; right and left padding both work, since it is the last position where the mask is 1)."""
    if attention_mask is None:
        return torch.full((batch,), length - 1, dtype=torch.long)
    m = torch.as_tensor(attention_mask)
    if m.dim() != 2:
        raise TargetError(f"attention_mask must be [batch, positions], got shape {tuple(m.shape)}")
    real = m != 0

    def empty_samples(flags, _):
        empty = [i for i, f in enumerate(flags) if f]
        return TargetError(f"samples {empty} have no non-padding position (attention_mask is all 0 there)")
    refuse_if(~real.any(1), empty_samples)  # (read with the call's other checks)
    idx = torch.arange(m.shape[1], device=m.device)
    return torch.where(real, idx, torch.full_like(idx, -1)).amax(1).clamp_min(0)


class PositionTarget:
    """A target read at positions of the model's output (a next token, an answer span, a labelled
    token), which needs the mask of those positions: ``mask`` [batch, positions] (1 = real, 0 =
    padding) or None (not given). :func:`relprop.explain` gives a target made without a mask the
    mask of the output's positions (:func:`relprop.targets.target_forms.positions_mask`: the attention
    mask of a decoder or a QA / token-classification encoder, the decoder's mask of an encoder–
    decoder), so the callable and the string form of a target read the same positions."""

    mask: Optional[torch.Tensor] = None

    def bound(self, mask: Optional[torch.Tensor]) -> "PositionTarget":
        """This target, or a copy with ``mask`` when it was made without one."""
        if self.mask is not None or mask is None:
            return self
        other = copy.copy(self)
        other.mask = mask
        return other


def check_mask_argument(mask: Any, what: str) -> None:
    """A :class:`TargetError` when the mask argument of ``what`` is not a [batch, positions] mask
    (an int there is most likely a token id meant for ``token=``)."""
    if mask is None:
        return
    if torch.is_tensor(mask):
        if mask.dim() != 2:
            raise TargetError(f"{what}: the first argument is the attention mask [batch, positions] (1 = real token, "
                              f"0 = padding), not a tensor of shape {tuple(mask.shape)}")
        return
    rows = isinstance(mask, (list, tuple)) and all(isinstance(r, (list, tuple)) or torch.is_tensor(r) for r in mask)
    if not rows:
        hint = f"; for token id(s) {mask!r} write {what}(token={mask!r})" if what == "next_token" else ""
        raise TargetError(f"{what}: the first argument is the attention mask [batch, positions] (1 = real token, "
                          f"0 = padding), and {mask!r} ({type(mask).__name__}) is not one{hint}")


class NextToken(PositionTarget):
    """The callable :func:`next_token` returns (see there)."""

    def __init__(self, attention_mask: Optional[torch.Tensor] = None, token: Any = None):
        check_mask_argument(attention_mask, "next_token")
        if isinstance(token, bool):
            raise TargetError("token must be an int, one int per sample, or None, not bool")
        self.mask, self.token = attention_mask, token

    def rows_read(self, batch: int) -> int:
        """The rows of the [batch, positions, vocabulary] logits the score reads: one per sample."""
        return batch

    def __call__(self, outputs):
        logits = logits_of(outputs)
        if logits.dim() != 3:
            raise TargetError(f"next_token needs [batch, positions, vocabulary] logits (a language model); "
                              f"got shape {tuple(logits.shape)}. For a sequence classifier pass the class index.")
        b, n, vocab = logits.shape
        pos = last_positions(self.mask, b, n).to(logits.device)
        shape = tuple(torch.as_tensor(self.mask).shape) if self.mask is not None else None

        def misfit(*_):
            return TargetError(f"attention_mask of shape {shape} does not fit logits of shape {tuple(logits.shape)} "
                               "(the mask must cover the positions of the logits: for an encoder-decoder, the "
                               "decoder's)")
        if tuple(pos.shape) != (b,):
            raise misfit()
        if shape is not None and shape[-1] > n:  # positions past the logits: refused where a sample's last is one
            refuse_if((pos >= n).any(), misfit)
            pos = pos.clamp_max(n - 1)
        rows = logits[torch.arange(b, device=logits.device), pos]  # [batch, vocabulary]
        if self.token is None:
            t = rows.detach().argmax(-1)
        else:
            try:
                t = torch.as_tensor(self.token, device=logits.device)
            except (TypeError, ValueError):
                raise TargetError(f"token must be an int or ints per sample, not {type(self.token).__name__}") from None
            if t.dtype.is_floating_point or t.dtype == torch.bool:
                raise TargetError(f"token ids must be integers, got dtype {t.dtype}")
            t = t.long().reshape(-1).expand(b) if t.numel() == 1 else t.long().reshape(-1)
            if t.numel() != b:
                raise TargetError(f"token has {t.numel()} entries but the batch has {b} samples")

            def out_of_range(flags, tokens):
                bad = [tok for tok, f in zip(tokens, flags) if f]
                return TargetError(f"token {bad} out of range: valid ids are 0..{vocab - 1}")
            refuse_if((t < 0) | (t >= vocab), out_of_range, t)
            t = t.clamp(0, vocab - 1)
        return rows.gather(1, t[:, None]).squeeze(1)


def next_token(attention_mask: Optional[torch.Tensor] = None, token: Any = None) -> Callable:
    """Target for language models: the logit of the next token, read at the last non-padding
    position of each sample.

    Parameters
    ----------
    attention_mask
        [batch, positions] (1 = real token, 0 = padding) of the logits' positions, e.g.
        the tokenizer's (an encoder–decoder's: the decoder's). None: ``relprop.explain`` gives it
        the mask of the output's positions from the inputs (so ``target=next_token()`` and
        ``target="next_token"`` read the same position); called on its own, the last position.
    token
        None (each sample's predicted next token: the argmax at that position), an int (the
        same token id for every sample), or one id per sample.

    Returns
    -------
    Callable
        ``target(outputs) -> [batch]`` for ``relprop.explain``: ``outputs.logits``
        (or the output tensor) of shape [batch, positions, vocabulary] indexed at
        ``[b, last_b, token_b]``. ``relprop.explain(lm, batch, target="next_token")`` is the same with
        the predicted token. The relevance seed is then the one-hot of that token at that position
        (CVPR 2021, §3.3).
    """
    return NextToken(attention_mask, token)


class PredictedNextToken(PositionTarget):
    """The callable :func:`predicted_next_token` returns (see there)."""

    def __init__(self, attention_mask: Optional[torch.Tensor] = None):
        check_mask_argument(attention_mask, "predicted_next_token")
        self.mask = attention_mask
        self.chosen: Dict[str, torch.Tensor] = {}

    def bound(self, mask):
        other = super().bound(mask)
        if other is not self:
            other.chosen = {}
        return other

    def __call__(self, outputs):
        if "token" not in self.chosen:
            logits = logits_of(outputs)
            if logits.dim() == 3:
                b, n, _ = logits.shape
                pos = last_positions(self.mask, b, n).to(logits.device)
                self.chosen["token"] = logits[torch.arange(b, device=logits.device), pos].detach().argmax(-1)
        return NextToken(self.mask, self.chosen.get("token"))(outputs)


def predicted_next_token(attention_mask: Optional[torch.Tensor] = None) -> Callable:
    """``next_token`` for the token the model predicts on the explained inputs: the argmax is taken
    once, at the first call (the engine's forward pass on the inputs themselves), and kept, so a method
    that runs the model again on changed inputs (integrated gradients' path, SmoothGrad's noisy copies,
    masks) keeps scoring the same token."""
    return PredictedNextToken(attention_mask)


def explained_tokens(target: Any, logits: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The [batch] token ids a next-token target explains (:func:`next_token`,
    :func:`predicted_next_token`) given the model's [batch, positions, vocabulary] ``logits`` on the
    explained inputs; None for any other target or without such logits."""
    if isinstance(target, PredictedNextToken):
        chosen = target.chosen.get("token")
        if chosen is not None:
            return chosen
        target = NextToken(target.mask)
    if not isinstance(target, NextToken) or not torch.is_tensor(logits) or logits.dim() != 3:
        return None
    b, n, _ = logits.shape
    if target.token is None:
        pos = last_positions(target.mask, b, n).to(logits.device)
        return logits[torch.arange(b, device=logits.device), pos].detach().argmax(-1)
    t = torch.as_tensor(target.token, device=logits.device).long().reshape(-1)
    return t.expand(b).clone() if t.numel() == 1 else t


class Contrast(NamedTuple):
    """The target ``score(a) − score(b)``: what makes the model choose ``a`` over ``b`` (see :func:`contrast`)."""

    a: Any
    b: Any


def contrast(a: Any, b: Any) -> Contrast:
    """A contrastive target for ``relprop.explain``: the difference of the scores (logits) of ``a``
    and ``b``, ``f_a(x) − f_b(x)``, explained like any other score (the relevance seed is +1 at ``a`` and
    −1 at ``b``; CVPR 2021 §3.3 seeds the one-hot of the explained logit, this seeds its difference).

    ``a`` and ``b`` are each what ``target=`` takes for the model: a class index, a label name from the
    model's ``config.label2id``, one of those per sample; for a language model a token id or a string of
    one token (with ``tokenizer=``), scored at the last non-padding position. A callable
    ``outputs -> [batch]`` is accepted too. ``exp.target`` is None (no single class is explained) and
    ``exp.target_scores`` holds the differences.
    """
    for name, t in (("a", a), ("b", b)):
        if t is None or isinstance(t, (bool, Contrast)) or (isinstance(t, str) and t == "next_token"):
            raise TargetError(f"contrast({a!r}, {b!r}): {name} must be a class or token (an index, a label name, "
                              "one per sample, or a callable), not the predicted class")
    return Contrast(a, b)
