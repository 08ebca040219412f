"""Vision-language models (LLaVA, PaliGemma, Gemma-3), unmodified, tiny random configs (tests/vlm_models.py).

* the ``masked_scatter`` rule (image tokens written into the prompt's placeholders) against a loop over
  the mask's positions;
* ``lrp`` under ``"attnlrp"`` and ``"cp_lrp"``: one run gives the per-patch relevance (pixels summed per
  patch) and the per-token relevance of the prompt; Σ pixels + Σ prompt tokens + absorbed = the score
  (through the projector, Gemma-3's pooling and the merge); batch invariance; the model untouched;
* the patch map is the image's: a patch whose pixels are 0 gets no relevance, and only that one;
* rollout-style methods on the language model's blocks, image placeholders placed on the patch grid,
  against a reference written with loops;
* a family whose image tokens are not mapped back (REFUSED) is refused with a MethodError naming it;
* tiled images (Idefics3, SmolVLM) and LLaVA-NeXT's any-resolution crops: the composed map against loops,
  conservation, a region blacked out across tiles gives exactly 0 in the composed map, the image tokens'
  placement through the pixel shuffle / unpadding / newline tokens against loops, and the layouts relprop
  cannot verify refused.
"""
from __future__ import annotations

import pytest
import torch

import relprop
import vlm_models as V
from relprop.models import vision_language, vlm_tiles
from relprop.graph.export import leaf_names
from rule_helpers import make_ctx, rand, rule_of
from snapshot import assert_same, snapshot

aten = torch.ops.aten
FAMILIES = list(V.FAMILIES)


@pytest.fixture(scope="module")
def vlm():
    return V.model_cache({f: b for f, (b, _) in V.FAMILIES.items()}, V.batch)


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

def test_refused_family_names_what_is_missing(vlm, monkeypatch):
    """A family in vision_language.REFUSED (none at present: LLaVA-OneVision, the last one, is explained now;
    here LLaVA put there) is refused with a MethodError that names the family and what is missing, before the
    model runs, whatever wrt= says."""
    model = vlm("llava")
    monkeypatch.setitem(vision_language.REFUSED, "llava", ("LLaVA", "its image tokens are not mapped back"))
    calls = []
    handle = model.register_forward_pre_hook(lambda m, a: calls.append(1))
    try:
        for wrt in (None, "pixel_values"):
            with pytest.raises(relprop.MethodError, match=r"\(LLaVA\) is not explained.*not mapped back"):
                relprop.explain(model, V.batch("llava"), target="next_token", method="lrp", wrt=wrt)
    finally:
        handle.remove()
    assert calls == []
    assert "llava_onevision" in vision_language.EXPLAINED and "llava_onevision" not in vision_language.REFUSED


def test_unknown_family_is_refused_without_wrt():
    """A vision-language model of a family relprop does not know (its config says model_type 'newvlm'):
    relprop cannot say which patch each image token is, so without wrt= it refuses and says which wrt
    to pass, rather than guessing a layout."""
    model = V.llava()
    model.config.model_type = "newvlm"
    with pytest.raises(relprop.MethodError, match=r"model_type 'newvlm'.*wrt='input_ids'.*LLaVA"):
        relprop.explain(model, V.batch("llava"), target="next_token", method="lrp")


# ------------------------------------------------------------------ tiled families: Idefics3, SmolVLM

TILED = list(V.TILED)


@pytest.fixture(scope="module")
def tiled():
    return V.model_cache(V.TILED, lambda family: _model_inputs(V.tiled_batch()))


def _model_inputs(batch):
    return {k: v for k, v in batch.items() if k not in ("rows", "cols")}


def _reference_map(pixels):
    """[batch, 64, 64] from per-pixel relevance [batch, 5, 32, 32] (4 tiles row by row, then the global
    image), pixel by pixel: the tile that holds the pixel, plus a quarter of the global image's pixel that
    covers it."""
    out = torch.zeros(pixels.shape[0], 64, 64, dtype=pixels.dtype)
    for b in range(pixels.shape[0]):
        for y in range(64):
            for x in range(64):
                tile = (y // 32) * 2 + x // 32
                out[b, y, x] = pixels[b, tile, y % 32, x % 32] + pixels[b, 4, y // 2, x // 2] / 4
    return out


@pytest.mark.parametrize("family", TILED)
@pytest.mark.parametrize("preset", ["attnlrp", "cp_lrp"])
def test_tiled_lrp_conserves_and_composes_the_tiles(tiled, family, preset):
    model, batch = tiled(family), V.tiled_batch()
    before = snapshot(model)
    e = relprop.explain(model, batch, target="next_token", method="lrp", preset=preset, fast_path=False)
    assert_same(before, snapshot(model))
    assert e.modality == "vision" and e.grid == (8, 8) and e.scores.shape == (2, 64) and e.map.shape == (2, 64, 64)
    assert e.input_relevance.shape == (2, 5, 3, 32, 32)
    assert set(e.streams) == {"pixel_values", "input_ids", "global_image"}
    pixels = e.input_relevance.sum(2)
    assert torch.allclose(e.map, _reference_map(pixels), atol=1e-8)
    assert torch.equal(e.streams["global_image"], pixels[:, 4])
    assert torch.allclose(e.scores, e.map.reshape(2, 8, 8, 8, 8).sum((2, 4)).reshape(2, 64), atol=1e-8)
    # the ledger counts every tile and the global image: Σ pixels + Σ prompt + absorbed = the score
    total, prompt = e.input_relevance.flatten(1).sum(1), e.streams["input_ids"].sum(1)
    assert torch.allclose(e.map.flatten(1).sum(1), total, atol=1e-7)
    c = e.conservation
    assert torch.allclose(c.input, total + prompt, rtol=1e-5, atol=1e-7)
    assert torch.allclose(total + prompt + (c.injected - c.input), e.target_scores, atol=1e-5)
    assert float(c.error.max()) < 1e-5, c
    assert float(pixels[:, :4].abs().flatten(1).sum(1).min()) > 0 and float(pixels[:, 4].abs().sum(1).min()) > 0
    assert float(e.streams["input_ids"][batch["input_ids"] == V.IMAGE_TOKEN].abs().max()) == 0.0
    assert any("global image" in n for n in e.notes), e.notes
    f = relprop.explain(model, batch, target="next_token", method="lrp", preset=preset)
    assert torch.allclose(f.input_relevance, e.input_relevance, atol=1e-6)
    assert torch.allclose(f.map, e.map, atol=1e-6)


def test_tiled_lrp_batch_invariance(tiled):
    model, batch = tiled("idefics3"), V.tiled_batch()
    both = relprop.explain(model, batch, target="next_token", method="lrp", preset="attnlrp", fast_path=False)
    for i in range(2):
        one = relprop.explain(model, {k: v[i:i + 1] for k, v in batch.items()}, target="next_token", method="lrp",
                              preset="attnlrp", fast_path=False)
        assert torch.allclose(one.input_relevance, both.input_relevance[i:i + 1], atol=1e-6)
        assert torch.allclose(one.map, both.map[i:i + 1], atol=1e-6)
        assert torch.allclose(one.streams["input_ids"], both.streams["input_ids"][i:i + 1], atol=1e-6)
        assert torch.allclose(one.conservation.absorbed, both.conservation.absorbed[i:i + 1], atol=1e-6)


def test_tiled_map_is_the_images():
    """Black out a 16x16 region of the 64x64 image that straddles all four tiles (rows and columns 24..40):
    under the ε-rules relevance is x ⊙ (...), so the composed map is 0 exactly there (the four tiles' pieces
    and the global image's 8x8 pixels that cover it, each at its place), and its 2x2 patches of the 8x8
    grid get none while every other patch does: the tiles and the global image are placed where their
    pixels came from."""
    model = V.idefics3()
    image = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    image[:, :, 24:40, 24:40] = 0
    batch = V.tiled_batch(image=image)
    e = relprop.explain(model, batch, target="next_token", method="lrp", preset="attnlrp")
    assert torch.equal(e.image, image)  # the tiles put back together are the image they were cut from
    assert e.overlay(index=1).shape == (64, 64, 3)
    assert float(e.map[:, 24:40, 24:40].abs().max()) == 0.0
    dark = torch.zeros(8, 8, dtype=torch.bool)
    dark[3:5, 3:5] = True
    assert float(e.scores[:, dark.flatten()].abs().max()) == 0.0
    assert bool((e.scores[:, ~dark.flatten()].abs() > 0).all())


def _reference_tile_patches(scores, ids):
    """Placeholder k -> image k // 4 (tiles row by row, then the global image) -> token k % 4 of its 2x2
    shuffled cells -> its patches on the 8x8 grid of the composed image, with loops."""
    out = torch.zeros(scores.shape[0], 8, 8, dtype=scores.dtype)
    for b in range(scores.shape[0]):
        k = 0
        for t in range(ids.shape[1]):
            if ids[b, t] != V.IMAGE_TOKEN:
                continue
            image, (tr, tc) = k // 4, divmod(k % 4, 2)
            if image < 4:  # a tile: its 2x2 patches
                r0, c0 = (image // 2) * 4 + tr * 2, (image % 2) * 4 + tc * 2
                for r in range(r0, r0 + 2):
                    for c in range(c0, c0 + 2):
                        out[b, r, c] += float(scores[b, t]) / 4
            else:  # the global image: its 2x2 patches cover 4x4 patches of the composed grid
                for r in range(tr * 4, tr * 4 + 4):
                    for c in range(tc * 4, tc * 4 + 4):
                        out[b, r, c] += float(scores[b, t]) / 16
            k += 1
    return out.reshape(scores.shape[0], 64)


def test_tiled_rollouts_place_image_tokens_on_patches(tiled):
    model, batch = tiled("idefics3"), V.tiled_batch()
    before = snapshot(model)
    for e in relprop.explain(model, batch, target="next_token", method=["rollout", "transformer_attribution"]):
        assert e.modality == "text" and e.scores.shape == batch["input_ids"].shape
        patches = e.streams["pixel_values"]
        assert torch.allclose(patches, _reference_tile_patches(e.scores, batch["input_ids"]), atol=1e-7)
        at = batch["input_ids"] == V.IMAGE_TOKEN
        assert torch.allclose(patches.sum(1), (e.scores * at).sum(1), atol=1e-6)
        assert any("pixel shuffle" in n for n in e.notes)
    assert_same(before, snapshot(model))


@pytest.mark.parametrize("rows,cols", [(0, 0), (2, 2), (1, 3)])
def test_tile_placement_matrix_against_loops(rows, cols):
    """token_placement's rows sum to 1 and put each token where the loops say (the 2x2 layout of the
    tests above, a 1x3 strip, a single image)."""
    lay = vlm_tiles.TileLayout(rows, cols, (32, 32), 8, 2)
    place = vlm_tiles.token_placement(lay, torch.float64)
    assert torch.allclose(place.sum(1), torch.ones(place.shape[0], dtype=torch.float64))
    gh, gw = lay.grid
    for k in range(place.shape[0]):
        image, (tr, tc) = k // 4, divmod(k % 4, 2)
        want = torch.zeros(gh, gw, dtype=torch.float64)
        if image == lay.images - 1:
            r, c = max(rows, 1), max(cols, 1)
            want[tr * 2 * r:(tr + 1) * 2 * r, tc * 2 * c:(tc + 1) * 2 * c] = 1 / (4 * r * c)
        else:
            y, x = divmod(image, cols)
            want[y * 4 + tr * 2:y * 4 + tr * 2 + 2, x * 4 + tc * 2:x * 4 + tc * 2 + 2] = 0.25
        assert torch.equal(place[k].reshape(gh, gw), want), k


def test_tiled_layout_that_cannot_be_verified_is_refused():
    """Refused before any capture, each with what is missing: no rows/cols for 5 images, a grid that
    is not the images, a padding image (all zeros), a pixel_attention_mask that masks pixels."""
    model = V.idefics3()
    batch = V.tiled_batch()
    with pytest.raises(relprop.MethodError, match=r"rows and cols.*return_row_col_info=True"):
        relprop.explain(model, _model_inputs(batch), target="next_token", method="lrp")
    with pytest.raises(relprop.MethodError, match=r"3 x 2 tiles.*7 images.*5"):
        relprop.explain(model, {**batch, "rows": [[3], [3]]}, target="next_token", method="lrp")
    with pytest.raises(relprop.MethodError, match=r"different tile grids"):
        relprop.explain(model, {**batch, "rows": [[2], [1]]}, target="next_token", method="lrp")
    padded = dict(batch, pixel_values=batch["pixel_values"].clone())
    padded["pixel_values"][1, 2] = 0
    with pytest.raises(relprop.MethodError, match=r"all zeros.*padding"):
        relprop.explain(model, padded, target="next_token", method="lrp")
    mask = torch.ones(2, 5, 32, 32, dtype=torch.bool)
    mask[0, 0, 16:] = False
    with pytest.raises(relprop.MethodError, match=r"pixel_attention_mask masks pixels"):
        relprop.explain(model, {**batch, "pixel_attention_mask": mask}, target="next_token", method="lrp")
    short = dict(batch, input_ids=batch["input_ids"].clone())
    short["input_ids"][:, 5] = V.FIRST_ID
    with pytest.raises(relprop.MethodError, match=r"20 image placeholders"):
        relprop.explain(model, short, target="next_token", method="lrp")


# ------------------------------------------------------------------ LLaVA-NeXT: any-resolution crops

@pytest.fixture(scope="module")
def next_model():
    model = V.llava_next()
    with torch.no_grad():  # the first call's lazy state (as vlm above)
        model(**V.anyres_batch(), use_cache=False)
    return model


@pytest.mark.parametrize("preset", ["attnlrp", "cp_lrp"])
def test_llava_next_lrp_conserves_and_composes_the_crops(next_model, preset):
    batch = V.anyres_batch(32)
    before = snapshot(next_model)
    e = relprop.explain(next_model, batch, target="next_token", method="lrp", preset=preset, fast_path=False)
    assert_same(before, snapshot(next_model))
    assert e.modality == "vision" and e.grid == (4, 8) and e.map.shape == (1, 32, 64)
    pixels = e.input_relevance.sum(2)  # [1, 3 tiles, 32, 32]: the base image, then the two crops
    want = V.crops_by_loop(pixels)
    assert torch.equal(e.map, want)
    assert torch.equal(e.streams["base_image"], pixels[:, 0])  # kept apart, not added into the map
    assert torch.equal(e.image[0, :, :, :32], batch["pixel_values"][0, 1])  # the crops put back together
    assert torch.equal(e.image[0, :, :, 32:], batch["pixel_values"][0, 2])
    assert torch.allclose(e.scores, e.map.reshape(1, 4, 8, 8, 8).sum((2, 4)).reshape(1, 32), atol=1e-8)
    total, prompt = e.input_relevance.sum(), e.streams["input_ids"].sum()
    assert torch.allclose(e.map.sum() + e.streams["base_image"].sum(), total, atol=1e-7)
    c = e.conservation
    assert torch.allclose(c.input, (total + prompt).reshape(1), rtol=1e-5, atol=1e-7)
    assert float(c.error.max()) < 1e-5, c
    assert float(pixels[0, 0].abs().sum()) > 0 and float(e.map.abs().sum()) > 0
    f = relprop.explain(next_model, batch, target="next_token", method="lrp", preset=preset)
    assert torch.allclose(f.input_relevance, e.input_relevance, atol=1e-6)
    assert torch.allclose(f.map, e.map, atol=1e-6)


def test_llava_next_map_is_the_images(next_model):
    """A 16x64 image, padded to the 32x64 canvas (8 rows above and below) and unpadded by the model to the
    middle two patch rows: black out its first 8 rows at columns 24..40 (both crops): the map is 0 there,
    and so are its patches (1, 3) and (1, 4) and the patch rows the model unpads away (their tokens are
    dropped: padding), while every other patch of the kept rows gets relevance."""
    image = torch.randn(1, 3, 16, 64, generator=torch.Generator().manual_seed(1))
    image[:, :, 0:8, 24:40] = 0
    batch = V.anyres_batch(16, image=image)
    e = relprop.explain(next_model, batch, target="next_token", method="lrp", preset="attnlrp")
    assert torch.equal(e.image[:, :, 8:24], image)  # the crops put back together: the image at the centre
    assert float(e.map[:, 8:16, 24:40].abs().max()) == 0.0
    grid = e.scores.reshape(4, 8)
    dark = torch.zeros(4, 8, dtype=torch.bool)
    dark[0] = dark[3] = True
    dark[1, 3:5] = True
    assert float(grid[dark].abs().max()) == 0.0
    assert bool((grid[~dark].abs() > 0).all())


def test_llava_next_rollouts_place_crop_and_base_tokens(next_model):
    batch = V.anyres_batch(16)
    for e in relprop.explain(next_model, batch, target="next_token", method=["rollout", "transformer_attribution"]):
        scores = e.scores[0][batch["input_ids"][0] == V.IMAGE_TOKEN]  # 16 base, then 2 rows of 8 crops + newline
        crops, base = torch.zeros(4, 8), torch.zeros(16)
        for k, s in enumerate(scores.tolist()):
            if k < 16:
                base[k] = s
                continue
            row, col = divmod(k - 16, 9)
            if col < 8:  # col 8: the row's image_newline, no patch
                crops[1 + row, col] = s
        assert torch.allclose(e.streams["pixel_values"][0], crops.flatten())
        assert torch.allclose(e.streams["base_image"][0], base)
        assert any("image_newline" in n for n in e.notes)


def test_capture_binds_each_leaf_of_a_plain_input():
    """LLaVA-NeXT's image_sizes is handed to torch.export as ints, one graph input per int: each is bound
    to its input's name; an input that holds several tensors is refused (it would be bound whole)."""
    assert leaf_names({"a": torch.ones(2), "b": [[1, 2], [3, 4]], "c": False}) == ["a", "b", "b", "b", "b", "c"]
    with pytest.raises(relprop.CaptureError, match="container of tensors"):
        leaf_names({"a": (torch.ones(2), torch.ones(2))})


def test_llava_next_layout_that_cannot_be_verified_is_refused(next_model):
    batch = V.anyres_batch(32)
    two = {**batch, "input_ids": torch.cat([batch["input_ids"]] * 2),  # two prompts, one image
           "attention_mask": torch.cat([batch["attention_mask"]] * 2)}
    with pytest.raises(relprop.MethodError, match=r"LLaVA-NeXT.*batch of prompts.*one image per prompt"):
        relprop.explain(next_model, two, target="next_token", method="lrp")
    with pytest.raises(relprop.MethodError, match=r"2x2 tiles.*5 tiles.*holds 3"):
        relprop.explain(next_model, {**batch, "image_sizes": torch.tensor([[64, 64]])}, target="next_token",
                        method="lrp")
    with pytest.raises(relprop.MethodError, match=r"no image_sizes"):
        relprop.explain(next_model, {k: v for k, v in batch.items() if k != "image_sizes"}, target="next_token",
                        method="lrp")
    with pytest.raises(relprop.MethodError, match=r"needs 34 placeholders.*holds 52"):
        relprop.explain(next_model, {**batch, "image_sizes": torch.tensor([[16, 64]])}, target="next_token",
                        method="lrp")
