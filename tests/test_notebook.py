"""Notebook display: Explanation._repr_html_ and GenerationExplanation._repr_html_ are self-contained (no
script, nothing fetched), escape token text, show the method and target, one panel per sample, images as
an inline PNG of the overlay; rendered by a real headless browser (when one is installed) the page is not
blank and the tokens have the map's colours."""
import base64
import html.parser
import io
import os
import re
import shutil
import subprocess

import numpy as np
import pytest
import torch
from PIL import Image

from explanations import fake_image, fake_text
from relprop.generation import GenerationExplanation
from relprop.viz import api as viz_api
from relprop.viz import colours
from relprop.viz import notebook

TOKENS = ["[CLS]", "good", "<script>alert(1)</script>", "bad", "[SEP]"]
SCORES = [[0.0, 2.0, 1.0, -2.0, 0.0], [0.0, -1.0, 0.5, 0.25, 0.0]]
MASK = [[False, True, True, True, False]] * 2
FOR, AGAINST = colours.rgb(1.0), colours.rgb(-1.0)


def _text_exp():
    exp = fake_text(SCORES, mask=MASK, target=(1, 0), method="lrp", preset="attnlrp")
    exp.tokens = [TOKENS, TOKENS]  # as an explanation that remembers its tokens (from a pipeline) would
    exp.labels = ["negative", "positive"]
    return exp


class _Page(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags, self.spans, self.images, self.samples = [], [], [], 0
        self._span = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.tags.append(tag)
        if tag == "span" and "tok" in (a.get("class") or ""):
            self._span = {"class": a["class"], "style": a.get("style", ""), "text": ""}
            self.spans.append(self._span)
        if tag == "img":
            self.images.append(a["src"])
        if tag == "div" and a.get("class") == "relprop-sample":
            self.samples += 1

    def handle_data(self, data):
        if self._span is not None:
            self._span["text"] += data

    def handle_endtag(self, tag):
        if tag == "span":
            self._span = None


def _self_contained(page: str):
    assert "<script" not in page.lower() and "<link" not in page.lower() and "<iframe" not in page.lower()
    assert not re.search(r"""(src|href)\s*=\s*['"]?(https?:|//)""", page), "nothing may be fetched"
    assert "@import" not in page and "url(" not in page


def test_text_html_escapes_tokens_and_names_method_and_target():
    page = _text_exp()._repr_html_()
    _self_contained(page)
    p = _Page()
    p.feed(page)
    assert p.samples == 2
    texts = [s["text"] for s in p.spans]
    assert "<script>alert(1)</script>" in texts  # shown as text: the parser saw data, not a tag
    assert "script" not in p.tags
    assert "lrp, preset attnlrp (signed)" in page and "sample 0: positive (score 0.5)" in page
    assert "sample 1: negative (score 1.5)" in page
    good = next(s for s in p.spans if s["text"] == "good")
    assert "rgb(%d, %d, %d)" % FOR in good["style"]
    bad = [s for s in p.spans if s["text"] == "bad"][0]
    assert "rgb(%d, %d, %d)" % AGAINST in bad["style"]


def test_text_without_tokens_names_positions_and_classes():
    page = fake_text(SCORES, mask=MASK, target=(1, 0), preset=None)._repr_html_()
    assert "token 1" in page and "class 1" in page and "preset" not in page
    callable_target = fake_text(SCORES, target=None)._repr_html_()
    assert "the target function" not in callable_target and "score 0.5" in callable_target


def test_a_long_batch_is_cut_and_says_so():
    exp = fake_text(np.ones((30, 3)), target=(0,))
    page = notebook.explanation_html(exp, max_samples=4)
    assert page.count("class='relprop-sample'") == 4 and "26 more not shown" in page


def test_image_html_is_the_overlay_as_an_inline_png():
    m = np.zeros((2, 8, 8), dtype=np.float32)
    m[0, :4], m[0, 4:], m[1, 2:6, 2:6] = 3.0, -3.0, 1.0
    exp = fake_image(m, target=(1, 0))
    page = exp._repr_html_()
    _self_contained(page)
    p = _Page()
    p.feed(page)
    assert len(p.images) == 2 and p.samples == 2
    for i, src in enumerate(p.images):
        assert src.startswith("data:image/png;base64,")
        png = np.asarray(Image.open(io.BytesIO(base64.b64decode(src.split(",", 1)[1]))).convert("RGB"))
        assert np.array_equal(png, viz_api.overlay(exp, None, i))
    image = torch.rand(2, 3, 8, 8)
    exp.image = image  # an explanation that remembers its input draws the overlay on it
    with_image = _Page()
    with_image.feed(exp._repr_html_())
    assert with_image.images != p.images


def _generation():
    m = torch.tensor([[2.0, 0.0, -2.0, 0.0], [1.0, -1.0, 0.5, 0.25]])
    return GenerationExplanation(matrix=m, rows=torch.tensor([7, 8]), columns=torch.tensor([1, 2, 3, 7]),
                                 source_length=3, method="lrp", preset="attnlrp",
                                 labels=["<s>", "a&b", "<script>", "x"], row_labels=["x", "</td>"])


def test_generation_html():
    page = _generation()._repr_html_()
    _self_contained(page)
    assert "&lt;script&gt;" in page and "&lt;/td&gt;" in page and "a&amp;b" in page
    assert "lrp, preset attnlrp" in page and "2 generated tokens" in page
    cells = re.findall(r"background:#([0-9a-f]{6})", page)
    assert len(cells) == 8
    first = [tuple(int(h[i:i + 2], 16) for i in (0, 2, 4)) for h in cells[:3]]
    assert first == [FOR, colours.rgb(0.0), AGAINST]


def _browser():
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


BROWSER = _browser()


def _render(tmp_path, body: str, name: str, size=(900, 400)):
    page = tmp_path / f"{name}.html"
    page.write_text(f"<!DOCTYPE html><html><head><meta charset='utf-8'></head><body style='margin: 8px'>{body}"
                    "</body></html>", encoding="utf-8")
    shot = tmp_path / f"{name}.png"
    args = [BROWSER, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
            "--force-color-profile=srgb", f"--window-size={size[0]},{size[1]}"]
    subprocess.run(args + [f"--screenshot={shot}", page.as_uri()], capture_output=True, timeout=120, check=False)
    dom = subprocess.run(args + ["--dump-dom", page.as_uri()], capture_output=True, timeout=120, check=False,
                         text=True).stdout
    assert shot.exists(), "the browser wrote no screenshot"
    keep = os.environ.get("RELPROP_SCREENSHOTS")  # a folder to keep the screenshots in, to look at them
    if keep:
        shutil.copy(shot, os.path.join(keep, shot.name))
    return np.asarray(Image.open(shot).convert("RGB")), dom


def _has_colour(img, rgb, tol=2, min_pixels=30):
    close = np.abs(img.astype(int) - np.array(rgb)).max(-1) <= tol
    return int(close.sum()) >= min_pixels


@pytest.mark.skipif(BROWSER is None, reason="no chromium/chrome on PATH (shutil.which): the headless-browser "
                                           "rendering of the notebook HTML is not checked")
def test_a_browser_renders_the_notebook_html(tmp_path):
    text, dom = _render(tmp_path, _text_exp()._repr_html_(), "text")
    inked = (text < 240).any(-1).mean()
    assert inked > 0.01 and len(np.unique(text.reshape(-1, 3), axis=0)) > 50, "the page is blank"
    assert _has_colour(text, FOR) and _has_colour(text, AGAINST), "the tokens lack the map's colours"
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in dom and "<script" not in dom.lower()
    m = np.zeros((1, 16, 16), dtype=np.float32)
    m[0, :8], m[0, 8:] = 2.0, -2.0
    image, _ = _render(tmp_path, fake_image(m, grid=(4, 4))._repr_html_(), "image")
    assert _has_colour(image, FOR, min_pixels=500) and _has_colour(image, AGAINST, min_pixels=500)
    gen, _ = _render(tmp_path, _generation()._repr_html_(), "generation")
    assert _has_colour(gen, FOR, min_pixels=100) and _has_colour(gen, AGAINST, min_pixels=100)


def test_real_explanations_draw_themselves(zoo):
    import models
    import relprop
    vit = zoo("timm_vit_tiny")
    x = models.image_batch(vit)
    exp = relprop.explain(vit, x, target=1, method="transformer_attribution")
    p = _Page()
    p.feed(exp._repr_html_())
    assert len(p.images) == len(exp) == p.samples
    first = np.asarray(Image.open(io.BytesIO(base64.b64decode(p.images[0].split(",", 1)[1]))).convert("RGB"))
    assert first.shape[:2] == tuple(exp.map.shape[1:]) and first.std() > 5
    one = exp[0]._repr_html_()
    assert one.count("class='relprop-sample'") == 1 and "transformer_attribution" in one
