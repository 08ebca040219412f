"""Explanations drawn inline in a notebook: the HTML that Jupyter shows for ``Explanation._repr_html_``
(and that :func:`explanation_html` returns anywhere).

One panel per sample in a grid (text: the tokens coloured by their scores; images: the map over the
image as an inline base64 PNG, or the map alone), a caption naming the method, its preset and the
explained target, and a legend of relprop's colours (:mod:`relprop.viz.colours`). The HTML is
self-contained: inline styles only, no script, nothing fetched; every token and label is escaped.

The tokens, label names and image come from the arguments, else from the explanation when it remembers
them (``exp.tokens``, ``exp.labels``, ``exp.image``), else positions are named ``token j`` and classes
``class t``.
"""
from __future__ import annotations

import base64
import html as _html
import io
from typing import Any, List, Optional, Sequence

from . import api as vapi
from . import colours
from . import text as vtext
from . import vision_text as vvt
from .names import target_caption

#: at most this many samples are drawn; the caption says how many more there are
MAX_SAMPLES = 24
#: width (CSS pixels) of an image panel
IMAGE_WIDTH = 176

_BOX = ("font-family: -apple-system, 'Segoe UI', Helvetica, Arial, sans-serif; font-size: 13px; color: #222; "
        "background: #fff; padding: 6px 8px; border: 1px solid #e4e4e4; border-radius: 4px")


def legend_html() -> str:
    """The colour legend as a small inline bar: blue against, white none, red for."""
    stops = ", ".join(colours.ANCHORS)
    return ("<span style='font-size: 11px; color: #555'>against "
            f"<span style='display: inline-block; width: 90px; height: 9px; vertical-align: middle; "
            f"border: 1px solid #ccc; background: linear-gradient(to right, {stops})'></span> for</span>")


def _remembered(exp, name: str, given):
    return given if given is not None else getattr(exp, name, None)


def _sample_rows(exp, tokens) -> Optional[List[List[str]]]:
    if tokens is None:
        return None
    rows = list(tokens)
    return [rows] if rows and isinstance(rows[0], str) else rows


def _target(exp, index: int, labels) -> str:
    return target_caption(exp, index, labels)


def _png(rgb) -> str:
    from PIL import Image
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _image_panel(exp, index: int, image: Any, mean, std) -> str:
    img = None
    if image is not None:
        img = image[index] if (hasattr(image, "dim") and image.dim() == 4) or isinstance(image, (list, tuple)) \
            else image
    rgb = vapi.overlay(exp, img, index, mean=mean, std=std)
    return (f"<img alt='relevance map of sample {index}' src='data:image/png;base64,{_png(rgb)}' "
            f"style='width: {IMAGE_WIDTH}px; image-rendering: auto; display: block'>")


def _text_panel(exp, index: int, row: Optional[Sequence[str]]) -> str:
    n = int(exp.scores.shape[-1])
    names = list(row) if row is not None else [f"token {j}" for j in range(n)]
    toks = vtext.tokens_of(exp, index, names, merge_words=row is not None)
    return f"<div style='line-height: 2.0'>{vtext.tokens_html(toks)}</div>"


def explanation_html(exp, *, tokens: Optional[Sequence] = None, labels=None, image: Any = None, mean=None,
                     std=None, max_samples: int = MAX_SAMPLES) -> str:
    """The notebook HTML of an explanation: a caption (method, preset, kind, targets), then one panel per
    sample (at most ``max_samples``) in a grid, and the colour legend. Arguments as
    :func:`relprop.viz.api.show`; those not given are read from the explanation when it has them."""
    tokens = _remembered(exp, "tokens", tokens)
    labels = _remembered(exp, "labels", labels)
    image, _, mean, std = vapi.remembered(exp, image, None, mean, std)
    n = int(exp.scores.shape[0])
    shown = min(n, max_samples)
    prompt = vvt.is_vision_text(exp)  # a vision-language model: the image above the prompt's tokens
    vision = exp.map is not None or prompt
    rows = None if vision else _sample_rows(exp, tokens)
    if rows is not None and len(rows) != n:
        rows = None  # tokens of another batch: name the positions instead
    panels = []
    for i in range(shown):
        if prompt:
            body = vvt.sample_html(exp, i, _image_panel(vvt.image_view(exp), i, image, mean, std))
        else:
            body = _image_panel(exp, i, image, mean, std) if vision else _text_panel(exp, i, rows[i] if rows else None)
        head = _html.escape(f"sample {i}: {_target(exp, i, labels)}")
        panels.append(f"<div class='relprop-sample' data-index='{i}' style='min-width: 0'>"
                      f"<div style='font-size: 11px; color: #555; margin-bottom: 2px'>{head}</div>{body}</div>")
    kind = "signed" if exp.signed else "non-negative"
    preset = getattr(exp, "preset", None)
    what = f"{exp.method}" + (f", preset {preset}" if preset else "") + f" ({kind})"
    more = f"; {n - shown} more not shown" if n > shown else ""
    caption = (f"<div class='relprop-caption' style='margin-bottom: 4px'><b>{_html.escape(what)}</b> "
               f"<span style='color: #555'>{n} sample{'s' * (n != 1)}{_html.escape(more)}</span> "
               f"{legend_html()}</div>")
    width = f"{IMAGE_WIDTH + 8}px" if vision else "22em"
    grid = (f"<div style='display: grid; grid-template-columns: repeat(auto-fill, minmax({width}, 1fr)); "
            f"gap: 8px 14px'>{''.join(panels)}</div>")
    return f"<div class='relprop-explanation' style=\"{_BOX}\">{caption}{grid}</div>"
