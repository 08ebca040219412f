"""Token-to-token relevance matrices as pictures: generation attribution (rows: generated tokens,
columns: the source/prompt and earlier target tokens they read) and the source–target matrix of a
translation. The HTML table colours each cell as the text pages do (:func:`relprop.viz.text.colour`:
green supports, red opposes, white none), scaled per row by its largest |value|; the figure is a
matplotlib heatmap with a diverging colour map, a line between the source and the target columns.
"""
from __future__ import annotations

import html as _html
from typing import Optional, Sequence

from .image import DIVERGING_CMAP, save_figure
from .text import colour


def _rows(matrix):
    import numpy as np
    m = matrix.detach().float().cpu().numpy() if hasattr(matrix, "detach") else np.asarray(matrix, dtype=float)
    return m


def matrix_html(matrix, row_labels: Sequence[str], column_labels: Sequence[str], source_length: int = 0,
                title: str = "") -> str:
    """A standalone HTML page: one table row per generated token, one cell per column token, each
    cell coloured by its relevance (scaled per row), the value in its tooltip."""
    m = _rows(matrix)
    head = "".join(f"<th class='{'src' if j < source_length else 'tgt'}'>{_html.escape(str(c))}</th>"
                   for j, c in enumerate(column_labels))
    body = []
    for i, label in enumerate(row_labels):
        scale = float(abs(m[i]).max()) or 1.0
        cells = "".join(f"<td style='background:#%02x%02x%02x' title='{v:.4g}'></td>" % colour(v / scale)
                        for v in m[i])
        body.append(f"<tr><th>{_html.escape(str(label))}</th>{cells}</tr>")
    style = ("table{border-collapse:collapse;font-family:sans-serif;font-size:12px}"
             "td{width:22px;height:18px;border:1px solid #eee}th{padding:2px 4px;font-weight:normal}"
             "thead th{writing-mode:vertical-rl;transform:rotate(180deg)}th.src{color:#225}th.tgt{color:#622}")
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><style>{style}</style></head><body>"
            f"<h3>{_html.escape(title)}</h3><table><thead><tr><th></th>{head}</tr></thead>"
            f"<tbody>{''.join(body)}</tbody></table></body></html>")


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
    ax.imshow(m, cmap=DIVERGING_CMAP, vmin=-1, vmax=1, aspect="auto")
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
