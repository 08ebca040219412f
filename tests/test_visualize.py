"""Activation maximization (relprop.maximize_activation, the survey's §2.4): the optimized input raises the unit
well above its random start, the same seed gives the same input, the model is untouched, every unit
kind reads what it says, and the CLI writes PNGs. Tiny models from configs, a few steps each."""
import os

import pytest
import torch

import models
import relprop
from relprop.tools.activation_maximization import Unit, total_variation
from snapshot import assert_same, snapshot


@pytest.fixture(scope="module")
def vit():
    return models.hf_vit()


def test_class_score_rises_well_above_the_random_start(vit):
    """Margin: after 12 Adam steps the class logit is above its value on every one of 5 random starts
    (seeds 0-4) by more than 4 times their spread (max - min), and by at least 0.1 (the tiny random
    model's logits span about ±0.2 over valid images)."""
    before = snapshot(vit)
    vis = relprop.maximize_activation(vit, "class:3", steps=12, lr=0.1, progress=False)
    assert_same(before, snapshot(vit))
    assert len(vis.values) == 13 and vis.image.shape == (32, 32, 3)
    starts = [vis.start_value] + [relprop.maximize_activation(vit, "class:3", steps=1, seed=s,
                                                              progress=False).start_value for s in range(1, 5)]
    spread = max(starts) - min(starts)
    assert vis.values[-1] - max(starts) > max(4 * spread, 0.1), (vis.values, starts)
    assert 0.0 <= vis.image.min() and vis.image.max() <= 1.0


def test_same_seed_same_image(vit):
    a = relprop.maximize_activation(vit, "class:1", steps=3, jitter=2, seed=7, progress=False)
    b = relprop.maximize_activation(vit, "class:1", steps=3, jitter=2, seed=7, progress=False)
    c = relprop.maximize_activation(vit, "class:1", steps=3, jitter=2, seed=8, progress=False)
    assert torch.equal(a.input, b.input) and a.values == b.values
    assert not torch.equal(a.input, c.input)


def test_last_value_is_the_returned_input_with_jitter(vit):
    """With jitter the steps score shifted copies; the last value is the unit on ``vis.input`` itself
    (it was the score of a shifted copy: -0.0040 reported where vis.input scores +0.0162)."""
    vis = relprop.maximize_activation(vit, "class:1", steps=4, jitter=3, seed=7, progress=False)
    with torch.no_grad():
        assert vis.values[-1] == pytest.approx(float(vit(vis.input).logits[0, 1]), abs=1e-5)


@pytest.mark.parametrize("unit", ["neuron:1:5", "neuron:0:2:3", "channel:0:3", "head:1:1", "norm:-1:0", "layer:0"])
def test_every_unit_kind_rises(vit, unit):
    vis = relprop.maximize_activation(vit, unit, steps=6, lr=0.1, progress=False)
    assert vis.values[-1] > vis.start_value, (unit, vis.values)


def test_unit_values_read_the_model(vit):
    """head:B:H is the mean attention the other tokens pay to the class token (from output_attentions);
    class:C is the logit."""
    vis = relprop.maximize_activation(vit, "head:1:2", steps=1, progress=False)
    x = torch.full((1, 3, 32, 32), 0.0)
    torch.manual_seed(0)
    with torch.no_grad():
        out = models.hf_vit(attn="eager")(vis.input, output_attentions=True)
    # steps=1: values[-1] is the unit on the returned input
    assert vis.values[-1] == pytest.approx(float(out.attentions[1][0, 2, 1:, 0].mean()), abs=1e-5)
    cls = relprop.maximize_activation(vit, "class:0", steps=1, progress=False)
    with torch.no_grad():
        assert cls.values[-1] == pytest.approx(float(vit(cls.input).logits[0, 0]), abs=1e-4)
    del x


def test_total_variation_regularizer_smooths(vit):
    plain = relprop.maximize_activation(vit, "class:2", steps=8, lr=0.1, progress=False)
    smooth = relprop.maximize_activation(vit, "class:2", steps=8, lr=0.1, tv=5.0, blur=0.8, blur_every=2,
                                         progress=False)
    assert float(total_variation(smooth.input)) < float(total_variation(plain.input))


def test_text_model_relaxed_embeddings():
    model = models.hf_bert()
    before = snapshot(model)
    vis = relprop.maximize_activation(model, "class:1", steps=8, lr=0.1, length=5, progress=False)
    assert_same(before, snapshot(model))
    assert vis.image is None and len(vis.tokens) == 5 and vis.input.shape[:2] == (1, 5)
    assert vis.values[-1] > vis.start_value


def test_bad_units_and_options(vit):
    assert Unit.parse("neuron:3:100:5") == Unit("neuron", 3, 100, 5) and Unit.parse(7) == Unit("class", index=7)
    for bad in ("pixel:3", "class", "head:1", "neuron:1:2:3:4"):
        with pytest.raises(relprop.OptionError, match="Choices: class:C"):
            relprop.maximize_activation(vit, bad, steps=1, progress=False)
    with pytest.raises(relprop.OptionError, match="class 9 out of range"):
        relprop.maximize_activation(vit, "class:9", steps=1, progress=False)
    with pytest.raises(relprop.OptionError, match="blocks 0..1"):
        relprop.maximize_activation(vit, "layer:5", steps=1, progress=False)
    with pytest.raises(relprop.OptionError, match="steps must be"):
        relprop.maximize_activation(vit, "class:1", steps=0, progress=False)


def test_cli_writes_pngs(tmp_path, capsys):
    from relprop.cli import main
    folder = str(tmp_path / "vit")
    models.hf_vit().save_pretrained(folder)
    out = str(tmp_path / "out")
    code = main(["visualize", "--model", folder, "--unit", "class:2", "--unit", "head:1:0", "--steps", "2",
                 "--out", out, "--no-progress"])
    assert code == 0
    assert {"class_2.png", "head_1_0.png", "values.csv"} <= set(os.listdir(out))
    assert len(open(os.path.join(out, "values.csv")).read().strip().splitlines()) == 1 + 2 * 3


def test_visualize_is_the_old_name_of_maximize_activation():
    """``relprop.visualize`` (the old name) is the same function and warns on every read; it is no
    public name of ``relprop.__all__`` (a star import does not warn)."""
    with pytest.warns(DeprecationWarning, match="relprop.maximize_activation"):
        old = relprop.visualize
    assert old is relprop.maximize_activation
    with pytest.warns(DeprecationWarning):
        from relprop import visualize
    assert visualize is relprop.maximize_activation
    assert "visualize" not in relprop.__all__ and "maximize_activation" in relprop.__all__
