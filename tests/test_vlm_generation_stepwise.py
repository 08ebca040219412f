"""explain_generation with an image for the families relprop explains one prompt with its image per call
(relprop/api/generated_image_steps.py): Qwen2-VL, Idefics3, LLaVA-NeXT and LLaVA-OneVision (shrunk crop
grid), on the tiny models of tests/vlm_models.py.

* the greedy tokens are the model's own (its ``generate(..., do_sample=False)``), and every step equals a
  plain relprop.explain call on the prompt + the tokens generated so far with the image, the generated
  token the target (per prompt token, per patch, per pixel, and the family's other image parts: Idefics3's
  global image, LLaVA-NeXT's base image; to 1e-6 of the largest value); the model untouched;
* LLaVA-NeXT's steps conserve with the base image kept apart from the maps;
* refusals before any work: a batch of several prompts (a MethodError: explain_generation takes one prompt;
  relprop.explain explains such a batch sample by sample, tests/test_vlm_batches.py), keys relprop would
  drop, a family vision_language.py refuses (made so for the test: none is left).
"""
from __future__ import annotations

import pytest
import torch

import relprop
import vlm_models as V
from relprop.models import vision_language
from relprop.models.generated_image_text import ImageGenerationExplanation
from relprop.targets import next_token
from snapshot import assert_same, snapshot

#: family -> (builder, its prompt with the image: one whose greedy tokens differ from each other)
PROMPTS = {
    "qwen2_vl": (V.qwen2_vl, lambda: V.qwen_inputs(V.qwen_image(1), seed=1)),
    "idefics3": (V.idefics3, lambda: V.tiled_batch(batch=1, seed=0)),
    "llava_next": (V.llava_next, lambda: V.anyres_batch(seed=0)),
    # the shrunk crop grid (4x8 -> 2x5 tokens through the bilinear interpolation) and the processor's batch_num_images
    "llava_onevision": (lambda: V.llava_onevision("anyres_max_1"),
                        lambda: {**V.anyres_batch(seed=0, crop_tokens=(2, 5)), "batch_num_images": torch.tensor([1])}),
}
#: the family's image parts besides the patches, in its Explanation's streams
OTHER = {"qwen2_vl": (), "idefics3": ("global_image",), "llava_next": ("base_image",),
         "llava_onevision": ("base_image",)}


def _model_inputs(prompt):
    """The prompt as the model's forward takes it (Idefics3's tile grid keys are relprop's, not the model's)."""
    return {k: v for k, v in prompt.items() if k not in ("rows", "cols")}


@pytest.fixture(scope="module")
def vlm():
    return V.model_cache({f: b for f, (b, _) in PROMPTS.items()}, lambda f: _model_inputs(PROMPTS[f][1]()))


def _step_inputs(prompt, generated):
    """The prompt + the generated tokens so far, as a processor would give them (Qwen: the generated
    tokens are text, mm_token_type_ids 0)."""
    ids = torch.cat([prompt["input_ids"], generated.view(1, -1)], 1)
    out = {**prompt, "input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if "mm_token_type_ids" in prompt:
        out["mm_token_type_ids"] = (ids == V.IMAGE_TOKEN).int()
    return out


def _close(a, b):
    """Equal to 1e-6 of the largest |value|."""
    a, b = a.float(), b.float()
    assert a.shape == b.shape, (a.shape, b.shape)
    assert float((a - b).abs().max()) <= 1e-6 * max(float(b.abs().max()), 1e-12), (a, b)


@pytest.mark.slow
@pytest.mark.parametrize("family", list(PROMPTS))
def test_each_step_equals_a_plain_explain_with_the_image(vlm, family):
    model = vlm(family)
    prompt = PROMPTS[family][1]()
    before = snapshot(model)
    gen = relprop.explain_generation(model, None, prompt, max_new_tokens=2)
    assert_same(before, snapshot(model))
    assert isinstance(gen, ImageGenerationExplanation)
    n, g = prompt["input_ids"].shape[1], gen.rows.numel()
    assert g == 2 and gen.rows[0] != gen.rows[1]
    with torch.no_grad():  # greedy: the model's own continuation
        own = model.generate(**_model_inputs(prompt), max_new_tokens=g, do_sample=False)[0, n:]
    assert own.tolist() == gen.rows.tolist()
    assert gen.matrix.shape == (g, n + g - 1) and gen.source_length == n
    assert torch.equal(gen.columns, torch.cat([prompt["input_ids"][0], gen.rows[:-1]]))
    assert len(gen.explanation) == g and gen.chunk_rows == [1] * g
    assert any("its own relprop.explain call" in note for note in gen.notes)
    assert sorted(gen.streams) == sorted(OTHER[family])
    for t in range(g):
        step = _step_inputs(prompt, gen.rows[:t])
        plain = relprop.explain(model, step, target=next_token(step["attention_mask"], int(gen.rows[t])),
                                method="lrp", preset="attnlrp")
        assert int(plain.logits[0, -1].argmax()) == int(gen.rows[t])
        _close(gen.matrix[t, :n + t], plain.streams["input_ids"][0])
        _close(gen.patches[t], plain.scores[0])
        _close(gen.maps[t], plain.map[0])
        for name in OTHER[family]:
            _close(gen.streams[name][t], plain.streams[name][0])
        assert bool((gen.matrix[t, n + t:] == 0).all())  # later tokens: not read
        assert float(gen.matrix[t, :n][prompt["input_ids"][0] == V.IMAGE_TOKEN].abs().max()) == 0.0
        assert float(gen.patches[t].abs().max()) > 0  # the image reaches every generated token
        assert gen.step(t).map.shape == plain.map.shape
    assert tuple(gen.image.shape[-2:]) == tuple(gen.maps.shape[-2:])  # the picture the maps lie on
    assert gen.grid[0] * gen.grid[1] == gen.patches.shape[1]
    assert gen._repr_html_().count("data:image/png;base64,") == g  # one heatmap over the image per token


@pytest.mark.slow
def test_llava_next_steps_conserve_with_the_base_image_apart(vlm):
    """Σ prompt and generated tokens + Σ crop patches + Σ base image + absorbed = the token's logit
    (the base image is not in maps/patches), with contrast=: logit(y_t) − logit(z)."""
    model = vlm("llava_next")
    prompt = PROMPTS["llava_next"][1]()
    cont = torch.tensor([7, 9])
    gen = relprop.explain_generation(model, None, prompt, target=cont, contrast=5, fast_path=False)
    n = prompt["input_ids"].shape[1]
    for t in range(2):
        s = gen.step(t)
        logits = s.logits[0, n - 1 + t]
        want = float(logits[cont[t]] - logits[5])
        assert float(s.target_scores[0]) == pytest.approx(want, rel=1e-6)
        total = float(gen.matrix[t].sum() + gen.patches[t].sum() + gen.streams["base_image"][t].sum()
                      + s.conservation.absorbed[0])
        assert total == pytest.approx(want, abs=1e-5)
        assert float(gen.streams["base_image"][t].abs().sum()) > 0
        assert float(gen.maps[t].sum()) == pytest.approx(float(gen.patches[t].sum()), abs=1e-5)


# ------------------------------------------------------------------ refusals (no export, the fast suite)

def _batch_of_two(family):
    if family == "idefics3":
        return V.tiled_batch(batch=2)
    prompt = PROMPTS[family][1]()
    two = {k: v.expand(2, *v.shape[1:]) for k, v in prompt.items() if k in ("input_ids", "attention_mask",
                                                                           "mm_token_type_ids")}
    if family == "llava_next":
        two["pixel_values"] = prompt["pixel_values"].expand(2, -1, -1, -1, -1)
        two["image_sizes"] = prompt["image_sizes"].expand(2, -1)
    return {**prompt, **two}


def _watched(family):
    model = PROMPTS[family][0]()
    calls = []
    model.register_forward_pre_hook(lambda m, a: calls.append(1))
    return model, calls


@pytest.mark.parametrize("family", list(PROMPTS))
def test_a_batch_of_prompts_is_refused_before_any_work(family):
    model, calls = _watched(family)
    before = snapshot(model)
    with pytest.raises(relprop.MethodError, match=r"a batch of 2 prompts.*one prompt with its image per call"):
        relprop.explain_generation(model, None, _batch_of_two(family), max_new_tokens=2)
    assert calls == []
    assert_same(before, snapshot(model))


def test_one_prompt_with_the_tiles_of_two_images_is_refused():
    model, calls = _watched("llava_next")
    prompt = PROMPTS["llava_next"][1]()
    with pytest.raises(relprop.MethodError, match=r"pixel_values of shape \(2, 3, 3, 32, 32\)"):
        relprop.explain_generation(model, None, {**prompt, "pixel_values": prompt["pixel_values"].expand(2, -1, -1,
                                                                                                       -1, -1)})
    assert calls == []


@pytest.mark.parametrize("family, key", [("qwen2_vl", "position_ids"), ("llava_next", "token_type_ids"),
                                         ("idefics3", "image_sizes")])
def test_keys_it_would_drop_are_refused(family, key):
    model, calls = _watched(family)
    prompt = {**PROMPTS[family][1](), key: torch.zeros(1, 2, dtype=torch.long)}
    with pytest.raises(relprop.InputError, match=rf"would drop \['{key}'\]"):
        relprop.explain_generation(model, None, prompt, max_new_tokens=2)
    assert calls == []


def test_a_layout_explain_refuses_is_refused_before_generating():
    """Idefics3 without its tile grid keys: relprop.explain would refuse the tiles, so nothing is generated."""
    model, calls = _watched("idefics3")
    prompt = {k: v for k, v in PROMPTS["idefics3"][1]().items() if k not in ("rows", "cols")}
    with pytest.raises(relprop.MethodError, match=r"rows"):
        relprop.explain_generation(model, None, prompt, max_new_tokens=2)
    assert calls == []


def test_refused_family_is_refused_before_generating(monkeypatch):
    """A family relprop.explain refuses (none is left since LLaVA-OneVision is explained: one is made so with
    REFUSED) is refused with its reason before the model runs."""
    monkeypatch.setitem(vision_language.REFUSED, "llava_next", ("LLaVA-NeXT", "made up for this test: no tiles"))
    model, calls = _watched("llava_next")
    with pytest.raises(relprop.MethodError, match=r"made up for this test"):
        relprop.explain_generation(model, None, V.anyres_batch(), max_new_tokens=2)
    assert calls == []
