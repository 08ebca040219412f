"""One colour language: every renderer (text HTML, terminal in 16 / 256 / true colour, image overlays,
per-block heatmaps, per-head panels, generation matrices) draws a score of +1, 0 and -1 (scaled) in the
colours of relprop.viz.colours: red for, white none, blue against."""
import html.parser
import io
import re

import numpy as np
import pytest
import torch
from rich.color import Color, ColorSystem
from rich.console import Console

from explanations import fake_image, fake_text
from relprop.viz import blocks as vblocks
from relprop.viz import colours
from relprop.viz import generation as vgen
from relprop.viz import heads as vheads
from relprop.viz import image as vimg
from relprop.viz import text as vtext

WHITE = (255, 255, 255)
FOR, AGAINST = colours.rgb(1.0), colours.rgb(-1.0)


def _luminance(rgb):
    return 0.2126 * rgb[0] + 0.7152 * rgb[1] + 0.0722 * rgb[2]


def test_the_map_is_diverging_white_at_zero_and_ordered_by_lightness():
    """Zero is white; red for, blue against; each half gets darker monotonically as |score| grows, so
    the order reads without telling hues apart (the map's colour-blind safety, beyond its hues)."""
    assert colours.rgb(0.0) == WHITE
    assert FOR[0] > 150 > FOR[2] and AGAINST[2] > 150 > AGAINST[0]
    for sign in (1, -1):
        lum = [_luminance(colours.rgb(sign * v)) for v in np.linspace(0, 1, 41)]
        assert all(a > b for a, b in zip(lum, lum[1:]))
    assert colours.rgb(5.0) == FOR and colours.rgb(-5.0) == AGAINST  # clipped
    assert colours.rgb(float("nan")) == WHITE
    cmap = colours.colormap()
    for v in (-1.0, 0.0, 1.0):  # the matplotlib map has the same colours (0 is an entry of its table)
        assert tuple(round(c * 255) for c in cmap((v + 1) / 2)[:3]) == colours.rgb(v)
    half = colours.colormap(signed=False)
    assert tuple(round(c * 255) for c in half(0.0)[:3]) == WHITE
    assert tuple(round(c * 255) for c in half(1.0)[:3]) == FOR


def test_ink_is_readable():
    assert colours.ink(FOR) == colours.ink(AGAINST) == "#ffffff"
    assert colours.ink(WHITE) == colours.ink(colours.rgb(0.3)) == "#000000"


class _Spans(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.spans = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "span" and "tok" in a.get("class", "") and "special" not in a.get("class", ""):
            self.spans.append(a)


def _style_rgb(style):
    return tuple(int(v) for v in re.search(r"rgb\((\d+), (\d+), (\d+)\)", style).groups())


TOKENS = ["[CLS]", "good", "none", "bad", "[SEP]"]
SCORES = [0.0, 2.0, 0.0, -2.0, 0.0]


def test_text_html_uses_the_map():
    exp = fake_text([SCORES], mask=[[False, True, True, True, False]])
    p = _Spans()
    p.feed(vtext.to_html(exp, [TOKENS], merge_words=False))
    got = {a["title"]: _style_rgb(a["style"]) for a in p.spans}
    assert got == {"+2": FOR, "+0": WHITE, "-2": AGAINST}


def test_terminal_uses_the_map_in_true_colour_and_red_blue_in_16_colours():
    toks = vtext.tokens_of(fake_text([SCORES]), 0, TOKENS)
    out = io.StringIO()
    Console(file=out, force_terminal=True, color_system="truecolor", width=200).print(vtext.rich_text(toks))
    codes = out.getvalue()
    assert "48;2;%d;%d;%dmgood" % FOR in codes and "48;2;%d;%d;%dmbad" % AGAINST in codes
    assert "48;2;255;255;255mnone" in codes
    out = io.StringIO()
    Console(file=out, force_terminal=True, color_system="standard", width=200).print(vtext.rich_text(toks))
    codes = out.getvalue()
    assert re.search(r"\x1b\[[0-9;]*41mgood", codes)  # red background: for
    assert re.search(r"\x1b\[[0-9;]*44mbad", codes)  # blue background: against, visibly
    assert re.search(r"\x1b\[0m none", codes) or " none " in codes  # no colour near 0
    # 256 colours: rich shows the nearest of xterm's 256 to the map's colour (printed here through a second
    # console, rich's style cache would keep the first console's codes: ask its colour conversion instead)
    eight = [Color.parse(colours.hex_colour(v)).downgrade(ColorSystem.EIGHT_BIT).number for v in (1.0, -1.0)]
    assert eight == [124, 25]  # xterm's dark red and dark blue
    assert colours.terminal16(0.3) == "black on bright_red" and colours.terminal16(-0.3) == "black on bright_blue"


def test_image_overlay_uses_the_map():
    m = np.zeros((8, 8), dtype=np.float32)
    m[0, 0], m[7, 7] = 3.0, -3.0
    exp = fake_image(m, signed=True)
    rgb = vimg.blend(None, m, True, -3.0, 3.0)
    assert tuple((rgb[0, 0] * 255).round().astype(int)) == FOR
    assert tuple((rgb[7, 7] * 255).round().astype(int)) == AGAINST
    assert tuple((rgb[3, 3] * 255).round().astype(int)) == WHITE
    from relprop.viz import api as viz_api
    arr = viz_api.overlay(exp, percentile=100)
    assert tuple(arr[0, 0]) == FOR and tuple(arr[7, 7]) == AGAINST and tuple(arr[4, 4]) == WHITE
    from matplotlib.figure import Figure
    cb = vimg.draw_overlay(Figure().add_subplot(), exp, 0, percentile=100)  # its colourbar: the same map
    assert [tuple(round(c * 255) for c in cb.mappable.cmap(cb.mappable.norm(v))[:3]) for v in (3.0, 0.0, -3.0)] \
        == [FOR, WHITE, AGAINST]
    nonneg = fake_image(np.abs(m), signed=False)
    arr = viz_api.overlay(nonneg, percentile=100)
    assert tuple(arr[0, 0]) == FOR and tuple(arr[3, 3]) == WHITE  # the positive half: minimum white


def _imshow_colours(fig, values):
    im = fig.axes[0].images[0]
    return [tuple(round(c * 255) for c in im.cmap(im.norm(v))[:3]) for v in values]


def test_blocks_heatmap_uses_the_map():
    exp = fake_text([SCORES], mask=[[False, True, True, True, False]], blocks=2)
    fig = vblocks.blocks_figure(exp, TOKENS, 0)
    lim = float(np.abs(vblocks.block_scores(exp, 0)[0][:, 1:4]).max())
    assert _imshow_colours(fig, [lim, 0.0, -lim]) == [FOR, WHITE, AGAINST]


def test_generation_matrix_uses_the_map():
    m = torch.tensor([[2.0, 0.0, -2.0], [1.0, -1.0, 0.0]])
    page = vgen.matrix_html(m, ["a", "b"], ["x", "y", "z"], 1)
    cells = re.findall(r"background:#([0-9a-f]{6})", page)
    got = [tuple(int(h[i:i + 2], 16) for i in (0, 2, 4)) for h in cells]
    assert got[:3] == [FOR, WHITE, AGAINST] and got[3:] == [FOR, AGAINST, WHITE]
    fig = vgen.matrix_figure(m, ["a", "b"], ["x", "y", "z"], 1)
    assert _imshow_colours(fig, [1.0, 0.0, -1.0]) == [FOR, WHITE, AGAINST]


def test_head_panels_use_the_positive_half():
    exp = fake_text([SCORES], heads=torch.tensor([[[0.0, 1.0, 0.5, 0.0, 0.0]]]))
    fig = vheads.heads_figure(exp, 0)
    im = fig.axes[0].images[0]
    assert tuple(round(c * 255) for c in im.cmap(1.0)[:3]) == FOR
    assert tuple(round(c * 255) for c in im.cmap(0.0)[:3]) == WHITE


@pytest.mark.parametrize("value", [1.0, 0.0, -1.0, 0.4, -0.4])
def test_every_renderer_draws_a_value_alike(value):
    """The same scaled value: the same colour from the text page, the overlay, and the matplotlib map."""
    text = vtext.colour(value)
    img = tuple((vimg.blend(None, np.array([[value]]), True, -1.0, 1.0)[0, 0] * 255).round().astype(int))
    lut = tuple(round(c * 255) for c in colours.colormap()((value + 1) / 2)[:3])
    assert text == img == colours.rgb(value)
    assert max(abs(a - b) for a, b in zip(lut, text)) <= 2  # matplotlib's table: 257 entries
