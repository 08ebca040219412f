"""A vision-language model's explanation drawn with its prompt (relprop/viz/vision_text.py): save()/show()
and the notebook HTML put the prompt's tokens, coloured by ``exp.streams["input_ids"]``, beside the
image's heatmap.

* on a hand-made explanation (fast): each chip's colour is its score's on the shared token scale, the
  image placeholders one chip with their summed score, the heatmap the map's;
* on the tiny LLaVA (slow): ``explain`` remembers the placeholders and the token strings, ``save``
  draws both panels for ``lrp`` (pixels) and ``rollout`` (image tokens on the patch grid), ``exp[i]``
  keeps them, the notebook HTML holds image and tokens.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from matplotlib.colors import to_rgb
from PIL import Image

import relprop
import vlm_models as V
from relprop.viz import vision_text
from relprop.viz.text import colour


def _hand_made(rollout: bool = False):
    """An Explanation of 2 samples shaped like a VLM's: 4 prompt tokens around 3 image placeholders."""
    g = torch.Generator().manual_seed(0)
    ids = torch.tensor([[1, 5, 3, 3, 3, 6, 7], [1, 8, 3, 3, 3, 9, 4]])
    at = ids == 3
    words = torch.randn(2, 7, generator=g)
    words[at] = 0.0 if not rollout else 0.5
    patches = torch.randn(2, 4, generator=g)
    pixels = torch.randn(2, 3, 16, 16, generator=g)
    if rollout:
        scores, map_, modality, grid = words, None, "text", None
    else:
        scores, map_, modality, grid = patches, torch.randn(2, 16, 16, generator=g), "vision", (2, 2)
    return relprop.Explanation(
        method="rollout" if rollout else "lrp", scores=scores, map=map_, mask=None, matrix=None, blocks=[],
        target=None, target_scores=torch.tensor([1.0, 2.0]), conservation=None, input_relevance=None, logits=None,
        preset=None if rollout else "attnlrp", modality=modality, grid=grid, signed=not rollout,
        streams={"input_ids": words, "pixel_values": patches}, image=pixels, image_tokens=at,
        prompt_tokens=[[f"w{int(i)}" for i in row] for row in ids])


def _chips(fig):
    """(text, face colour) of every boxed text of the figure's token panels."""
    out = []
    for ax in fig.axes:
        for t in ax.texts:
            if t.get_bbox_patch() is not None:
                out.append((t.get_text(), t.get_bbox_patch().get_facecolor()[:3]))
    return out


@pytest.mark.parametrize("rollout", [False, True])
def test_chips_are_coloured_by_their_scores(rollout):
    exp = _hand_made(rollout)
    assert vision_text.is_vision_text(exp)
    fig = vision_text.combined_figure(exp, [1], exp.image)
    chips = _chips(fig)
    words = exp.streams["input_ids"][1]
    at = exp.image_tokens[1]
    names = ["w1", "w8", "[image: 3 tokens]", "w9", "w4"]
    assert [c[0] for c in chips] == names
    scores = [float(words[0]), float(words[1]), float(words[at].sum()), float(words[5]), float(words[6])]
    scale = max(abs(s) for s in scores)
    for (text, face), s in zip(chips, scores):
        if text.startswith("[image") and not rollout:  # the pixels hold the image's share: a grey chip
            assert face == pytest.approx(to_rgb("#f0f0f0"), abs=1e-6)
            continue
        assert face == pytest.approx(tuple(c / 255 for c in colour(s / scale)), abs=1e-6), text
    titles = [ax.get_title(loc=side) for ax in fig.axes for side in ("center", "left")]
    assert any(f"Σ {float(exp.streams['pixel_values'][1].sum()):.3g}" in t for t in titles), titles
    assert any(f"Σ {float(words[~at].sum()):.3g}" in t for t in titles), titles


def test_heatmap_is_the_image_map(tmp_path):
    """The overlay panel draws the map: a map that is 0 on the left half and large on the right gives a
    picture whose right half differs from its left."""
    exp = _hand_made()
    exp.map[:] = 0.0
    exp.map[:, :, 8:] = 1.0
    exp.image = torch.zeros_like(exp.image)
    path = exp.save(str(tmp_path / "one.png"), index=0)
    a = np.asarray(Image.open(path).convert("RGB"), dtype=float)
    assert a.std() > 10
    fig = vision_text.combined_figure(exp, [0], exp.image)
    shown = fig.axes[0].images[0].get_array()
    w = shown.shape[1]
    assert float(np.abs(shown[:, : w // 2 - 1] - shown[:, w // 2 + 1:]).max()) > 0.2


def test_notebook_html_holds_image_and_tokens():
    exp = _hand_made()
    html = exp._repr_html_()
    assert html.count("data:image/png;base64,") == 2 and html.count("[image: 3 tokens]") == 2
    assert "prompt Σ" in html and "image Σ" in html and "w9" in html


def test_one_sample_keeps_its_prompt():
    exp = _hand_made()[1]
    assert exp.prompt_tokens == [["w1", "w8", "w3", "w3", "w3", "w9", "w4"]]
    assert exp.image_tokens.shape == (1, 7) and vision_text.is_vision_text(exp)


# ------------------------------------------------------------------ the tiny LLaVA, explained

@pytest.fixture(scope="module")
def llava_runs():
    model = V.llava()
    batch = V.batch("llava", batch=2)
    lrp = relprop.explain(model, batch, target="next_token", method="lrp", preset="attnlrp")
    roll = relprop.explain(model, batch, target="next_token", method="rollout")
    return batch, lrp, roll


@pytest.mark.slow
def test_explain_remembers_the_prompt_and_save_draws_both(llava_runs, tmp_path):
    batch, lrp, roll = llava_runs
    for exp in (lrp, roll):
        assert torch.equal(exp.image_tokens, batch["input_ids"] == V.IMAGE_TOKEN)
        assert exp.prompt_tokens == [[str(int(i)) for i in row] for row in batch["input_ids"]]
        assert torch.equal(exp.image, batch["pixel_values"])
        fig = vision_text.combined_figure(exp, None, exp.image)
        chips = _chips(fig)
        assert len(chips) == 2 * (batch["input_ids"].shape[1] - 16 + 1)  # per sample: its words + one image chip
        path = exp.save(str(tmp_path / f"{exp.method}.png"))
        a = np.asarray(Image.open(path).convert("RGB"), dtype=float)
        assert a.std() > 10
        html = exp._repr_html_()
        assert html.count("[image: 16 tokens]") == 2 and html.count("data:image/png;base64,") == 2
    # the rollouts score the placeholders: the image chip is coloured (its sum); lrp's is 0 and grey
    roll_chips = dict(_chips(vision_text.combined_figure(roll, [0], roll.image)))
    lrp_chips = dict(_chips(vision_text.combined_figure(lrp, [0], lrp.image)))
    assert lrp_chips["[image: 16 tokens]"] == pytest.approx(to_rgb("#f0f0f0"))
    assert roll_chips["[image: 16 tokens]"] != pytest.approx(to_rgb("#f0f0f0"))
