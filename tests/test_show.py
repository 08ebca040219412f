"""``exp.show()`` shows something wherever it runs: in a notebook a PNG (whatever matplotlib's backend) or
the HTML tokens, once (it returns None there, so the cell does not repeat it); in a script without a
display, the figure written to a file whose path it prints."""
from __future__ import annotations

import os
import re
import sys
import types
import warnings

import pytest

import relprop
import relprop.viz.api as viz_api
from models import hf_bert, image_batch, text_batch, timm_vit_tiny


def _explain(model, x, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return relprop.explain(model, x, target=1, **kw)


@pytest.fixture
def fake_notebook(monkeypatch):
    shown = []
    display = types.ModuleType("IPython.display")

    class Image:
        def __init__(self, data=None, format=None):
            self.data, self.format = data, format

    class HTML:
        def __init__(self, data):
            self.data = data

    display.Image, display.HTML, display.display = Image, HTML, shown.append
    ipython = types.ModuleType("IPython")
    ipython.display, ipython.version_info, ipython.get_ipython = display, (8, 0, 0), lambda: None
    monkeypatch.setitem(sys.modules, "IPython", ipython)
    monkeypatch.setitem(sys.modules, "IPython.display", display)
    monkeypatch.setattr(viz_api, "_in_notebook", lambda: True)
    return shown


def test_an_image_in_a_notebook_is_one_png(fake_notebook):
    model = timm_vit_tiny()
    exp = _explain(model, image_batch(model, batch=1), method="rollout")
    assert exp.show() is None
    (shown,) = fake_notebook
    assert shown.format == "png" and shown.data.startswith(b"\x89PNG")


def test_text_in_a_notebook_is_html_once(fake_notebook):
    batch = text_batch()
    exp = _explain(hf_bert(), batch, method="lrp", preset="attnlrp")
    tokens = [[f"t{i}" for i in range(batch["input_ids"].shape[1])] for _ in range(batch["input_ids"].shape[0])]
    assert exp.show(tokens=tokens) is None
    (shown,) = fake_notebook
    assert "<" in shown.data


def test_an_image_in_a_script_without_a_display_is_written_to_a_file(capsys):
    import matplotlib
    if viz_api._headless_backend() is None:
        pytest.skip(f"matplotlib's backend {matplotlib.get_backend()!r} opens windows here")
    model = timm_vit_tiny()
    exp = _explain(model, image_batch(model, batch=1), method="rollout")
    fig = exp.show()
    said = capsys.readouterr().err
    path = re.search(r"written to (\S+\.png)", said).group(1)
    assert "no window can open here" in said and os.path.getsize(path) > 1000
    assert hasattr(fig, "savefig")
    os.remove(path)
