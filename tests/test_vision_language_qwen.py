"""Qwen2-VL and Qwen2.5-VL, unmodified, tiny random configs (tests/vlm_models.py), explained with their image
(relprop/api/qwen_images.py):

* the processor's flattened 2x2-merged rows (transformers' own Qwen2VLImageProcessor) against a loop over
  the patches, and read back to the image;
* ``lrp`` under ``"attnlrp"`` and ``"cp_lrp"``: per-patch relevance on the image's 4x6 grid and per-token
  relevance of the prompt from one run; Σ pixels + Σ prompt + absorbed = the score (through the vision
  tower, Qwen2.5-VL's windows, the merger and the merge); the fast path equals the walk; the model untouched;
* the patch map is the image's: a patch whose pixels are 0 gets no relevance, and only that one;
* rollout-style methods on the language model's blocks, each image token placed on its 2x2 patches,
  against a loop;
* what relprop does not explain (a batch without one image per prompt, a video, unequal time copies, a patch order the
  model disagrees with) is refused.
"""
from __future__ import annotations

import types

import pytest
import torch
import transformers
from hypothesis import HealthCheck, given, settings, strategies as st

import relprop
import vlm_models as V
from relprop.models import qwen_images
from snapshot import assert_same, snapshot

QWEN = list(V.QWEN_FAMILIES)
GH, GW = V.QWEN_GRID
P = 8


@pytest.fixture(scope="module")
def qwen():
    return V.model_cache(V.QWEN_FAMILIES)


# ------------------------------------------------------------------ the patch order (no export: fast)

def _rows_by_loop(image: torch.Tensor) -> torch.Tensor:
    """Row k of the processor's output, written out: 2x2 block k // 4 of the (GH/2) x (GW/2) block grid
    (row-major), patch k % 4 of the block (row-major), its pixels [C, T, P, P] with both frames the image."""
    rows = torch.zeros(GH * GW, 3 * 2 * P * P)
    for k in range(GH * GW):
        block, inner = divmod(k, 4)
        i = (block // (GW // 2)) * 2 + inner // 2
        j = (block % (GW // 2)) * 2 + inner % 2
        patch = image[:, i * P:(i + 1) * P, j * P:(j + 1) * P]
        rows[k] = torch.stack([patch, patch], 1).reshape(-1)
    return rows


def test_rows_are_the_processors_cut_and_read_back():
    image = V.qwen_image(3)
    inputs = V.qwen_inputs(image)
    assert inputs["image_grid_thw"].tolist() == [[1, GH, GW]]
    assert torch.equal(inputs["pixel_values"], _rows_by_loop(image))
    cfg = V.qwen2_vl().config
    assert torch.equal(qwen_images.rows_of(image[None], cfg), inputs["pixel_values"])
    assert torch.equal(qwen_images.image_of(inputs["pixel_values"], (GH, GW), cfg), image[None])
    # the model's own 2-D rotary positions of the rows agree: row k is the patch the vision tower thinks it is
    positions = qwen_images.wrapper(V.qwen2_vl(), (GH, GW))._extra["image_position_ids"]
    for k in range(GH * GW):
        block, inner = divmod(k, 4)
        assert positions[k].tolist() == [(block // (GW // 2)) * 2 + inner // 2, (block % (GW // 2)) * 2 + inner % 2]


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(blocks_h=st.integers(1, 3), blocks_w=st.integers(1, 3), p=st.sampled_from([2, 4]), t=st.sampled_from([1, 2]),
       c=st.sampled_from([1, 3]), seed=st.integers(0, 1000))
def test_any_grid_is_cut_as_the_processor_cuts_it(blocks_h, blocks_w, p, t, c, seed):
    """Property: for any grid of 2x2 blocks, patch size, number of time copies and channels, relprop's cut
    of an image is transformers' own (Qwen2VLImageProcessor) and reading the rows back gives the image."""
    gh, gw = 2 * blocks_h, 2 * blocks_w
    image = torch.randn(c, gh * p, gw * p, generator=torch.Generator().manual_seed(seed))
    proc = transformers.Qwen2VLImageProcessor(patch_size=p, merge_size=2, temporal_patch_size=t, do_resize=False,
                                              do_rescale=False, do_normalize=False, do_convert_rgb=False,
                                              image_mean=[0.0] * c, image_std=[1.0] * c)
    out = proc([image], return_tensors="pt", input_data_format="channels_first")
    cfg = types.SimpleNamespace(vision_config=types.SimpleNamespace(patch_size=p, temporal_patch_size=t,
                                                                    spatial_merge_size=2, in_channels=c))
    assert out["image_grid_thw"].tolist() == [[1, gh, gw]]
    assert torch.equal(qwen_images.rows_of(image[None], cfg), out["pixel_values"])
    assert torch.equal(qwen_images.image_of(out["pixel_values"], (gh, gw), cfg), image[None])


def test_a_patch_order_the_model_disagrees_with_is_refused():
    with pytest.raises(relprop.MethodError, match=r"rotary positions.*do not follow"):
        qwen_images._check_order(V.qwen2_vl(), (GH, GW), torch.zeros(GH * GW, 2, dtype=torch.long))


def test_the_explained_module_is_named_as_the_users_model():
    """relprop's warnings and notes name the class of the module they explain: the QwenImage of a model carries
    the model's class name (never "QwenImage"), one class per model class."""
    for make in V.QWEN_FAMILIES.values():
        model = make()
        w = qwen_images.wrapper(model, (GH, GW))
        assert type(w).__name__ == type(model).__name__ and isinstance(w, qwen_images.QwenImage)
        assert type(qwen_images.wrapper(model, (2, 2))) is type(w)


def test_batches_videos_and_unequal_frames_are_refused():
    model = V.qwen2_vl()
    one = V.qwen_inputs(V.qwen_image())
    # a batch of prompts is explained sample by sample (tests/test_vlm_batches.py), one image per prompt
    two = dict(one, input_ids=one["input_ids"].repeat(2, 1), attention_mask=one["attention_mask"].repeat(2, 1),
               mm_token_type_ids=one["mm_token_type_ids"].repeat(2, 1))
    with pytest.raises(relprop.MethodError, match=r"Qwen2-VL.*batch of prompts.*one image per prompt"):
        relprop.explain(model, two, target="next_token", method="lrp")
    frames = one["pixel_values"].clone().reshape(GH * GW, 3, 2, P * P)
    frames[:, :, 1] += 1  # the second frame differs: a video's rows, not an image's
    with pytest.raises(relprop.MethodError, match=r"not the cut of one image"):
        relprop.explain(model, dict(one, pixel_values=frames.reshape(GH * GW, -1)), target="next_token",
                        method="lrp")
    with pytest.raises(relprop.MethodError, match=r"does not take \['pixel_values_videos'\]"):
        relprop.explain(model, dict(one, pixel_values_videos=one["pixel_values"]), target="next_token", method="lrp")


# ------------------------------------------------------------------ lrp: pixels and prompt from one run

@pytest.mark.parametrize("family", QWEN)
@pytest.mark.parametrize("preset", ["attnlrp", "cp_lrp"])
def test_lrp_conserves_through_vision_tower_merger_and_merge(qwen, family, preset):
    model, inputs = qwen(family), V.qwen_inputs(V.qwen_image())
    before = snapshot(model)
    e = relprop.explain(model, inputs, target="next_token", method="lrp", preset=preset, fast_path=False)
    assert_same(before, snapshot(model))
    assert e.modality == "vision" and e.grid == (GH, GW) and e.scores.shape == (1, GH * GW)
    assert e.map.shape == (1, *V.QWEN_IMAGE) and e.input_relevance.shape == (1, 3, *V.QWEN_IMAGE)
    assert set(e.streams) == {"pixel_values", "input_ids"} and torch.equal(e.streams["pixel_values"], e.scores)
    cells = e.input_relevance.sum(1).reshape(1, GH, P, GW, P).sum((2, 4)).reshape(1, -1)
    assert torch.allclose(e.scores, cells, atol=1e-7)
    pixels, prompt = e.input_relevance.flatten(1).sum(1), e.streams["input_ids"].sum(1)
    c = e.conservation
    assert torch.allclose(c.input, pixels + prompt, rtol=1e-5, atol=1e-7)
    assert torch.allclose(pixels + prompt + (c.injected - c.input), e.target_scores, atol=1e-5)
    assert float(c.error.max()) < 1e-5, c
    assert float(pixels.abs().min()) > 0  # the image reaches the score
    at = inputs["input_ids"] == V.IMAGE_TOKEN
    assert float(e.streams["input_ids"][at].abs().max()) == 0.0  # overwritten by the image tokens
    f = relprop.explain(model, inputs, target="next_token", method="lrp", preset=preset)
    assert torch.allclose(f.input_relevance, e.input_relevance, atol=1e-6)
    assert torch.allclose(f.streams["input_ids"], e.streams["input_ids"], atol=1e-6)
    assert_same(before, snapshot(model))


@pytest.mark.parametrize("family", QWEN)
def test_patch_map_is_the_images(qwen, family):
    """Black out one patch (row 1, column 4 of the 4x6 grid; in the processor's rows it is patch 2 of
    merged block 2, row 10): under the ε-rules relevance is x ⊙ (...), so that patch and only that one
    gets none, in the map and in the scores: the patch scores sit where their pixels are."""
    image = V.qwen_image()
    image[:, 8:16, 32:40] = 0
    inputs = V.qwen_inputs(image)
    assert float(inputs["pixel_values"][10].abs().max()) == 0.0
    e = relprop.explain(qwen(family), inputs, target="next_token", method="lrp", preset="attnlrp")
    assert float(e.map[:, 8:16, 32:40].abs().max()) == 0.0
    assert float(e.scores[:, 1 * GW + 4].abs().max()) == 0.0
    others = torch.cat([e.scores[:, :1 * GW + 4], e.scores[:, 1 * GW + 5:]], 1)
    assert bool((others.abs() > 0).all())


@pytest.mark.parametrize("family", QWEN)
@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
@given(row=st.integers(0, GH - 1), col=st.integers(0, GW - 1), seed=st.integers(0, 1000))
def test_any_blacked_out_patch_gets_zero_and_the_ledger_closes(qwen, family, row, col, seed):
    """Property: for a random image with a random patch blacked out, that patch's pixels and score are exactly
    0, the other patches' are not, and Σ pixels + Σ prompt + absorbed = the score (ledger error < 1e-5)."""
    image = V.qwen_image(seed)
    image[:, row * P:(row + 1) * P, col * P:(col + 1) * P] = 0
    inputs = V.qwen_inputs(image, seed=seed)
    e = relprop.explain(qwen(family), inputs, target="next_token", method="lrp", preset="attnlrp", fast_path=False)
    assert float(e.map[:, row * P:(row + 1) * P, col * P:(col + 1) * P].abs().max()) == 0.0
    k = row * GW + col
    assert float(e.scores[0, k].abs()) == 0.0
    assert bool((torch.cat([e.scores[0, :k], e.scores[0, k + 1:]]).abs() > 0).all())
    assert float(e.conservation.error.max()) < 1e-5


# ------------------------------------------------------------------ rollout-style methods

def _reference_patches(scores, ids):
    """Placeholder k -> image token k -> merged 2x2 block k of the (GH/2) x (GW/2) block grid (row-major),
    its score spread evenly over the block's 4 patches; written out with loops."""
    out = torch.zeros(scores.shape[0], GH * GW, dtype=scores.dtype)
    for b in range(scores.shape[0]):
        k = 0
        for t in range(ids.shape[1]):
            if ids[b, t] != V.IMAGE_TOKEN:
                continue
            r0, c0 = (k // (GW // 2)) * 2, (k % (GW // 2)) * 2
            for r in range(r0, r0 + 2):
                for c in range(c0, c0 + 2):
                    out[b, r * GW + c] = float(scores[b, t]) / 4
            k += 1
    return out


@pytest.mark.parametrize("family", QWEN)
def test_rollouts_place_image_tokens_on_merged_patches(qwen, family):
    model, inputs = qwen(family), V.qwen_inputs(V.qwen_image())
    before = snapshot(model)
    for e in relprop.explain(model, inputs, target="next_token", method=["rollout", "transformer_attribution"]):
        assert e.modality == "text" and e.scores.shape == inputs["input_ids"].shape
        patches = e.streams["pixel_values"]
        assert torch.allclose(patches, _reference_patches(e.scores, inputs["input_ids"]))
        at = inputs["input_ids"] == V.IMAGE_TOKEN
        assert torch.allclose(patches.sum(1), (e.scores * at).sum(1))
        assert float(patches.abs().max()) > 0
        assert any("4x6 patch grid" in n and "2x2" in n for n in e.notes), e.notes
    assert_same(before, snapshot(model))
