"""Pictures of a vision-language model's explanation: the image's relevance as a heatmap over the image
beside the prompt's tokens coloured by their relevance, from one run (``exp.streams``: ``"pixel_values"``
per patch, ``"input_ids"`` per prompt token); and the generation attribution of an image prompt (one
heatmap over the image per generated token, above the token matrix).

The prompt's image placeholders are drawn as one grey chip (``[image: n tokens]``) holding their summed
relevance: 0 when the pixels were explained (the image's share is in the heatmap), the image tokens'
scores when the language model's blocks were (rollouts). Colours: relprop's one colour language
(:mod:`relprop.viz.colours`), the heatmap and the tokens each scaled by their own largest |value|; the
panel titles give each part's sum, so the image's and the prompt's shares of the score can be read.
"""
from __future__ import annotations

import dataclasses
import html as _html
from typing import Any, List, Optional, Sequence

from . import colours
from .generation import matrix_table
from .image import (DEFAULT_PERCENTILE, DIVERGING_CMAP, _new_figure, _numpy, _resize, blend, clip_limits,
                    display_image, draw_overlay, save_figure)
from .text import Token, colour, scale_of, tokens_html

IDS, PIXELS = "input_ids", "pixel_values"


def is_vision_text(exp) -> bool:
    """True for a vision-language model's explanation that holds both the image's and the prompt's
    relevance (``exp.streams`` with ``"pixel_values"`` and ``"input_ids"``, the placeholders known)."""
    streams = getattr(exp, "streams", None) or {}
    return IDS in streams and PIXELS in streams and getattr(exp, "image_tokens", None) is not None


def prompt_chips(scores, image_tokens, names: Optional[Sequence[str]] = None) -> List[Token]:
    """The prompt as chips: one per token (``names``, else its position), each run of image placeholders
    one chip ``[image: n tokens]`` with their summed score (marked special when it is 0: no colour)."""
    s = _numpy(scores).astype(float)
    at = _numpy(image_tokens).astype(bool)
    out: List[Token] = []
    j = 0
    while j < len(s):
        if at[j]:
            k = j
            while k < len(s) and at[k]:
                k += 1
            total = float(s[j:k].sum())
            out.append(Token(f"[image: {k - j} tokens]", total, total == 0.0, k - j))
            j = k
            continue
        out.append(Token(str(names[j]) if names is not None else f"#{j}", float(s[j]), False))
        j += 1
    return out


def _names(exp, index: int, tokens) -> Optional[Sequence[str]]:
    if tokens is not None:
        rows = list(tokens)
        return rows[index] if rows and not isinstance(rows[0], str) else rows
    remembered = getattr(exp, "prompt_tokens", None)
    return remembered[index] if remembered is not None else None


def image_view(exp):
    """``exp`` as an image explanation for :func:`relprop.viz.image.draw_overlay`: itself when it has a
    pixel map; else (the rollouts) its patch scores (``streams["pixel_values"]``) on the patch grid."""
    if getattr(exp, "map", None) is not None:
        return exp
    patches = exp.streams[PIXELS].detach().float()
    gh, gw = exp.grid if exp.grid is not None else (int(round(patches.shape[1] ** 0.5)),) * 2
    return dataclasses.replace(exp, scores=patches, map=patches.reshape(-1, gh, gw), grid=(gh, gw))


def draw_tokens(ax, chips: List[Token], *, fontsize: float = 10.0, title: str = "", note: str = "") -> None:
    """Draw ``chips`` on the axes ``ax`` as wrapped coloured boxes (scaled by the largest |score|), and
    ``note`` in small grey type below them."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    fig = ax.figure
    canvas = fig.canvas if type(fig.canvas).__name__ != "FigureCanvasBase" else FigureCanvasAgg(fig)
    renderer = canvas.get_renderer()
    ax.set_axis_off()
    if title:
        ax.set_title(title, fontsize=9, loc="left")
    box = ax.get_window_extent(renderer)
    width, height = max(box.width, 1.0), max(box.height, 1.0)
    scale = scale_of(chips)
    line = fontsize * 2.1 * fig.dpi / 72
    x, y, gap = 0.0, line * 0.5, 0.06 * fig.dpi
    for t in chips:
        rgb = None if t.special else colour(t.score / scale)
        size = fontsize * (0.85 if t.special else 1.0)
        text = ax.text(0, 0, t.text, fontsize=size, va="center", transform=ax.transAxes)
        w = text.get_window_extent(renderer).width + 0.1 * fig.dpi
        if x + w > width and x > 0:
            x, y = 0.0, y + line
        text.set_position((x / width, 1 - y / height))
        if rgb is None:
            text.set_color("#888888")
            text.set_bbox(dict(boxstyle="round,pad=0.2", fc="#f0f0f0", ec="#cccccc", lw=0.5))
        else:
            text.set_color(colours.ink(rgb))
            text.set_bbox(dict(boxstyle="round,pad=0.2", fc=tuple(c / 255 for c in rgb), ec="none"))
        text.set_gid(f"{t.score:.6g}")
        x += w + gap
    if note:
        ax.text(0, 1 - (y + line * 1.2) / height, note, fontsize=fontsize * 0.75, color="#666666", va="top",
                transform=ax.transAxes, wrap=True)


def _sums(exp, index: int):
    image = float(exp.streams[PIXELS][index].sum())
    prompt = float(exp.streams[IDS][index][~exp.image_tokens[index].to(exp.streams[IDS].device)].sum())
    return image, prompt


def combined_figure(exp, indices: Optional[Sequence[int]] = None, image: Any = None, *, tokens=None, mean=None,
                    std=None, percentile: float = DEFAULT_PERCENTILE, title: Optional[str] = None, fig=None):
    """One row per sample (``indices``, default all): the image's relevance over the image (the pixel
    map, or the patch scores of the rollouts) and the prompt's tokens coloured by theirs.

    ``image``: the batch of pixels (default ``exp.image``), ``mean``/``std`` its normalisation;
    ``tokens``: the prompt's token strings per sample (default ``exp.prompt_tokens``). Returns the figure.
    """
    view = image_view(exp)
    n = int(exp.scores.shape[0])
    indices = list(range(n)) if indices is None else list(indices)
    fig = _new_figure((9.0, 2.9 * len(indices) + 0.3), fig)
    grid = fig.add_gridspec(len(indices), 2, width_ratios=[1, 1.7], left=0.02, right=0.98, top=1 - 0.45 / (
        2.9 * len(indices) + 0.3), bottom=0.03, wspace=0.3, hspace=0.35)
    for r, i in enumerate(indices):
        img = None if image is None else image[i] if getattr(image, "dim", lambda: 0)() == 4 else image
        ax = fig.add_subplot(grid[r, 0])
        pix, words = _sums(exp, i)
        what = "pixels" if exp.map is not None else "image tokens on patches"
        draw_overlay(ax, view, i, img, mean=mean, std=std, percentile=percentile,
                     title=f"{exp.method}: {what} (Σ {pix:.3g})")
        chips = prompt_chips(exp.streams[IDS][i], exp.image_tokens[i], _names(exp, i, tokens))
        note = ("[image: n tokens]: the image placeholders, whose relevance is the pixels' (left)" if exp.map is
                not None else "[image: n tokens]: the image placeholders' summed score, placed on their patches "
                "(left)")
        draw_tokens(fig.add_subplot(grid[r, 1]), chips, title=f"prompt tokens (Σ {words:.3g})", note=note)
    score = ", ".join(f"{float(exp.target_scores[i]):.3g}" for i in indices)
    fig.suptitle(title if title is not None else f"{exp.method}" + (f" ({exp.preset})" if exp.preset else "")
                 + f": image and prompt for the explained score ({score})", fontsize=10)
    return fig


def sample_html(exp, index: int, image_panel: str, tokens=None) -> str:
    """The notebook panel of sample ``index``: ``image_panel`` (the overlay as an ``<img>``) above the
    prompt's coloured tokens, each part's sum in its caption."""
    pix, words = _sums(exp, index)
    chips = prompt_chips(exp.streams[IDS][index], exp.image_tokens[index], _names(exp, index, tokens))
    return (f"<div style='font-size: 11px; color: #555'>image Σ {pix:.3g}</div>{image_panel}"
            f"<div style='font-size: 11px; color: #555; margin-top: 4px'>prompt Σ {words:.3g}</div>"
            f"<div style='line-height: 2.0'>{tokens_html(chips)}</div>")


# ---------------------------------------------------------------- generation attribution of an image prompt

def _gen_labels(gen):
    rows = gen.row_labels or [str(int(t)) for t in gen.rows]
    cols = gen.labels or [str(int(t)) for t in gen.columns]
    return rows, cols


def _step_map(gen, t: int):
    if gen.maps is not None:
        return gen.maps[t]
    gh, gw = gen.grid
    return gen.patches[t].reshape(gh, gw)


def generation_figure(gen, *, max_steps: int = 8, percentile: float = DEFAULT_PERCENTILE, fig=None):
    """The image's relevance for each generated token (at most ``max_steps``: one heatmap over the image
    each, its own scale) above the matrix of the tokens they read (rows scaled by their largest |value|)."""
    import numpy as np
    from matplotlib import gridspec
    steps = min(int(gen.rows.numel()), max_steps)
    rows, cols = _gen_labels(gen)
    img = display_image(gen.image[0])
    width = max(2.0 * steps, 0.3 * len(cols) + 2.0)
    longest = max(len(c) for c in cols)
    fig = _new_figure((width, 2.4 + max(2.0, 0.3 * len(rows) + 1.6) + 0.08 * longest), fig)
    height = fig.get_size_inches()[1]
    label = 0.08 * max(len(c) for c in cols) + 0.3  # inches under the matrix for its rotated column labels
    outer = gridspec.GridSpec(2, 1, figure=fig, height_ratios=[2.2, max(2.0, 0.3 * len(rows) + 1.6)], hspace=0.3,
                              top=1 - 0.5 / height, bottom=label / height)
    top = outer[0].subgridspec(1, steps, wspace=0.08)
    signed = bool(getattr(gen.explanation[0], "signed", True)) if gen.explanation else True
    for t in range(steps):
        ax = fig.add_subplot(top[0, t])
        values = _resize(_numpy(_step_map(gen, t)).astype(float), img.shape[:2])
        vmin, vmax = clip_limits(values, signed, percentile)
        ax.imshow(blend(img, values, signed, vmin, vmax, None, 0.5), interpolation="bilinear")
        ax.set_xticks([])
        ax.set_yticks([])
        ax.set_title(f"{rows[t]} (Σ {float(gen.patches[t].sum()):.3g})", fontsize=8)
    m = _numpy(gen.matrix[:steps]).astype(float)
    scale = np.abs(m).max(1, keepdims=True)
    ax = fig.add_subplot(outer[1])
    ax.imshow(m / np.where(scale > 0, scale, 1.0), cmap=colours.colormap(DIVERGING_CMAP), vmin=-1, vmax=1,
              aspect="auto")
    ax.set_xticks(range(len(cols)))
    ax.set_xticklabels(cols, rotation=90, fontsize=7)
    ax.set_yticks(range(steps))
    ax.set_yticklabels(rows[:steps], fontsize=8)
    if 0 < gen.source_length < len(cols):
        ax.axvline(gen.source_length - 0.5, color="black", linewidth=1)
    ax.set_title("tokens read (rows: generated tokens; each row scaled by its largest |relevance|)", fontsize=8)
    fig.suptitle(f"{gen.method}" + (f" ({gen.preset})" if gen.preset else "")
                 + ": the image's and the prompt's relevance for each generated token", fontsize=10)
    return fig


def save_generation_figure(gen, path: str, dpi: int = 150, **kwargs) -> str:
    """:func:`generation_figure` written to ``path``."""
    return save_figure(generation_figure(gen, **kwargs), str(path), dpi)


def _png_of(rgb) -> str:
    import base64
    import io
    from PIL import Image
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _step_png(gen, t: int, percentile: float = DEFAULT_PERCENTILE) -> str:
    import numpy as np
    img = display_image(gen.image[0])
    values = _resize(_numpy(_step_map(gen, t)).astype(float), img.shape[:2])
    signed = bool(getattr(gen.explanation[0], "signed", True)) if gen.explanation else True
    vmin, vmax = clip_limits(values, signed, percentile)
    rgb = (np.clip(blend(img, values, signed, vmin, vmax, None, 0.5), 0, 1) * 255).round().astype(np.uint8)
    return _png_of(rgb)


def generation_notebook_html(gen) -> str:
    """The generation attribution of an image prompt for a notebook: per generated token a small
    heatmap over the image, then the token matrix table; self-contained, escaped."""
    rows, cols = _gen_labels(gen)
    what = gen.method + (f", preset {gen.preset}" if gen.preset else "")
    cells = "".join(f"<figure style='margin: 0 6px 0 0; display: inline-block; text-align: center'>"
                    f"<img alt='image relevance for generated token {t}' style='width: 96px; display: block' "
                    f"src='data:image/png;base64,{_step_png(gen, t)}'><figcaption style='font-size: 11px'>"
                    f"{_html.escape(rows[t])}</figcaption></figure>" for t in range(len(rows)))
    caption = (f"<div class='relprop-caption' style='margin-bottom: 4px; font-size: 13px'><b>{_html.escape(what)}"
               f"</b> <span style='color: #555'>per generated token: the image's relevance (its own scale), then "
               f"the {gen.source_length} prompt tokens and earlier generated tokens it read; red for, blue "
               "against</span></div>")
    return (f"<div class='relprop-generation' style='font-family: sans-serif; background: #fff; padding: 6px 8px'>"
            f"{caption}<div>{cells}</div>{matrix_table(gen.matrix, rows, cols, gen.source_length)}</div>")


def generation_html(gen) -> str:
    """:func:`generation_notebook_html` as a standalone HTML page."""
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'></head><body>{generation_notebook_html(gen)}"
            "</body></html>")
