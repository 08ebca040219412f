"""What an explanation's pictures call its target and its classes: one place for every caption
(terminal, HTML, figures, notebooks) and for the export's ``target_label``.

The name of sample ``i``'s target is, in order: ``labels[t]`` when class names are passed to the
renderer, else the explanation's remembered ``target_label[i]`` (a label name given as ``target=``, a
language model's next-token string), else its remembered ``labels[t]`` (``config.id2label``, a
pipeline's or timm's label names), else ``"class t"``; a callable target without a name has none.
"""
from __future__ import annotations

from typing import Any, Optional


def label_name(labels, t: int) -> str:
    """``labels[t]`` for a dict (id2label) or a list of names; ``"class t"`` without a name."""
    if labels is None:
        return f"class {t}"
    try:
        name = labels[t] if not isinstance(labels, dict) else labels.get(t, labels.get(str(t)))
    except (IndexError, TypeError):
        name = None
    return f"{name}" if name is not None else f"class {t}"


def remembered_label(exp: Any, index: int) -> Optional[str]:
    """Sample ``index``'s remembered ``target_label`` (a list, one per sample; a single string
    for every sample), or None."""
    names = getattr(exp, "target_label", None)
    if names is None or isinstance(names, str):
        return names
    return names[index] if 0 <= index < len(names) and names[index] is not None else None


def is_next_token(exp: Any) -> bool:
    """True when the explained target is a language model's next token: a token id per sample and
    [batch, positions, vocabulary] logits."""
    logits = getattr(exp, "logits", None)
    return exp.target is not None and logits is not None and getattr(logits, "dim", lambda: 0)() == 3


def target_name(exp: Any, index: int, labels=None) -> Optional[str]:
    """The name of sample ``index``'s explained target (see the module docstring); None for a
    callable target the explanation knows no name of."""
    if exp.target is None:
        return remembered_label(exp, index)
    t = int(exp.target[index])
    if labels is not None:
        return label_name(labels, t)
    name = remembered_label(exp, index)
    return name if name is not None else label_name(getattr(exp, "labels", None), t)


def target_caption(exp: Any, index: int, labels=None) -> str:
    """``"dog (score 3.2)"``, ``"next token ' Paris' (id 6342), score 12.3"`` or ``"score 0.61"``."""
    score = float(exp.target_scores[index])
    name = target_name(exp, index, labels)
    if is_next_token(exp):
        shown = repr(name) if name is not None and not name.startswith("class ") else "?"
        return f"next token {shown} (id {int(exp.target[index])}), score {score:.3g}"
    return f"{name} (score {score:.3g})" if name is not None else f"score {score:.3g}"
