"""Resolve the ``target`` argument of :func:`relprop.explain` into per-sample scores.

``target`` may be None (each sample's predicted class), an int (the same class for every sample),
one int per sample (a list or a tensor), or a callable ``target(outputs) -> [batch]`` returning
any differentiable score per sample (a logit difference, a similarity, ...). For language models,
:func:`next_token` builds the callable for the next token's logit at the last non-padding position
(``target="next_token"`` in :func:`relprop.explain`; a language model given ``target=None`` explains
its predicted next token the same way). :func:`contrast` makes the target ``score(a) − score(b)`` of two
classes or tokens, and :func:`specify` turns label names and token strings into indices. The relevance
seed is
the gradient of the summed scores with respect to the model's outputs: for a class index that is
exactly the one-hot vector of that class (CVPR 2021, §3.3: relevance 1 at the target logit).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, NamedTuple, Optional

import torch

from .errors import TargetError


class Target(NamedTuple):
    """A resolved target: ``score(outputs)`` -> [batch] differentiable target scores, and
    ``classes(outputs)`` -> [batch] class indices explained (None for a callable target)."""

    score: Callable[[Any], torch.Tensor]
    classes: Callable[[Any], Optional[torch.Tensor]]


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
        return Target(lambda outputs: ta.score(outputs) - tb.score(outputs), lambda outputs: None)
    if callable(target) and not torch.is_tensor(target):
        def score_fn(outputs):
            s = target(outputs)
            if not torch.is_tensor(s) or s.dim() != 1 or s.shape[0] != batch:
                shape = tuple(s.shape) if torch.is_tensor(s) else type(s).__name__
                raise TargetError(f"target callable must return one score per sample, shape [{batch}]; got {shape}")
            return s
        return Target(score_fn, lambda outputs: None)

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
        bad = (t < 0) | (t >= n)
        if bool(bad.any()):
            raise TargetError(f"target {t[bad].tolist()} out of range: valid class indices are 0..{n - 1} "
                              f"(the model has {n} classes)")
        return t

    def score_fn(outputs):
        t = target_of(outputs)
        logits = logits_of(outputs, wrt)
        return logits.gather(1, t[:, None]).squeeze(1)

    return Target(score_fn, target_of)


def fixed(classes: torch.Tensor, wrt: Optional[str] = None) -> Target:
    """The target ``logits[b, classes[b]]`` for fixed class indices (e.g. the classes an
    explanation was computed for, when a method re-runs the model on perturbed inputs)."""
    def score(outputs):
        logits = logits_of(outputs, wrt)
        return logits.gather(1, classes[:, None].to(logits.device)).squeeze(1)
    return Target(score, lambda outputs: classes)


def last_positions(attention_mask: Optional[torch.Tensor], batch: int, length: int) -> torch.Tensor:
    """[batch] index of the last non-padding position of each sample (``length - 1`` without a
    mask; right and left padding both work, since it is the last position where the mask is 1)."""
    if attention_mask is None:
        return torch.full((batch,), length - 1, dtype=torch.long)
    m = torch.as_tensor(attention_mask)
    if m.dim() != 2:
        raise TargetError(f"attention_mask must be [batch, positions], got shape {tuple(m.shape)}")
    real = m != 0
    if not bool(real.any(1).all()):
        empty = (~real.any(1)).nonzero().flatten().tolist()
        raise TargetError(f"samples {empty} have no non-padding position (attention_mask is all 0 there)")
    idx = torch.arange(m.shape[1], device=m.device)
    return torch.where(real, idx, torch.full_like(idx, -1)).amax(1)


def next_token(attention_mask: Optional[torch.Tensor] = None, token: Any = None) -> Callable:
    """Target for language models: the logit of the next token, read at the last non-padding
    position of each sample.

    Parameters
    ----------
    attention_mask : [batch, positions] (1 = real token, 0 = padding), e.g. the tokenizer's; None
        reads the last position of every sample.
    token : None (each sample's predicted next token: the argmax at that position), an int (the
        same token id for every sample), or one id per sample.

    Returns a callable ``target(outputs) -> [batch]`` for :func:`relprop.explain`: ``outputs.logits``
    (or the output tensor) of shape [batch, positions, vocabulary] indexed at
    ``[b, last_b, token_b]``. ``relprop.explain(lm, batch, target="next_token")`` is the same with
    the mask taken from the inputs and the predicted token. The relevance seed is then the one-hot
    of that token at that position (CVPR 2021, §3.3).
    """
    if isinstance(token, bool):
        raise TargetError("token must be an int, one int per sample, or None, not bool")

    def score(outputs):
        logits = logits_of(outputs)
        if logits.dim() != 3:
            raise TargetError(f"next_token needs [batch, positions, vocabulary] logits (a language model); "
                              f"got shape {tuple(logits.shape)}. For a sequence classifier pass the class index.")
        b, n, vocab = logits.shape
        pos = last_positions(attention_mask, b, n).to(logits.device)
        if tuple(pos.shape) != (b,) or bool((pos >= n).any()):
            raise TargetError(f"attention_mask of shape {tuple(torch.as_tensor(attention_mask).shape)} does not "
                              f"fit logits of shape {tuple(logits.shape)}")
        rows = logits[torch.arange(b, device=logits.device), pos]  # [batch, vocabulary]
        if token is None:
            t = rows.detach().argmax(-1)
        else:
            try:
                t = torch.as_tensor(token, device=logits.device)
            except (TypeError, ValueError):
                raise TargetError(f"token must be an int or ints per sample, not {type(token).__name__}") from None
            if t.dtype.is_floating_point or t.dtype == torch.bool:
                raise TargetError(f"token ids must be integers, got dtype {t.dtype}")
            t = t.long().reshape(-1).expand(b) if t.numel() == 1 else t.long().reshape(-1)
            if t.numel() != b:
                raise TargetError(f"token has {t.numel()} entries but the batch has {b} samples")
            bad = (t < 0) | (t >= vocab)
            if bool(bad.any()):
                raise TargetError(f"token {t[bad].tolist()} out of range: valid ids are 0..{vocab - 1}")
        return rows.gather(1, t[:, None]).squeeze(1)

    return score


def predicted_next_token(attention_mask: Optional[torch.Tensor] = None) -> Callable:
    """:func:`next_token` for the token the model predicts on the explained inputs: the argmax is taken
    once, at the first call (the engine's forward pass on the inputs themselves), and kept, so a method
    that runs the model again on changed inputs (integrated gradients' path, SmoothGrad's noisy copies,
    masks) keeps scoring the same token."""
    chosen: Dict[str, torch.Tensor] = {}

    def score(outputs):
        if "token" not in chosen:
            logits = logits_of(outputs)
            if logits.dim() == 3:
                b, n, _ = logits.shape
                pos = last_positions(attention_mask, b, n).to(logits.device)
                chosen["token"] = logits[torch.arange(b, device=logits.device), pos].detach().argmax(-1)
        return next_token(attention_mask, chosen.get("token"))(outputs)

    return score


class Contrast(NamedTuple):
    """The target ``score(a) − score(b)``: what makes the model choose ``a`` over ``b`` (see :func:`contrast`)."""

    a: Any
    b: Any


def contrast(a: Any, b: Any) -> Contrast:
    """A contrastive target for :func:`relprop.explain`: the difference of the scores (logits) of ``a``
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


def is_language_model(model: Any) -> bool:
    """True for a HuggingFace model that generates text (``model.can_generate()``), whose logits are
    [batch, positions, vocabulary]: its targets are read at the last non-padding position."""
    can = getattr(model, "can_generate", None)
    try:
        return bool(can()) if callable(can) else False
    except Exception:  # noqa: BLE001 - a model whose can_generate() fails is not treated as a language model
        return False


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


def specify(target: Any, model: Any, tokenizer: Any = None, attention_mask: Optional[torch.Tensor] = None) -> Any:
    """The ``target=`` of :func:`relprop.explain` in the form :func:`resolve` takes.

    Label names (a string, or one per sample) become class indices from the model's labels. For a
    language model (:func:`is_language_model`) every target is a next token at the last non-padding
    position of ``attention_mask``: None and ``"next_token"`` the predicted one, chosen once on the
    inputs (:func:`predicted_next_token`), so a method that runs the model on changed inputs (integrated
    gradients' path, SmoothGrad's noisy copies) keeps scoring that token; an int / ints / a one-token
    string a given one. (The callable :func:`next_token` without ``token`` takes the argmax of every
    forward pass it sees; pass it yourself when that is what you want.)
    A :class:`Contrast` is specified part by part. Anything else is returned as it is.
    """
    lm = is_language_model(model)
    labels = None if lm else label_ids(model)

    def one(t):
        if isinstance(t, str) and t != "next_token":
            return _token_of(t, tokenizer) if lm else _class_of(t, labels, model)
        if isinstance(t, (list, tuple)) and t and all(isinstance(x, str) for x in t):
            return [one(x) for x in t]
        return t

    if isinstance(target, Contrast):
        a, b = one(target.a), one(target.b)
        if lm:
            a = a if callable(a) else next_token(attention_mask, a)
            b = b if callable(b) else next_token(attention_mask, b)
        return Contrast(a, b)
    t = one(target)
    if isinstance(t, str) or (lm and t is None):  # "next_token" / None: the token predicted on the inputs
        return predicted_next_token(attention_mask)
    if lm and not callable(t) and not isinstance(t, bool):
        return next_token(attention_mask, t)
    return t
