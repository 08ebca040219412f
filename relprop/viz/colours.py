"""The one colour language of every picture relprop draws: a diverging map, red for relevance that
supports the explained target, blue for relevance that speaks against it, white for none.

Text pages, terminal output, image overlays, per-block heatmaps, per-head panels and generation
matrices all read their colours here, so the same score has the same colour everywhere. The map is
ColorBrewer's RdBu (Brewer, Harrower & The Pennsylvania State University, colorbrewer2.org; 9 classes,
marked colour-blind safe there), reversed so that red is positive, with its middle class set to pure
white so that a score of 0 draws nothing. It runs in a straight line in RGB between the anchors.

Scores are first scaled to [-1, 1] by the caller (per sample, by the largest |score|, or by clipped
limits for images). Non-negative maps (rollout-style methods) use the positive half: white at their
minimum, dark red at their (clipped) maximum.

In a 16-colour terminal the map cannot be shown; ``terminal16`` names the ANSI background of a
score instead: red (bright red for a weak one) for support, blue (bright blue) against, none near 0.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Tuple

if TYPE_CHECKING:  # numpy and matplotlib are imported where they are used: optional (relprop[viz])
    import numpy as np

#: the anchors of the map, from -1 (against) to +1 (for): ColorBrewer RdBu, 9 classes, reversed, with a
#: white middle
ANCHORS = ("#2166ac", "#4393c3", "#92c5de", "#d1e5f0", "#ffffff", "#fddbc7", "#f4a582", "#d6604d", "#b2182b")

#: name of the diverging map (``cmap=`` accepts it, or any matplotlib colormap name)
DIVERGING = "relprop_diverging"
#: name of the positive half (white to red) used for non-negative maps
POSITIVE = "relprop_positive"

#: entries of the matplotlib lookup table: odd, so that 0 (the middle) is an entry and is pure white
LUT_SIZE = 257

#: |score| below which a 16-colour terminal leaves a token uncoloured, and from which it uses the dark shade
TERMINAL16_WEAK = 0.15
TERMINAL16_STRONG = 0.5


def _anchor_rgb() -> "np.ndarray":
    import numpy as np
    return np.array([[int(h[i:i + 2], 16) / 255.0 for i in (1, 3, 5)] for h in ANCHORS])


def rgb_float(values) -> "np.ndarray":
    """RGB in [0, 1] (shape ``values.shape + (3,)``) of scores already scaled to [-1, 1] (clipped
    there): white at 0, red for positive, blue for negative, linear between the anchors."""
    import numpy as np
    v = np.clip(np.asarray(values, dtype=np.float64), -1.0, 1.0)
    v = np.where(np.isfinite(v), v, 0.0)
    anchors = _anchor_rgb()
    grid = np.linspace(-1.0, 1.0, len(anchors))
    return np.stack([np.interp(v, grid, anchors[:, c]) for c in range(3)], axis=-1)


def rgb(value: float) -> Tuple[int, int, int]:
    """RGB (0-255) of one score scaled to [-1, 1]: ``(255, 255, 255)`` at 0, red for positive, blue for
    negative (``rgb_float`` rounded)."""
    r, g, b = (int(round(c * 255)) for c in rgb_float(float(value)))
    return r, g, b


def hex_colour(value: float) -> str:
    """``#rrggbb`` of one score scaled to [-1, 1]."""
    return "#%02x%02x%02x" % rgb(value)


def ink(background: Tuple[int, int, int]) -> str:
    """The text colour readable on ``background`` (RGB 0-255): black on light colours, white on dark ones
    (relative luminance, WCAG 2.x, below 0.33)."""
    def lin(c: float) -> float:
        c = c / 255.0
        return c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4
    r, g, b = (lin(c) for c in background)
    return "#ffffff" if 0.2126 * r + 0.7152 * g + 0.0722 * b < 0.33 else "#000000"


def terminal16(value: float) -> Optional[str]:
    """The rich style of a score scaled to [-1, 1] in a 16-colour terminal: None (no colour) when
    ``|value| < TERMINAL16_WEAK``; ``"black on bright_red"`` / ``"black on bright_blue"`` for a weak
    score, ``"bold bright_white on red"`` / ``"bold bright_white on blue"`` from ``TERMINAL16_STRONG``."""
    v = float(value)
    if not abs(v) >= TERMINAL16_WEAK:  # NaN too
        return None
    hue = "red" if v > 0 else "blue"
    return f"bold bright_white on {hue}" if abs(v) >= TERMINAL16_STRONG else f"black on bright_{hue}"


def colormap(name: Optional[str] = None, signed: bool = True):
    """A matplotlib colormap: ``name`` when it is a matplotlib colormap name (e.g. ``"jet"`` for the look
    of Chefer et al. 2021, Fig. 1), else relprop's: the diverging map (``signed``) or its positive half."""
    from matplotlib import colormaps
    from matplotlib.colors import LinearSegmentedColormap
    name = name or (DIVERGING if signed else POSITIVE)
    if name == DIVERGING:
        return LinearSegmentedColormap.from_list(DIVERGING, list(ANCHORS), N=LUT_SIZE)
    if name == POSITIVE:
        half = len(ANCHORS) // 2
        return LinearSegmentedColormap.from_list(POSITIVE, list(ANCHORS[half:]), N=LUT_SIZE)
    return colormaps[name]


def positive_rgb_float(values) -> "np.ndarray":
    """RGB in [0, 1] of non-negative scores scaled to [0, 1]: the positive half of the map (white to red)."""
    import numpy as np
    return rgb_float(np.clip(np.asarray(values, dtype=np.float64), 0.0, 1.0))


def legend_figure(width: float = 6.0, fig=None):
    """A picture of the map as a labelled bar from -1 to +1 (the docs' legend): a matplotlib Figure."""
    import numpy as np
    from matplotlib.figure import Figure
    fig = fig if fig is not None else Figure(figsize=(width, 1.1), dpi=100)
    ax = fig.add_axes((0.05, 0.45, 0.9, 0.35))
    ax.imshow(rgb_float(np.linspace(-1, 1, 513))[None], aspect="auto", extent=(-1, 1, 0, 1))
    ax.set_yticks([])
    ax.set_xticks([-1, -0.5, 0, 0.5, 1])
    ticks = ax.set_xticklabels(["−1: against", "−0.5", "0: none", "+0.5", "+1: for"], fontsize=8)
    ticks[0].set_horizontalalignment("left")  # the end labels inside the bar's span: never clipped
    ticks[-1].set_horizontalalignment("right")
    for side in ax.spines.values():
        side.set_linewidth(0.5)
    fig.text(0.5, 0.9, "relevance for the explained target, scaled by the largest |score|", ha="center",
             fontsize=9)
    return fig
