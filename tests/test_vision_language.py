"""Vision-language models (LLaVA, PaliGemma, Gemma-3), unmodified, tiny random configs (tests/vlm_models.py).

* the ``masked_scatter`` rule (image tokens written into the prompt's placeholders) against a loop over
  the mask's positions;
* ``lrp`` under ``"attnlrp"`` and ``"cp_lrp"``: one run gives the per-patch relevance (pixels summed per
  patch) and the per-token relevance of the prompt; Σ pixels + Σ prompt tokens + absorbed = the score
  (through the projector, Gemma-3's pooling and the merge); batch invariance; the model untouched;
* the patch map is the image's: a patch whose pixels are 0 gets no relevance, and only that one;
* rollout-style methods on the language model's blocks, image placeholders placed on the patch grid,
  against a reference written with loops;
* the families whose image tokens are not mapped back are refused with a MethodError naming them.
"""
from __future__ import annotations

import pytest
import torch
import transformers

import relprop
import vlm_models as V
from rule_helpers import make_ctx, rand, rule_of
from snapshot import assert_same, snapshot

aten = torch.ops.aten
FAMILIES = list(V.FAMILIES)


@pytest.fixture(scope="module")
def vlm():
    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = model = V.FAMILIES[family][0]()
            # transformers installs hooks that record the vision tower's hidden states on a model's first
            # call (LLaVA reads its last-but-one layer) and keeps them: called once here, so that the
            # snapshots below see only what explain() would change
            with torch.no_grad():
                model(**V.batch(family), use_cache=False)
        return cache[family]

    return get


# ------------------------------------------------------------------ the masked_scatter rule

@pytest.mark.parametrize("preset", ["chefer2021", "attnlrp", "cp_lrp"])
def test_masked_scatter_rule_routes_each_element_to_its_source(preset):
    x = rand((2, 5, 3), 0)
    mask = torch.tensor([[False, True, True, False, False], [False, False, False, True, False]])[..., None]
    src = rand((4, 3), 1)  # one row more than the 3 masked positions: the tail is never read
    out = x.masked_scatter(mask, src)
    r = rand((2, 5, 3), 2)
    rx, rm, rs = rule_of(aten.masked_scatter.default, preset)(
        make_ctx(aten.masked_scatter.default, (x, mask, src), out, (True, False, True), preset=preset), r)
    want_x, want_s = torch.zeros_like(x), torch.zeros_like(src)
    k = 0
    for b in range(2):
        for t in range(5):
            for c in range(3):
                if mask[b, t, 0]:
                    want_s.view(-1)[k] = float(r[b, t, c])
                    k += 1
                else:
                    want_x[b, t, c] = float(r[b, t, c])
    assert rm is None and torch.equal(rx, want_x) and torch.equal(rs, want_s)
    assert torch.allclose(rx.sum() + rs.sum(), r.sum())


# ------------------------------------------------------------------ lrp: pixels and prompt from one run

@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("preset", ["attnlrp", "cp_lrp"])
def test_lrp_conserves_through_projector_and_merge(vlm, family, preset):
    model, batch = vlm(family), V.batch(family)
    before = snapshot(model)
    e = relprop.explain(model, batch, target="next_token", method="lrp", preset=preset, fast_path=False)
    assert_same(before, snapshot(model))
    n = batch["input_ids"].shape[1]
    assert e.modality == "vision" and e.grid == V.GRID and e.scores.shape == (2, 16) and e.map.shape == (2, 32, 32)
    assert set(e.streams) == {"pixel_values", "input_ids"} and e.streams["input_ids"].shape == (2, n)
    assert any("exp.streams['input_ids']" in note for note in e.notes), e.notes
    assert torch.allclose(e.scores, e.input_relevance.sum(1).reshape(2, 4, 8, 4, 8).sum((2, 4)).reshape(2, 16),
                          atol=1e-7)
    pixels, prompt = e.input_relevance.flatten(1).sum(1), e.streams["input_ids"].sum(1)
    c = e.conservation
    assert torch.allclose(c.input, pixels + prompt, rtol=1e-5, atol=1e-7)
    absorbed = c.injected - c.input
    assert torch.allclose(pixels + prompt + absorbed, e.target_scores, atol=1e-5)
    assert float(c.error.max()) < 1e-5, c
    # the image reaches the score, and the placeholders' own embeddings are overwritten: no relevance there
    assert float(pixels.abs().min()) > 0
    at = batch["input_ids"] == V.IMAGE_TOKEN
    assert float(e.streams["input_ids"][at].abs().max()) == 0.0
    # the one-backward fast path gives the same relevance
    f = relprop.explain(model, batch, target="next_token", method="lrp", preset=preset)
    assert torch.allclose(f.input_relevance, e.input_relevance, atol=1e-6)
    assert torch.allclose(f.streams["input_ids"], e.streams["input_ids"], atol=1e-6)


@pytest.mark.parametrize("family", FAMILIES)
def test_lrp_batch_invariance(vlm, family):
    model, batch = vlm(family), V.batch(family)
    both = relprop.explain(model, batch, target="next_token", method="lrp", preset="attnlrp")
    for i in range(2):
        one = relprop.explain(model, {k: v[i:i + 1] for k, v in batch.items()}, target="next_token", method="lrp",
                              preset="attnlrp")
        assert torch.allclose(one.input_relevance, both.input_relevance[i:i + 1], atol=1e-6)
        assert torch.allclose(one.streams["input_ids"], both.streams["input_ids"][i:i + 1], atol=1e-6)


@pytest.mark.parametrize("family", FAMILIES)
def test_patch_map_is_the_images(vlm, family):
    """Black out one patch (row 1, column 2 of the 4x4 grid): under the ε-rules relevance is x ⊙ (...), so
    that patch and only that one gets none: the patch scores sit where their pixels are."""
    model, batch = vlm(family), V.batch(family)
    batch["pixel_values"][:, :, 8:16, 16:24] = 0
    e = relprop.explain(model, batch, target="next_token", method="lrp", preset="attnlrp")
    assert float(e.map[:, 8:16, 16:24].abs().max()) == 0.0
    assert float(e.scores[:, 1 * 4 + 2].abs().max()) == 0.0
    others = torch.cat([e.scores[:, :6], e.scores[:, 7:]], 1)
    assert bool((others.abs() > 0).all())


# ------------------------------------------------------------------ rollout-style methods: the language model's tokens

def _reference_patches(scores, ids, family):
    """Placeholder k of a sample -> image token k -> its patches, written out with loops."""
    n = V.FAMILIES[family][1]
    cell = 4 // int(round(n ** 0.5))
    out = torch.zeros(scores.shape[0], 16, dtype=scores.dtype)
    for b in range(scores.shape[0]):
        k = 0
        for t in range(ids.shape[1]):
            if ids[b, t] != V.IMAGE_TOKEN:
                continue
            r0, c0 = (k // (4 // cell)) * cell, (k % (4 // cell)) * cell
            for r in range(r0, r0 + cell):
                for c in range(c0, c0 + cell):
                    out[b, r * 4 + c] = float(scores[b, t]) / (cell * cell)
            k += 1
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_rollouts_place_image_tokens_on_patches(vlm, family):
    model, batch = vlm(family), V.batch(family)
    before = snapshot(model)
    for e in relprop.explain(model, batch, target="next_token", method=["rollout", "transformer_attribution"]):
        assert e.modality == "text" and e.scores.shape == batch["input_ids"].shape
        patches = e.streams["pixel_values"]
        assert torch.allclose(patches, _reference_patches(e.scores, batch["input_ids"], family))
        at = batch["input_ids"] == V.IMAGE_TOKEN
        assert torch.allclose(patches.sum(1), (e.scores * at).sum(1))
        assert any("patch grid" in n for n in e.notes)
    assert_same(before, snapshot(model))


def test_mixed_methods_need_two_calls(vlm):
    with pytest.raises(relprop.MethodError, match="two calls"):
        relprop.explain(vlm("llava"), V.batch("llava"), target="next_token", method=["lrp", "rollout"])


def test_blocks_of_the_merged_run_are_refused(vlm):
    with pytest.raises(relprop.MethodError, match="wrt='input_ids'"):
        relprop.explain(vlm("llava"), V.batch("llava"), target="next_token", method="rollout", wrt="pixel_values")


# ------------------------------------------------------------------ refused families

def test_refused_family_names_what_is_missing():
    torch.manual_seed(0)
    cfg = transformers.LlavaNextConfig(vision_config=transformers.CLIPVisionConfig(**V._VISION),
                                       text_config=transformers.LlamaConfig(**V._TEXT), image_token_index=V.IMAGE_TOKEN,
                                       image_grid_pinpoints=[[32, 32]])
    model = transformers.LlavaNextForConditionalGeneration(cfg).eval()
    batch = {"input_ids": torch.tensor([[1, 5, 6]]), "pixel_values": torch.zeros(1, 2, 3, 32, 32),
             "image_sizes": torch.tensor([[32, 32]])}
    with pytest.raises(relprop.MethodError, match=r"LLaVA-NeXT.*tiles"):
        relprop.explain(model, batch, target="next_token", method="lrp")


def test_unknown_family_is_refused_without_wrt():
    """A vision-language model of a family relprop does not know (its config says model_type 'newvlm'):
    relprop cannot say which patch each image token is, so without wrt= it refuses and says which wrt
    to pass, rather than guessing a layout."""
    model = V.llava()
    model.config.model_type = "newvlm"
    with pytest.raises(relprop.MethodError, match=r"model_type 'newvlm'.*wrt='input_ids'.*LLaVA"):
        relprop.explain(model, V.batch("llava"), target="next_token", method="lrp")
