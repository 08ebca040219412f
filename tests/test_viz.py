"""The renderers: image overlays and method grids (PNG opened with Pillow: size, not blank,
the right colour conventions), HTML pages (parsed: one element per token, colours), word-piece merging,
coloured terminal output, the per-block heatmap, and Explanation.show/save's functions."""
import html.parser
import io

import numpy as np
import pytest
import torch
from PIL import Image

import models
import relprop
from relprop import viz
from relprop.viz import api as viz_api
from relprop.viz import image as vimg
from relprop.viz import text as vtext


@pytest.fixture(scope="module")
def vision(zoo):
    model = zoo("timm_vit_tiny")
    x = models.image_batch(model)
    exps = relprop.explain(model, x, target=1, method=["transformer_attribution", "input_x_gradient"])
    return x, exps


@pytest.fixture(scope="module")
def text(zoo):
    model = zoo("hf_bert_eager")
    batch = models.text_batch(lengths=(7, 4))
    batch["input_ids"][:, 0] = 2  # a [CLS] at the start of each text
    rows = [[{0: "[PAD]", 2: "[CLS]"}.get(i, f"##p{i}" if j % 3 == 2 else f"w{i}") for j, i in enumerate(ids.tolist())]
            for ids in batch["input_ids"]]  # every third position a word piece
    mask = batch["input_ids"] == 2  # [CLS] is a special token
    exps = relprop.explain(model, batch, target=0, method=["transformer_attribution", "lrp"],
                           special_tokens_mask=mask)
    other = relprop.explain(model, batch, target=1, method="transformer_attribution", special_tokens_mask=mask)
    return batch, rows, exps, other


def _png(fig_or_path):
    if isinstance(fig_or_path, str):
        return Image.open(fig_or_path).convert("RGB")
    buf = io.BytesIO()
    vimg.save_figure(fig_or_path, buf, dpi=60)
    buf.seek(0)
    return Image.open(buf).convert("RGB")


def _not_blank(img):
    a = np.asarray(img, dtype=np.float32)
    assert a.std() > 10, "the picture is (nearly) one colour"
    assert len(np.unique(a.reshape(-1, 3), axis=0)) > 100


def test_overlay_figure_png(vision, tmp_path):
    x, (ta, ixg) = vision
    fig = vimg.overlay_figure(ta, 0, x[0], labels={1: "dog"})
    assert fig._suptitle.get_text() == "dog (score %.3g)" % float(ta.target_scores[0])
    path = vimg.save_figure(fig, str(tmp_path / "ov.png"))
    img = _png(path)
    assert img.size[0] > img.size[1] > 300  # input beside overlay, with a colourbar
    _not_blank(img)
    assert len(fig.axes) == 3  # input, overlay, colourbar


def test_sequential_and_diverging_colours():
    """Non-negative maps: white to red from the minimum to the clipped maximum; signed maps: the diverging
    map centred on 0 (0 shows the grey image, + red, - blue) with symmetric limits; cmap="jet" the paper's look."""
    values = np.linspace(0, 1, 100).reshape(10, 10)
    lo, hi = vimg.clip_limits(values, False, 100)
    assert (lo, hi) == (0.0, 1.0)
    assert vimg.clip_limits(values, False, 90)[1] == pytest.approx(np.percentile(values, 90))
    signed = np.array([[-2.0, 0.0], [1.0, 4.0]])
    lo, hi = vimg.clip_limits(signed, True, 100)
    assert lo == -hi == -4.0
    img = np.full((2, 2, 3), 0.5)
    out = vimg.blend(img, signed, True, lo, hi)
    assert np.allclose(out[0, 1], out[0, 1].mean())  # 0: grey image, no colour
    assert out[1, 1, 0] > out[1, 1, 2]  # positive: red
    assert out[0, 0, 2] > out[0, 0, 0]  # negative: blue
    seq = vimg.blend(None, values, False, 0.0, 1.0)
    assert np.allclose(seq[0, 0], 1.0) and seq[-1, -1, 0] > 0.5 > seq[-1, -1, 2]  # white at the minimum, red high
    jet = vimg.blend(None, values, False, 0.0, 1.0, cmap="jet")
    assert jet[0, 0, 2] > jet[0, 0, 0] and jet[-1, -1, 0] > jet[-1, -1, 2]  # jet: blue low, red high


def test_display_image_unnormalises():
    raw = torch.rand(3, 8, 8)
    mean, std = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)
    normed = (raw - torch.tensor(mean)[:, None, None]) / torch.tensor(std)[:, None, None]
    shown = vimg.display_image(normed, mean, std)
    assert shown.shape == (8, 8, 3)
    assert np.allclose(shown, raw.permute(1, 2, 0).numpy(), atol=1e-5)
    assert vimg.display_image(np.zeros((4, 4, 3), dtype=np.uint8)).max() == 0


def test_grid_figure_compares_methods(vision):
    x, exps = vision
    fig = vimg.grid_figure(exps, x, labels=["a", "b", "c", "d", "e"])
    img = _png(fig)
    _not_blank(img)
    titles = [ax.get_title() for ax in fig.axes]
    assert "transformer_attribution" in titles and "input_x_gradient (signed)" in titles
    assert img.size[0] > img.size[1]  # 3 columns, 2 rows
    named = vimg.grid_figure(exps, x, column_titles=["first", "second"][:len(exps)])
    assert [t for t in (ax.get_title() for ax in named.axes) if t in ("first", "second")] == ["first", "second"][
        :len(exps)]
    with pytest.raises(ValueError, match="one title per explanation"):
        vimg.grid_figure(exps, x, column_titles=["only one"] * (len(exps) + 1))


def test_overlay_needs_an_image_explanation(text):
    _, _, (ta, _), _ = text
    with pytest.raises(ValueError, match="no image map"):
        vimg.overlay_figure(ta, 0)


class _Spans(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.tokens, self.sections, self.samples = [], [], 0
        self._in = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        cls = a.get("class", "").split()
        if tag == "span" and "tok" in cls:
            self._in = {"special": "special" in cls, "style": a.get("style", ""), "score": a.get("data-score"),
                        "text": ""}
            self.tokens.append(self._in)
        if tag == "section":
            self.sections.append(a.get("data-method"))
        if tag == "div" and "sample" in cls:
            self.samples += 1

    def handle_data(self, data):
        if self._in is not None:
            self._in["text"] += data

    def handle_endtag(self, tag):
        if tag == "span":
            self._in = None


def test_html_one_element_per_token(text):
    batch, rows, (ta, lrp), other = text
    page = vtext.to_html([ta, lrp], rows, labels={0: "neg", 1: "pos"}, merge_words=False)
    p = _Spans()
    p.feed(page)
    n_tokens = int(batch["attention_mask"].sum())  # padding left out, [CLS] kept (grey)
    assert p.sections == ["transformer_attribution", "lrp"]
    assert p.samples == 4
    assert len(p.tokens) == 2 * n_tokens
    coloured = [t for t in p.tokens if not t["special"]]
    assert all("background-color: rgb(" in t["style"] for t in coloured)
    assert len({t["style"] for t in coloured}) > 3
    assert sum(t["special"] for t in p.tokens) == 4  # one [CLS] per text and method
    assert "neg (score" in page


def test_html_signed_colours_and_counterfactual(text):
    batch, rows, (ta, lrp), other = text
    page = vtext.to_html(lrp, rows, counterfactual=None, merge_words=False)
    p = _Spans()
    p.feed(page)
    blues = [t for t in p.tokens if t["score"] and float(t["score"]) < 0]
    reds = [t for t in p.tokens if t["score"] and float(t["score"]) > 0]
    assert reds and blues, "lrp on a random model has both signs"
    rgb = lambda t: tuple(int(v) for v in t["style"].split("(")[1].split(")")[0].split(","))  # noqa: E731
    assert all(rgb(t)[2] >= rgb(t)[0] for t in blues) and all(rgb(t)[0] >= rgb(t)[2] for t in reds)
    page = vtext.to_html(ta, rows, counterfactual=other, labels=["neg", "pos"])
    assert page.count('class="explanation counterfactual"') == 2
    assert "counterfactual: <b>pos" in page and "explained: <b>neg" in page


def test_merge_word_pieces():
    T = vtext.Token
    bert = [T("[CLS]", 0, True), T("play", 1.0, False), T("##ing", 0.5, False), T("well", 0.25, False)]
    words = vtext.merge_word_pieces(bert)
    assert [(w.text, w.score, w.pieces) for w in words] == [("[CLS]", 0, 1), ("playing", 1.5, 2), ("well", 0.25, 1)]
    bpe = [T("<s>", 0, True), T("Ġplay", 1.0, False), T("ing", 0.5, False), T("Ġwell", 0.25, False)]
    assert [w.text for w in vtext.merge_word_pieces(bpe)] == ["<s>", "playing", "well"]
    sp = [T("▁un", 1.0, False), T("believ", 1.0, False), T("able", 1.0, False), T("▁film", 2.0, False)]
    assert [(w.text, w.score) for w in vtext.merge_word_pieces(sp)] == [("unbelievable", 3.0), ("film", 2.0)]


def test_merged_html_has_one_element_per_word(text):
    batch, rows, (ta, _), _ = text
    page = vtext.to_html(ta, rows, merge_words=True)
    p = _Spans()
    p.feed(page)
    words = 0
    for row, keep in zip(rows, batch["attention_mask"].tolist()):
        prev = None
        for tok, k in zip(row, keep):
            if k and not (tok.startswith("##") and prev not in (None, "[CLS]")):
                words += 1
            prev = tok if k else prev
    assert words < int(batch["attention_mask"].sum())  # the batch has pieces to merge
    assert len(p.tokens) == words
    assert not any(t["text"].startswith("##") for t in p.tokens)


def test_terminal_output_is_coloured(text):
    from rich.console import Console
    batch, rows, (ta, lrp), other = text
    console = Console(record=True, width=200, force_terminal=True, color_system="truecolor")
    vtext.print_terminal(lrp, rows, labels=["neg", "pos"], counterfactual=other, console=console)
    out = console.export_text(styles=True, clear=False)
    assert "\x1b[" in out and "48;2;" in out  # true-colour backgrounds
    plain = console.export_text()
    assert "explained: neg" in plain and "counterfactual: pos" in plain and "top:" in plain


def test_blocks_heatmap(text):
    batch, rows, (ta, lrp), _ = text
    values, used = viz.block_scores(ta, 0)
    assert used == "relevance" and values.shape == (len(ta.blocks), batch["input_ids"].shape[1])
    expected = ta.blocks[1].hidden_relevance[0].sum(-1).numpy()
    assert np.allclose(values[1], expected)
    cat, used = viz.block_scores(ta, 0, source="gradient_x_hidden")
    b = ta.blocks[0]
    assert np.allclose(cat[0], (b.hidden[0] * b.hidden_gradient[0]).sum(-1).numpy(), atol=1e-6)
    fig = viz.blocks_figure(ta, rows[1], 1, labels=["neg", "pos"])
    ax = fig.axes[0]
    assert len(ax.get_yticklabels()) == len(ta.blocks)
    assert len(ax.get_xticklabels()) == int(batch["attention_mask"][1].sum())  # padding left out
    _not_blank(_png(fig))


def test_blocks_heatmap_of_a_rollout_method(text):
    """Transformer Attribution's per-block picture is the query's row of each block's own map
    Ā_b = E_h[(∇A_b ⊙ R_A,b)⁺] (CVPR 2021 Eq. 13), computed here from the records by the formula."""
    batch, rows, (ta, _), _ = text
    assert viz.blocks.method_source("transformer_attribution") == "block_maps"
    assert viz.blocks.method_source("rollout") == "block_maps" and viz.blocks.method_source("grads") is None
    for i in range(ta.query.shape[0]):
        values, used = viz.block_scores(ta, i, source="block_maps")
        assert used == "block_maps" and values.shape == (len(ta.blocks), batch["input_ids"].shape[1])
        for k, b in enumerate(ta.blocks):
            fused = sum((b.gradient[i, h] * b.relevance[i, h]).clamp(min=0) for h in range(b.attention.shape[1]))
            fused = fused / b.attention.shape[1]
            expected = [sum(float(ta.query[i, r]) * float(fused[r, c]) for r in range(fused.shape[0]))
                        for c in range(fused.shape[1])]
            assert np.allclose(values[k], expected, atol=1e-7)
    fig = viz.blocks_figure(ta, rows[0], 0, source="block_maps", labels=["neg", "pos"])
    assert "own map" in fig.axes[0].get_title() and "transformer_attribution" in fig.axes[0].get_title()
    _not_blank(_png(fig))


def test_blocks_heatmap_refuses_what_it_cannot_show(text):
    batch, rows, (ta, lrp), _ = text
    with pytest.raises(relprop.InputError, match="not a rollout-style method"):
        viz.block_scores(lrp, 0, source="block_maps")


def test_save_and_show_functions(vision, text, tmp_path, capsys):
    x, (ta, _) = vision
    p = viz_api.save(ta, str(tmp_path / "one.png"), image=x, index=1)
    _not_blank(Image.open(p).convert("RGB"))
    p = viz_api.save(ta, str(tmp_path / "all.png"), image=x)  # the whole batch: a grid
    assert Image.open(p).size[1] > 300
    with pytest.raises(ValueError, match="cannot save an image explanation"):
        viz_api.save(ta, str(tmp_path / "x.html"))
    batch, rows, (tta, _), other = text
    p = viz_api.save(tta, str(tmp_path / "t.html"), tokens=rows, counterfactual=other, merge_words=False)
    parsed = _Spans()
    parsed.feed(open(p, encoding="utf-8").read())
    assert parsed.samples == 2 and len(parsed.tokens) == 2 * int(batch["attention_mask"].sum())
    p = viz_api.save(tta, str(tmp_path / "t.png"), tokens=rows, labels=["neg", "pos"])
    _not_blank(Image.open(p).convert("RGB"))
    with pytest.raises(ValueError, match="token strings"):
        viz_api.save(tta, str(tmp_path / "t2.html"))
    page = viz_api.show(tta, tokens=rows, index=0)
    assert "<span" in page and "explained: class 0" in capsys.readouterr().out


def test_colourbar_tick_labels_fit_and_small_values_show():
    """Long tick labels are not clipped at the figure's edge; small values keep their digits."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from explanations import fake_image
    assert vimg._ticks([-3.1234e-5, 0.0, 3.1234e-5]) == ["-3.1e-05", "0", "3.1e-05"]
    m = -123456.7 + np.random.default_rng(0).random((8, 8)) * 2
    fig = vimg.overlay_figure(fake_image(m, signed=False), 0, np.zeros((8, 8, 3)), percentile=100)
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    labels = [t for t in fig.axes[-1].get_yticklabels() if t.get_text()]  # the colourbar's
    assert labels and all("e+05" in t.get_text() for t in labels)
    width = fig.get_size_inches()[0] * fig.dpi
    assert max(t.get_window_extent(canvas.get_renderer()).x1 for t in labels) <= width
