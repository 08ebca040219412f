"""One panel per attention head (the per-head maps of DINO, Caron et al., ICCV 2021, Fig. 3; the
survey's ref. [4]: different heads attend to different objects or parts).

:func:`heads_figure` draws ``exp.heads`` (``[batch, heads, positions]``, the query row of each head's
map at the last block of the method's block range): for images each head's map on the patch grid,
upsampled and blended over the image, each panel scaled to its own maximum (as DINO shows them); for
text one row per head over the tokens.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

from ..errors import InputError
from . import colours
from .image import SEQUENTIAL_CMAP, _new_figure, _numpy, _resize, blend, display_image


def head_rows(exp, index: int = 0):
    """[heads, positions] numpy array of sample ``index`` of ``exp.heads``."""
    heads = getattr(exp, "heads", None)
    if heads is None:
        raise InputError(f"explanation '{exp.method}' has no per-head maps (exp.heads is None): they come with the "
                         "methods that fuse attention heads (raw_attention, rollout, gradient_rollout, "
                         "transformer_attribution, attention_norm)")
    n = heads.shape[0]
    if not -n <= index < n:
        raise IndexError(f"sample {index} out of range: the explanation has {n} samples")
    return _numpy(heads[index])


def heads_figure(exp, index: int = 0, image: Any = None, *, mean: Optional[Sequence[float]] = None,
                 std: Optional[Sequence[float]] = None, tokens: Optional[Sequence[str]] = None,
                 cols: Optional[int] = None, panel: float = 2.0, fig=None):
    """A matplotlib Figure with one panel per head of sample ``index`` (DINO, Caron et al. 2021,
    Fig. 3). Images: each head's map upsampled to ``image`` (un-normalized with ``mean``/``std``)
    or to the patch grid, in the positive half of relprop's map (``relprop.viz.colours``: white to red),
    min-max scaled per head. Text: a heads x tokens
    heatmap (``tokens`` label the columns)."""
    import numpy as np
    rows = head_rows(exp, index)
    n_heads = rows.shape[0]
    if exp.modality == "vision" and exp.grid is not None:
        gh, gw = exp.grid
        img = display_image(image, mean, std) if image is not None else None
        cols = cols or min(n_heads, 6)
        nrows = -(-n_heads // cols)
        fig = _new_figure((panel * cols, panel * nrows + 0.3), fig)
        for h in range(n_heads):
            ax = fig.add_subplot(nrows, cols, h + 1)
            m = rows[h].reshape(gh, gw).astype(np.float32)
            if img is not None:
                m = _resize(m, img.shape[:2])
            lo, hi = float(m.min()), float(m.max())
            ax.imshow(blend(img, m, False, lo, hi if hi > lo else lo + 1.0, SEQUENTIAL_CMAP),
                      interpolation="bilinear")
            ax.set_xticks([])
            ax.set_yticks([])
            ax.set_title(f"head {h}", fontsize=8)
        fig.suptitle(f"{exp.method}: per-head maps of the query row", fontsize=9)
        return fig
    fig = _new_figure((max(4.0, 0.35 * rows.shape[1] + 1.5), 0.35 * n_heads + 1.2), fig)
    ax = fig.add_subplot(1, 1, 1)
    ax.imshow(rows, aspect="auto", cmap=colours.colormap(SEQUENTIAL_CMAP), interpolation="nearest")
    ax.set_yticks(range(n_heads))
    ax.set_yticklabels([f"head {h}" for h in range(n_heads)], fontsize=7)
    if tokens is not None:
        if len(tokens) != rows.shape[1]:
            raise InputError(f"tokens has {len(tokens)} entries and the maps {rows.shape[1]} positions")
        ax.set_xticks(range(len(tokens)))
        ax.set_xticklabels(list(tokens), rotation=90, fontsize=7)
    ax.set_title(f"{exp.method}: per-head maps of the query row", fontsize=9)
    return fig
