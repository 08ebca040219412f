"""Token-to-token relevance matrices as pictures: generation attribution (rows: generated tokens,
columns: the source/prompt and earlier target tokens they read) and the source–target matrix of a
translation. Both use relprop's one colour language (:mod:`relprop.viz.colours`: red supports, blue
opposes, white none), scaled per row by its largest |value|: the HTML table colours each cell as the
text pages colour tokens, the figure is a matplotlib heatmap of the same map, a line between the
source and the target columns.
"""
from __future__ import annotations

import html as _html
from typing import Optional, Sequence

from . import colours
from .image import DIVERGING_CMAP, save_figure
from .text import colour


def _rows(matrix):
    import numpy as np
    m = matrix.detach().float().cpu().numpy() if hasattr(matrix, "detach") else np.asarray(matrix, dtype=float)
    return m


def matrix_table(matrix, row_labels: Sequence[str], column_labels: Sequence[str], source_length: int = 0) -> str:
    """The ``<table>`` of :func:`matrix_html` with inline styles (for a notebook): one row per generated
    token, one cell per column token, each cell coloured by its relevance (scaled per row), the value in
    its tooltip; source columns' heads dark blue-grey, target columns' dark red-grey."""
    m = _rows(matrix)
    th = "padding: 2px 4px; font-weight: normal; font-size: 12px"
    head = "".join(f"<th class='{'src' if j < source_length else 'tgt'}' style='{th}; writing-mode: vertical-rl; "
                   f"transform: rotate(180deg); color: {'#225' if j < source_length else '#622'}'>"
                   f"{_html.escape(str(c))}</th>" for j, c in enumerate(column_labels))
    body = []
    for i, label in enumerate(row_labels):
        scale = float(abs(m[i]).max()) or 1.0
        cells = "".join("<td style='background:#%02x%02x%02x; width: 22px; height: 18px; border: 1px solid #eee' "
                        % colour(v / scale) + f"title='{v:.4g}'></td>" for v in m[i])
        body.append(f"<tr><th style='{th}'>{_html.escape(str(label))}</th>{cells}</tr>")
    return (f"<table style='border-collapse: collapse; font-family: sans-serif'><thead><tr><th></th>{head}</tr>"
            f"</thead><tbody>{''.join(body)}</tbody></table>")


def matrix_html(matrix, row_labels: Sequence[str], column_labels: Sequence[str], source_length: int = 0,
                title: str = "") -> str:
    """A standalone HTML page of :func:`matrix_table`: one table row per generated token, one cell per
    column token, each cell coloured by its relevance (scaled per row), the value in its tooltip."""
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'></head><body>"
            f"<h3 style='font-family: sans-serif'>{_html.escape(title)}</h3>"
            f"{matrix_table(matrix, row_labels, column_labels, source_length)}</body></html>")


def notebook_html(gen) -> str:
    """A generation explanation (:class:`relprop.GenerationExplanation`) for a notebook: a caption (the
    method, its preset, what rows and columns are) and its matrix table; self-contained, escaped."""
    rows = gen.row_labels or [str(int(t)) for t in gen.rows]
    cols = gen.labels or [str(int(t)) for t in gen.columns]
    what = gen.method + (f", preset {gen.preset}" if gen.preset else "")
    caption = (f"<div class='relprop-caption' style='margin-bottom: 4px; font-size: 13px'><b>{_html.escape(what)}"
               f"</b> <span style='color: #555'>rows: the {len(rows)} generated tokens; columns: the tokens they "
               f"read ({gen.source_length} source); each row scaled by its largest |relevance|; red for, blue "
               "against</span></div>")
    return (f"<div class='relprop-generation' style='font-family: sans-serif; background: #fff; padding: 6px 8px'>"
            f"{caption}{matrix_table(gen.matrix, rows, cols, gen.source_length)}</div>")


def matrix_figure(matrix, row_labels: Sequence[str], column_labels: Sequence[str], source_length: int = 0,
                  path: Optional[str] = None, title: str = "", dpi: int = 150):
    """A heatmap figure of the matrix (rows scaled by their largest |value|); written to ``path``
    when given (the path is returned), else the figure."""
    import numpy as np
    from matplotlib.figure import Figure
    m = _rows(matrix)
    scale = np.abs(m).max(1, keepdims=True)
    m = m / np.where(scale > 0, scale, 1.0)
    fig = Figure(figsize=(max(3.0, 0.35 * m.shape[1] + 1.5), max(2.0, 0.35 * m.shape[0] + 1.2)))
    ax = fig.add_subplot(1, 1, 1)
    ax.imshow(m, cmap=colours.colormap(DIVERGING_CMAP), vmin=-1, vmax=1, aspect="auto")
    ax.set_xticks(range(m.shape[1]))
    ax.set_xticklabels([str(c) for c in column_labels], rotation=90, fontsize=8)
    ax.set_yticks(range(m.shape[0]))
    ax.set_yticklabels([str(r) for r in row_labels], fontsize=8)
    if 0 < source_length < m.shape[1]:
        ax.axvline(source_length - 0.5, color="black", linewidth=1)
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    if path is None:
        return fig
    return save_figure(fig, path, dpi=dpi)
