"""explain_generation of a vision-language model's image prompt (relprop/api/generated_image_text.py), on
the tiny LLaVA and PaliGemma of tests/vlm_models.py:

* every step equals a plain relprop.explain call on the prompt + the tokens generated so far, with the
  image and the generated token as the target (per prompt token, per patch, per pixel; to 1e-6 of the
  largest value), and the greedy tokens are the model's own (its ``generate``);
* each step conserves: Σ prompt and generated tokens + Σ patches + absorbed = the token's logit;
* chunks: the rows do not depend on ``batch_size`` (the last chunk filled up, one capture), the model
  untouched;
* refusals: an unknown family, keys it would drop, two images, a masked prompt; the pictures. (The
  families explained one prompt with its image per call: tests/test_vlm_generation_stepwise.py.)
"""
from __future__ import annotations

import pytest
import torch

import relprop
import vlm_models as V
from relprop.models.generated_image_text import ImageGenerationExplanation
from relprop.targets import next_token
from snapshot import assert_same, snapshot


@pytest.fixture(scope="module")
def vlm():
    return V.model_cache({f: b for f, (b, _) in V.FAMILIES.items()}, lambda family: V.batch(family, batch=1))


def _step_inputs(prompt, generated, family):
    """The prompt + the generated tokens so far, as a processor would give them to the model."""
    ids = torch.cat([prompt["input_ids"], generated.view(1, -1)], 1)
    out = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": prompt["pixel_values"]}
    if "token_type_ids" in prompt:  # PaliGemma: generated tokens are the causal suffix (1)
        out["token_type_ids"] = torch.cat([prompt["token_type_ids"], torch.ones_like(generated).view(1, -1)], 1)
    return out


def _close(a, b):
    """Equal to 1e-6 of the largest |value| (a different sequence length rounds the sums differently)."""
    a, b = a.float(), b.float()
    assert float((a - b).abs().max()) <= 1e-6 * max(float(b.abs().max()), 1e-12), (a, b)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llava", "paligemma"])
def test_each_step_equals_a_plain_explain_with_the_image(vlm, family):
    model = vlm(family)
    prompt = V.batch(family, batch=1, seed=1)
    before = snapshot(model)
    gen = relprop.explain_generation(model, None, prompt, max_new_tokens=3)
    assert_same(before, snapshot(model))
    assert isinstance(gen, ImageGenerationExplanation)
    n = prompt["input_ids"].shape[1]
    g = gen.rows.numel()
    assert gen.matrix.shape == (g, n + g - 1) and gen.patches.shape == (g, 16) and gen.maps.shape == (g, 32, 32)
    assert gen.source_length == n and gen.grid == V.GRID
    with torch.no_grad():  # greedy: the model's own continuation
        assert model.generate(**prompt, max_new_tokens=g, do_sample=False)[0, n:].tolist() == gen.rows.tolist()
    for t in range(g):
        step = _step_inputs(prompt, gen.rows[:t], family)
        plain = relprop.explain(model, step, target=next_token(step["attention_mask"], int(gen.rows[t])),
                                method="lrp", preset="attnlrp")
        assert int(plain.logits[0, -1].argmax()) == int(gen.rows[t])
        _close(gen.matrix[t, :n + t], plain.streams["input_ids"][0])
        _close(gen.patches[t], plain.scores[0])
        _close(gen.maps[t], plain.map[0])
        assert bool((gen.matrix[t, n + t:] == 0).all())  # later tokens: not read
        at = prompt["input_ids"][0] == V.IMAGE_TOKEN
        assert float(gen.matrix[t, :n][at].abs().max()) == 0.0  # the placeholders: the pixels hold the image's share
        assert float(gen.patches[t].abs().max()) > 0  # the image reaches every generated token


@pytest.mark.slow
def test_steps_conserve_and_chunks_give_the_same_rows(vlm):
    model = vlm("llava")
    prompt = V.batch("llava", batch=1, seed=2)
    cont = torch.tensor([7, 9, 11])
    one = relprop.explain_generation(model, None, prompt, target=cont, fast_path=False)
    before = snapshot(model)
    each = relprop.explain_generation(model, None, prompt, target=cont, fast_path=False, batch_size=2)
    assert_same(before, snapshot(model))
    assert len(each.explanation) == 2 and each.chunk_rows == [2, 1] and any("filled up" in n for n in each.notes)
    assert len(one.explanation) == 1 and one.chunk_rows == [3]
    for name in ("matrix", "patches", "maps"):
        torch.testing.assert_close(getattr(each, name), getattr(one, name), rtol=1e-5, atol=1e-8)
    for t in range(3):
        s = each.step(t)
        logit = float(s.logits[0, prompt["input_ids"].shape[1] - 1 + t, cont[t]])
        assert float(s.target_scores[0]) == pytest.approx(logit, rel=1e-6)
        total = float(each.matrix[t].sum() + each.patches[t].sum() + s.conservation.absorbed[0])
        assert total == pytest.approx(logit, abs=1e-5)
        assert float(s.conservation.error.max()) < 1e-5
    with pytest.raises(relprop.InputError, match="out of range"):
        each.step(3)


@pytest.mark.slow
def test_contrast_rows_equal_a_plain_explain_of_the_difference(vlm):
    """contrast=z: row t explains logit(y_t) − logit(z) on the prefix, with the image."""
    model = vlm("llava")
    prompt = V.batch("llava", batch=1, seed=2)
    cont = torch.tensor([7, 9])
    d = relprop.explain_generation(model, None, prompt, target=cont, contrast=5)
    assert torch.equal(d.contrast, torch.tensor([5, 5]))
    n = prompt["input_ids"].shape[1]
    for t in range(2):
        step = _step_inputs(prompt, cont[:t], "llava")

        def score(o, tok=int(cont[t])):
            return o.logits[:, -1, tok] - o.logits[:, -1, 5]

        plain = relprop.explain(model, step, target=score, method="lrp", preset="attnlrp")
        _close(d.matrix[t, :n + t], plain.streams["input_ids"][0])
        _close(d.patches[t], plain.scores[0])


@pytest.mark.slow
def test_generation_pictures(vlm, tmp_path):
    model = vlm("llava")
    gen = relprop.explain_generation(model, None, V.batch("llava", batch=1, seed=2), target=torch.tensor([7, 9]))
    html = gen._repr_html_()
    assert html.count("data:image/png;base64,") == 2 and html.count("<tr>") == 3  # head + 2 generated tokens
    assert gen.html().startswith("<!DOCTYPE html>")
    png = gen.save(str(tmp_path / "g.png"))
    from PIL import Image
    import numpy as np
    a = np.asarray(Image.open(png).convert("RGB"), dtype=float)
    assert a.std() > 10  # not uniform: heatmaps and the matrix drawn


# ------------------------------------------------------------------ refusals (no export, the fast suite)

def test_unknown_family_is_refused_without_wrt():
    model = V.llava()
    model.config.model_type = "newvlm"
    with pytest.raises(relprop.MethodError, match=r"model_type 'newvlm'.*wrt="):
        relprop.explain_generation(model, None, V.batch("llava", batch=1), max_new_tokens=2)


@pytest.mark.parametrize("change, says", [
    (lambda p: {**p, "image_sizes": torch.tensor([[32, 32]])}, r"would drop \['image_sizes'\]"),
    (lambda p: {**p, "pixel_values": p["pixel_values"].expand(2, -1, -1, -1)}, r"one image: pixel_values \[1"),
    (lambda p: {**p, "attention_mask": torch.cat([torch.zeros(1, 1, dtype=torch.long),
                                                  p["attention_mask"][:, 1:]], 1)}, "masks some of its tokens"),
    (lambda p: {k: v for k, v in p.items() if k != "input_ids"}, "needs its 'input_ids'"),
    (lambda p: {**p, "input_ids": p["input_ids"].expand(2, -1)}, r"one sample \[1, length\]"),
])
def test_image_prompts_relprop_cannot_carry_are_refused(change, says):
    with pytest.raises(relprop.InputError, match=says):
        relprop.explain_generation(V.llava(), None, change(V.batch("llava", batch=1)), max_new_tokens=2)
