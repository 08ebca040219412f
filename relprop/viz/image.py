"""Image overlays of an :class:`relprop.Explanation` (matplotlib and numpy; no LaTeX).

The colours are relprop's one colour language (:mod:`relprop.viz.colours`): signed maps (``exp.signed``:
LRP, input × gradient, AttCAT, ...) in the diverging map centred on 0 (red = supports the target, blue =
speaks against it, white = none), non-negative maps (rollout-style methods) min-max normalised as in
the field's figures (Chefer et al., CVPR 2021, Fig. 1 and 3) in its positive half (white to red). The
colour lies over a grey copy of the image, each pixel's colour as opaque as its relevance is large, so
that pixels with no relevance show the image. ``cmap="jet"`` (any matplotlib colormap) gives the
paper's look instead: the map blended half-and-half over the image. Maps are clipped at a percentile
(default 99.5: a few extreme pixels do not wash out the rest), and a colourbar gives the scale in
relevance units.

Entry points: :func:`overlay_figure` (one image: the input beside the overlay), :func:`grid_figure`
(methods side by side, one row per image), :func:`draw_overlay` (onto an existing axes).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Sequence, Tuple

if TYPE_CHECKING:  # numpy is imported where it is used: an optional dependency (relprop[viz])
    import numpy as np

from ..errors import InputError
from . import colours
from .names import is_next_token, label_name, remembered_label, target_caption, target_name  # noqa: F401 (label_name: its old home)


#: colormap of non-negative maps: the positive half of relprop's map (:mod:`relprop.viz.colours`)
SEQUENTIAL_CMAP = colours.POSITIVE
#: colormap of signed maps, centred on 0: relprop's diverging map
DIVERGING_CMAP = colours.DIVERGING
#: maps are clipped at this percentile (of the values, or of |values| for signed maps)
DEFAULT_PERCENTILE = 99.5

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def _numpy(x) -> np.ndarray:
    import numpy as np
    try:
        import torch
        if torch.is_tensor(x):
            return x.detach().float().cpu().numpy()
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    return np.asarray(x)


def display_image(image: Any, mean: Optional[Sequence[float]] = None,
                  std: Optional[Sequence[float]] = None) -> np.ndarray:
    """The input as a displayable [H, W, 3] float array in [0, 1].

    ``image`` : a PIL image, a [H, W, 3] / [H, W] array (uint8 or float in [0, 1]), or a [3, H, W]
    tensor/array as fed to the model. A [3, H, W] input is un-normalised with ``mean``/``std`` when
    given (the model's preprocessing), else rescaled to [0, 1] by its own minimum and maximum.
    """
    import numpy as np
    if hasattr(image, "convert") and hasattr(image, "size"):  # PIL
        return np.asarray(image.convert("RGB"), dtype=np.float32) / 255.0
    a = _numpy(image)
    if a.ndim == 4:
        if a.shape[0] != 1:
            raise InputError(f"display_image takes one image, got a batch of shape {a.shape}")
        a = a[0]
    if a.ndim == 3 and a.shape[0] in (1, 3) and a.shape[-1] not in (1, 3):
        a = np.transpose(a, (1, 2, 0))
    if a.ndim == 2:
        a = a[:, :, None]
    if a.ndim != 3 or a.shape[-1] not in (1, 3):
        raise InputError(f"cannot display an image of shape {a.shape}: expected [3, H, W] or [H, W, 3]")
    if a.shape[-1] == 1:
        a = np.repeat(a, 3, axis=-1)
    if a.dtype == np.uint8:
        return a.astype(np.float32) / 255.0
    a = a.astype(np.float32)
    if mean is not None and std is not None:
        a = a * np.asarray(std, dtype=np.float32) + np.asarray(mean, dtype=np.float32)
        return np.clip(a, 0.0, 1.0)
    if a.min() >= 0.0 and a.max() <= 1.0:
        return a
    lo, hi = float(a.min()), float(a.max())
    return (a - lo) / (hi - lo) if hi > lo else np.zeros_like(a)


def clip_limits(values: np.ndarray, signed: bool, percentile: float = DEFAULT_PERCENTILE) -> Tuple[float, float]:
    """``(vmin, vmax)`` of the colour scale.

    Signed maps: symmetric, ``±`` the ``percentile``-th percentile of ``|values|`` (0 in the middle).
    Non-negative maps: the minimum (as the field's min-max normalisation) to the ``percentile``-th
    percentile. ``percentile=100`` is plain min-max (or max-|.|) scaling.
    """
    import numpy as np
    v = np.asarray(values, dtype=np.float64)
    v = v[np.isfinite(v)]
    if v.size == 0:
        return (-1.0, 1.0) if signed else (0.0, 1.0)
    if signed:
        lim = float(np.percentile(np.abs(v), percentile))
        if lim <= 0:
            lim = float(np.abs(v).max()) or 1.0
        return -lim, lim
    lo = float(v.min())
    hi = float(np.percentile(v, percentile))
    if hi <= lo:
        hi = float(v.max())
    if hi <= lo:
        hi = lo + 1.0
    return lo, hi


def relevance_map(exp, index: int = 0) -> np.ndarray:
    """[H, W] map of sample ``index`` of an image explanation (``exp.map``)."""
    if getattr(exp, "map", None) is None:
        raise InputError(f"explanation '{exp.method}' has no image map (modality '{exp.modality}'); "
                         "image overlays need an image model's explanation")
    n = exp.map.shape[0]
    if not -n <= index < n:
        raise IndexError(f"sample {index} out of range: the explanation has {n} samples")
    return _numpy(exp.map[index])


def _resize(m: np.ndarray, shape: Tuple[int, int]) -> np.ndarray:
    if m.shape == tuple(shape):
        return m
    import torch
    import torch.nn.functional as F
    t = torch.as_tensor(m, dtype=torch.float32)[None, None]
    return F.interpolate(t, size=tuple(shape), mode="bilinear", align_corners=False)[0, 0].numpy()


def blend(image: Optional[np.ndarray], values: np.ndarray, signed: bool, vmin: float, vmax: float,
          cmap: Optional[str] = None, alpha: float = 0.5) -> np.ndarray:
    """[H, W, 3] overlay of ``values`` (clipped to ``[vmin, vmax]``) on ``image`` (or alone).

    relprop's colours (``cmap`` None or one of :mod:`relprop.viz.colours`' names) are opaque where the
    relevance is large and show a grey copy of the image where it is 0 (signed) or at its minimum
    (non-negative); another matplotlib ``cmap`` is blended with weight ``alpha`` over the image."""
    import numpy as np
    ours = cmap in (None, colours.DIVERGING, colours.POSITIVE)
    scaled = np.clip((values - vmin) / (vmax - vmin), 0.0, 1.0)
    if ours and signed:
        lim = max(abs(vmin), abs(vmax))
        unit = np.clip(values / lim, -1.0, 1.0)
        colour = colours.rgb_float(unit)
    elif ours:
        unit = scaled
        colour = colours.positive_rgb_float(unit)
    else:
        colour = colours.colormap(cmap)(scaled)[..., :3]
    if image is None:
        return colour
    if ours or signed:  # colour where the relevance is, the (grey) image where it is not
        grey = image.mean(-1, keepdims=True) * np.ones(3)
        grey = 0.25 + 0.6 * grey
        lim = max(abs(vmin), abs(vmax))
        weight = np.abs(unit) if ours else np.clip(np.abs(values) / lim, 0.0, 1.0)
        weight = weight[..., None] ** 0.75
        return np.clip((1 - weight) * grey + weight * colour, 0.0, 1.0)
    return np.clip((1 - alpha) * image + alpha * colour, 0.0, 1.0)


def draw_overlay(ax, exp, index: int = 0, image: Any = None, *, mean=None, std=None, signed: Optional[bool] = None,
                 percentile: float = DEFAULT_PERCENTILE, cmap: Optional[str] = None, alpha: float = 0.5,
                 colorbar: Optional[str] = "vertical", title: Optional[str] = None):
    """Draw sample ``index``'s map of ``exp`` over ``image`` on the matplotlib axes ``ax``.

    Returns the colourbar (or None). ``colorbar``: ``"vertical"``, ``"horizontal"`` or None.
    """
    from matplotlib import cm as mcm, colors
    values = relevance_map(exp, index)
    signed = bool(exp.signed) if signed is None else signed
    img = None
    if image is not None:
        img = display_image(image, mean, std)
        values = _resize(values, img.shape[:2])
    vmin, vmax = clip_limits(values, signed, percentile)
    ax.imshow(blend(img, values, signed, vmin, vmax, cmap, alpha), interpolation="bilinear")
    ax.set_xticks([])
    ax.set_yticks([])
    for side in ax.spines.values():
        side.set_visible(False)
    ax.set_title(exp.method if title is None else title, fontsize=9)
    if not colorbar:
        return None
    sm = mcm.ScalarMappable(norm=colors.Normalize(vmin, vmax), cmap=colours.colormap(cmap, signed))
    cb = ax.figure.colorbar(sm, ax=ax, orientation=colorbar, fraction=0.046 if colorbar == "vertical" else 0.05,
                            pad=0.03 if colorbar == "vertical" else 0.02)
    cb.ax.tick_params(labelsize=7)
    ticks = [vmin, 0.0, vmax] if signed else [vmin, vmax]
    cb.set_ticks(ticks)
    cb.set_ticklabels(_ticks(ticks))
    if colorbar == "horizontal":  # end labels inside the bar's span, so neighbouring panels do not collide
        labels = cb.ax.get_xticklabels()
        labels[0].set_horizontalalignment("left")
        labels[-1].set_horizontalalignment("right")
    cb.outline.set_linewidth(0.5)
    return cb


def _ticks(values) -> list:
    """Tick labels with just enough significant digits to tell the ends apart (2 to 6); small and
    large values in scientific notation (``3.1e-05``), never rounded to a string of zeros."""
    for p in range(2, 7):
        out = ["0" if v == 0 else f"{v:.{p}g}" for v in values]
        if len(set(out)) == len(out):
            return out
    return out


def fit_labels(fig, right: float = 0.99) -> None:
    """Move the figure's axes left (``subplots_adjust(right=...)``) until every tick label and title ends
    inside the figure: a colourbar's tick labels are never clipped, however long."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    canvas = fig.canvas if type(fig.canvas).__name__ != "FigureCanvasBase" else FigureCanvasAgg(fig)
    width = fig.get_size_inches()[0] * fig.dpi
    for _ in range(3):
        canvas.draw()
        renderer = canvas.get_renderer()
        texts = [t for ax in fig.axes for t in ax.get_yticklabels() + ax.get_xticklabels() if t.get_visible()
                 and t.get_text()]
        over = max((t.get_window_extent(renderer).x1 for t in texts), default=0.0) - width * right
        if over <= 0:
            return
        fig.subplots_adjust(right=fig.subplotpars.right - over / width)


def _new_figure(figsize, fig=None):
    if fig is not None:
        fig.set_size_inches(*figsize)
        return fig
    from matplotlib.figure import Figure
    return Figure(figsize=figsize, dpi=100)


def _label_line(exp, index: int, labels=None, width: int = 70) -> str:
    if exp.target is None and remembered_label(exp, index) is None:
        return f"target function (score {float(exp.target_scores[index]):.3g})"
    name = target_name(exp, index, labels)
    if is_next_token(exp):
        return target_caption(exp, index, labels)
    return f"{short_label(name, width)} (score {float(exp.target_scores[index]):.3g})"


def short_label(name: str, width: int = 28) -> str:
    """A class name that fits a panel title: ImageNet's "tabby, tabby cat" style names keep their first
    synonym; anything still longer is cut with an ellipsis."""
    name = str(name)
    if len(name) > width and "," in name:
        name = name.split(",")[0].strip()
    return name if len(name) <= width else name[:width - 1] + "…"


def overlay_figure(exp, index: int = 0, image: Any = None, *, labels=None, mean=None, std=None,
                   percentile: float = DEFAULT_PERCENTILE, cmap: Optional[str] = None, alpha: float = 0.5,
                   title: Optional[str] = None, fig=None):
    """A figure with the input image (if given) beside the overlay of sample ``index`` and its colourbar.

    ``labels``: class names (the model's ``config.id2label`` or a list) for the title. Returns a
    ``matplotlib.figure.Figure`` (save it with ``fig.savefig(path)``).
    """
    panels = 2 if image is not None else 1
    fig = _new_figure((3.3 * panels + 0.5, 3.6), fig)
    axes = fig.subplots(1, panels, squeeze=False)[0]
    if image is not None:
        axes[0].imshow(display_image(image, mean, std), interpolation="bilinear")
        axes[0].set_axis_off()
        axes[0].set_title("input", fontsize=9)
    draw_overlay(axes[-1], exp, index, image, mean=mean, std=std, percentile=percentile, cmap=cmap, alpha=alpha,
                 title=_method_title(exp))
    fig.suptitle(title if title is not None else _label_line(exp, index, labels), fontsize=10)
    fig.subplots_adjust(left=0.02, right=0.9, top=0.83, bottom=0.03, wspace=0.08)
    fit_labels(fig)
    return fig


def _method_title(exp) -> str:
    return exp.method + (" (signed)" if exp.signed else "")


def grid_figure(exps: Sequence, image: Any = None, *, indices: Optional[Sequence[int]] = None, labels=None,
                mean=None, std=None, percentile: float = DEFAULT_PERCENTILE, alpha: float = 0.5,
                row_titles: Optional[Sequence[str]] = None, column_titles: Optional[Sequence[str]] = None,
                fig=None):
    """Methods side by side: one column per explanation in ``exps`` (after the input), one row per sample.

    ``image``: the batch the explanations are of ([batch, 3, H, W] as fed to the model, with
    ``mean``/``std`` to un-normalise it) or a list of images, or None (maps only). ``indices``: which
    samples (default all). Each panel has its own colour scale and colourbar below it.
    ``row_titles``: one title per row over the input (default: the explained class and its score);
    ``column_titles``: one per explanation (default: its method, "(signed)" when signed), e.g. to tell
    apart two presets of one method.
    """
    exps = list(exps)
    if not exps:
        raise InputError("grid_figure needs at least one explanation")
    if column_titles is not None and len(column_titles) != len(exps):
        raise InputError(f"grid_figure: {len(column_titles)} column_titles for {len(exps)} explanations; give "
                         "one title per explanation")
    titles = list(column_titles) if column_titles is not None else [_method_title(e) for e in exps]
    n = exps[0].map.shape[0] if exps[0].map is not None else 0
    indices = list(range(n)) if indices is None else list(indices)
    images = [None] * len(indices)
    if image is not None:
        if isinstance(image, (list, tuple)):
            images = [image[i] for i in indices]
        else:
            images = [image[i] for i in indices]
    cols = len(exps) + (1 if image is not None else 0)
    rows = len(indices)
    fig = _new_figure((2.3 * cols + 0.3, 2.75 * rows + 0.4), fig)
    axes = fig.subplots(rows, cols, squeeze=False)
    for r, i in enumerate(indices):
        c0 = 0
        if image is not None:
            ax = axes[r][0]
            ax.imshow(display_image(images[r], mean, std), interpolation="bilinear")
            ax.set_xticks([])
            ax.set_yticks([])
            for side in ax.spines.values():
                side.set_visible(False)
            head = row_titles[r] if row_titles is not None else _label_line(exps[0], i, labels, 28)
            ax.set_title(head, fontsize=9)
            from matplotlib import cm as mcm
            spacer = fig.colorbar(mcm.ScalarMappable(), ax=ax, orientation="horizontal", fraction=0.05, pad=0.02)
            spacer.ax.set_visible(False)  # keeps the input as large as the overlays beside it
            c0 = 1
        for c, e in enumerate(exps):
            draw_overlay(axes[r][c0 + c], e, i, images[r], mean=mean, std=std, percentile=percentile,
                         alpha=alpha, colorbar="horizontal", title=titles[c] if r == 0 else "")
    height = 2.75 * rows + 0.4
    fig.subplots_adjust(left=0.04, right=0.98, top=1 - 0.35 / height, bottom=0.3 / height, wspace=0.06,
                        hspace=0.25)
    return fig


def save_figure(fig, path: str, dpi: int = 150) -> str:
    """Write a figure made here to ``path`` (format from the suffix: png, jpg, pdf, svg)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    if fig.canvas is None or type(fig.canvas).__name__ == "FigureCanvasBase":
        FigureCanvasAgg(fig)
    fig.savefig(path, dpi=dpi, facecolor="white")
    return path
