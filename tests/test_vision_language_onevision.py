"""LLaVA-OneVision, unmodified, tiny random configs (tests/vlm_models.py): any-resolution crops like LLaVA-NeXT,
whose unpadded crop grid the model shrinks by bilinear interpolation when it is over ``vision_aspect_ratio``.

Two models: "onevision" ("anyres_max_9": the 4x8 crop grid of a 32x64 image is kept) and "onevision_shrunk"
("anyres_max_1": the 4x8 grid is interpolated down to 2x5 tokens; a 16x64 image's 2x8 grid is kept).

* the interpolation's weights (relprop.models.anyres_packing.line_weights) against the bilinear formula
  written out, and the rule upsample_bilinear2d gets under "attnlrp" / "cp_lrp" against the ε-rule formula,
  conserving;
* ``lrp``: the crops composed into exp.map against loops, Σ map + Σ base image = Σ pixels, the ledger closes
  (Σ pixels + Σ prompt + absorbed = the score), with and without the interpolation; the model untouched;
  a blacked-out patch gets exactly 0; the explained score is the model's logit;
* rollouts: each image token placed where the model's own computation takes it from: the Jacobian of
  the model's image tokens w.r.t. its projector's patch features (autograd on the real forward);
* refused: a batch, several images in a prompt, a video, a packing that is not relprop's picture.
"""
from __future__ import annotations

import pytest
import torch

import relprop
import vlm_models as V
from relprop.models import anyres_packing, vlm_anyres
from rule_helpers import make_ctx, rule_of
from snapshot import assert_same, snapshot

aten = torch.ops.aten
#: (model, image height, crop token grid the model packs): kept 4x8, shrunk 4x8 -> 2x5, kept 2x8
CASES = [("onevision", 32, (4, 8)), ("onevision_shrunk", 32, (2, 5)), ("onevision_shrunk", 16, (2, 8))]
IDS = [f"{f}-{h}" for f, h, _ in CASES]


@pytest.fixture(scope="module")
def onevision():
    first = {"onevision": (4, 8), "onevision_shrunk": (2, 5)}  # the first call's lazy state (test_vision_language)
    return V.model_cache(V.ONEVISION_FAMILIES, lambda family: _batch(32, first[family]))


def _batch(height, tokens, **kw):
    return V.anyres_batch(height, crop_tokens=tokens, **kw)


# ------------------------------------------------------------------ the interpolation and its rule

def _bilinear(n_in, n_out):
    """[n_out, n_in]: interpolation with align_corners=False written out: output i reads the input at
    (i + 1/2)·n_in/n_out - 1/2 (clamped at 0), between its two neighbours (the last one repeated)."""
    w = torch.zeros(n_out, n_in, dtype=torch.float64)
    for i in range(n_out):
        src = max((i + 0.5) * n_in / n_out - 0.5, 0.0)
        a = int(src)
        lam = src - a
        w[i, a] += 1 - lam
        w[i, min(a + 1, n_in - 1)] += lam
    return w


@pytest.mark.parametrize("n_in, n_out", [(4, 2), (8, 5), (8, 8), (9, 4), (3, 7)])
def test_line_weights_are_bilinear_and_separable(n_in, n_out):
    w = anyres_packing.line_weights(n_in, n_out)
    assert torch.allclose(w, _bilinear(n_in, n_out), atol=1e-12)
    assert torch.allclose(w.sum(1), torch.ones(n_out, dtype=torch.float64))
    x = torch.randn(2, 3, n_in, n_in + 1, dtype=torch.float64)
    want = torch.nn.functional.interpolate(x, size=(n_out, n_out + 2), mode="bilinear")
    got = torch.einsum("ia,jb,ncab->ncij", w, anyres_packing.line_weights(n_in + 1, n_out + 2), x)
    assert torch.allclose(got, want, atol=1e-12)


@pytest.mark.parametrize("preset", ["attnlrp", "cp_lrp"])
def test_shrinking_gets_the_epsilon_rule_and_conserves(preset):
    """The model's shrink ([1, channels, 4, 8] -> [2, 5], aten.upsample_bilinear2d.vec) gets the ε-rule of a
    linear map without bias: R_x[c,a,b] = x[c,a,b] Σ_ij Wh[i,a] Ww[j,b] R[c,i,j] / (y[c,i,j] + ε sign y)."""
    op = aten.upsample_bilinear2d.vec
    fn = rule_of(op, preset)
    assert fn.__name__ == "pooling_epsilon"
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 6, 4, 8, generator=g, dtype=torch.float64)
    y = op(x, [2, 5], False, None)
    r = torch.randn(1, 6, 2, 5, generator=g, dtype=torch.float64)
    ctx = make_ctx(op, (x, [2, 5], False, None), y, (True, False, False, False), preset=preset)
    rx = fn(ctx, r)[0]
    wh, ww = _bilinear(4, 2), _bilinear(8, 5)
    eps = ctx.eps
    z = r / (y + eps * torch.where(y >= 0, 1.0, -1.0))
    want = torch.zeros_like(x)
    for c in range(6):
        for a in range(4):
            for b in range(8):
                want[0, c, a, b] = x[0, c, a, b] * sum(wh[i, a] * ww[j, b] * z[0, c, i, j]
                                                       for i in range(2) for j in range(5))
    assert torch.allclose(rx, want, atol=1e-10)
    assert abs(float(rx.sum() - (r * y / (y + eps * torch.where(y >= 0, 1.0, -1.0))).sum())) < 1e-9


# ------------------------------------------------------------------ lrp: crops composed, ledger

@pytest.mark.parametrize("preset", ["attnlrp", "cp_lrp"])
@pytest.mark.parametrize("family, height, tokens", CASES, ids=IDS)
def test_lrp_conserves_and_composes_the_crops(onevision, family, height, tokens, preset):
    model, batch = onevision(family), _batch(height, tokens)
    before = snapshot(model)
    e = relprop.explain(model, batch, target="next_token", method="lrp", preset=preset, fast_path=False)
    assert_same(before, snapshot(model))
    assert e.modality == "vision" and e.grid == (4, 8) and e.map.shape == (1, 32, 64)
    pixels = e.input_relevance.sum(2)  # [1, 3 tiles, 32, 32]: the base image, then the two crops
    want = V.crops_by_loop(pixels)
    assert torch.equal(e.map, want)
    assert torch.equal(e.streams["base_image"], pixels[:, 0])
    total, prompt = e.input_relevance.sum(), e.streams["input_ids"].sum()
    assert torch.allclose(e.map.sum() + e.streams["base_image"].sum(), total, atol=1e-7)
    c = e.conservation
    assert torch.allclose(c.input, (total + prompt).reshape(1), rtol=1e-5, atol=1e-7)
    assert torch.allclose(total + prompt + (c.injected - c.input), e.target_scores, atol=1e-5)
    assert float(c.error.max()) < 1e-5, c
    assert float(pixels[0, 0].abs().sum()) > 0 and float(e.map.abs().sum()) > 0
    shrunk = tokens != ((4, 8) if height == 32 else (2, 8))
    assert any("upsample_bilinear2d" in n for n in e.notes) == shrunk, e.notes
    f = relprop.explain(model, batch, target="next_token", method="lrp", preset=preset)
    assert torch.allclose(f.input_relevance, e.input_relevance, atol=1e-6)


def test_explained_score_is_the_models_logit(onevision):
    """image_sizes as ints, the processor's batch_num_images=[1] and a vision_aspect_ratio equal to the
    config's dropped: the score relprop explains is the model's own logit on the inputs as given, and the
    explanation is the same as without them."""
    model, batch = onevision("onevision_shrunk"), _batch(32, (2, 5))
    given = {**batch, "batch_num_images": torch.tensor([1]), "vision_aspect_ratio": "anyres_max_1"}
    with torch.no_grad():
        logits = model(**given, use_cache=False).logits[0, -1]
    e = relprop.explain(model, given, target="next_token", method="lrp")
    assert torch.allclose(e.target_scores, logits.max().reshape(1), atol=1e-5)
    plain = relprop.explain(model, batch, target="next_token", method="lrp")
    assert torch.equal(plain.input_relevance, e.input_relevance)


def test_blacked_out_patch_gets_zero(onevision):
    """The shrunk case: the pixels of crop patch (1, 5) (rows 8..16, columns 40..48 of the composed image)
    are 0: the map is exactly 0 there, and so is that patch's score; every other patch gets relevance."""
    batch = _batch(32, (2, 5))
    batch["pixel_values"][0, 2, :, 8:16, 8:16] = 0  # the second crop's patch (1, 1)
    e = relprop.explain(onevision("onevision_shrunk"), batch, target="next_token", method="lrp", preset="attnlrp")
    assert float(e.map[0, 8:16, 40:48].abs().max()) == 0.0
    grid = e.scores.reshape(4, 8)
    assert float(grid[1, 5]) == 0.0
    dark = torch.zeros(4, 8, dtype=torch.bool)
    dark[1, 5] = True
    assert bool((grid[~dark].abs() > 0).all())


# ------------------------------------------------------------------ rollouts: placed by the model's dependence

def _jacobian(model, batch):
    """[image tokens, tiles·16]: the weight of each tile patch's projected feature in each image token the
    model writes into the prompt (autograd through the model's get_image_features: unpadding, shrinking,
    newlines; the dependence is linear and the same in every channel)."""
    leaf = {}

    def hook(module, args, out):
        leaf["x"] = out.detach().requires_grad_()
        return leaf["x"]

    handle = model.model.multi_modal_projector.register_forward_hook(hook)
    try:
        tokens = model.model.get_image_features(batch["pixel_values"], batch["image_sizes"]).pooler_output[0]
    finally:
        handle.remove()
    rows = [torch.autograd.grad(tokens[k].sum(), leaf["x"], retain_graph=True)[0][..., 0].reshape(-1)
            for k in range(tokens.shape[0])]
    return torch.stack(rows)


def _on_grid(per_patch):
    """(crops [4·8] on the composed grid, base [16]) from values per tile patch [3·16]."""
    tiles = per_patch.reshape(3, 4, 4)
    crops = torch.zeros(4, 8, dtype=per_patch.dtype)
    for y in range(4):
        for x in range(8):
            crops[y, x] = tiles[1 + x // 4, y, x % 4]
    return crops.reshape(-1), tiles[0].reshape(-1)


@pytest.mark.parametrize("family, height, tokens", CASES, ids=IDS)
def test_token_placement_is_the_models_dependence(onevision, family, height, tokens):
    model, batch = onevision(family), _batch(height, tokens)
    jac = _jacobian(model, batch)
    lay = vlm_anyres.layout(model, batch)
    assert lay.token_grid == tokens and jac.shape[0] == lay.tokens
    crops, base = vlm_anyres.token_patches(torch.eye(lay.tokens, dtype=torch.float64), lay)
    for k in range(lay.tokens):  # token k's score lands where token k reads its features from, by the weight
        want_crops, want_base = _on_grid(jac[k].double())
        assert torch.allclose(crops[k], want_crops, atol=1e-6), k
        assert torch.allclose(base[k], want_base, atol=1e-6), k


def test_rollouts_spread_interpolated_tokens_by_their_weights(onevision):
    model, batch = onevision("onevision_shrunk"), _batch(32, (2, 5))
    jac = _jacobian(model, batch)
    for e in relprop.explain(model, batch, target="next_token", method=["rollout", "transformer_attribution"]):
        scores = e.scores[0][batch["input_ids"][0] == V.IMAGE_TOKEN]
        crops, base = _on_grid(scores @ jac)
        assert torch.allclose(e.streams["pixel_values"][0], crops, atol=1e-6)
        assert torch.allclose(e.streams["base_image"][0], base, atol=1e-6)
        newlines = scores[16:].reshape(2, 6)[:, 5].sum()  # what the newline tokens hold: no patch
        assert torch.allclose(e.streams["pixel_values"].sum() + base.sum() + newlines, scores.sum(), atol=1e-6)
        assert any("bilinear weights" in n for n in e.notes)


# ------------------------------------------------------------------ refused

def test_layouts_relprop_cannot_place_are_refused(onevision):
    model = onevision("onevision_shrunk")
    batch = _batch(32, (2, 5))
    calls = []
    handle = model.register_forward_pre_hook(lambda m, a: calls.append(1))
    try:
        two = {**batch, "input_ids": torch.cat([batch["input_ids"]] * 2),  # two prompts, one image (a batch of
               "attention_mask": torch.cat([batch["attention_mask"]] * 2)}  # prompts: sample by sample)
        with pytest.raises(relprop.MethodError, match=r"LLaVA-OneVision.*batch of prompts.*one image per prompt"):
            relprop.explain(model, two, target="next_token", method="lrp")
        with pytest.raises(relprop.MethodError, match=r"batch_num_images.*one image"):
            relprop.explain(model, {**batch, "batch_num_images": torch.tensor([2])}, target="next_token",
                            method="lrp")
        with pytest.raises(relprop.MethodError, match=r"vision_aspect_ratio='anyres_max_9' in the inputs"):
            relprop.explain(model, {**batch, "vision_aspect_ratio": "anyres_max_9"}, target="next_token",
                            method="lrp")
        with pytest.raises(relprop.MethodError, match=r"pixel_values_videos"):
            relprop.explain(model, {**batch, "pixel_values_videos": torch.zeros(1, 2, 3, 32, 32)},
                            target="next_token", method="lrp")
        with pytest.raises(relprop.MethodError, match=r"needs 52 placeholders.*the unpadded crops'.*holds 28"):
            relprop.explain(onevision("onevision"), batch, target="next_token", method="lrp")
        with pytest.raises(relprop.MethodError, match=r"needs 28 placeholders.*shrunk to 2x5.*holds 52"):
            relprop.explain(model, _batch(32, None), target="next_token", method="lrp")
    finally:
        handle.remove()
    assert calls == []


def test_a_packing_unlike_relprops_is_refused(onevision, monkeypatch):
    """relprop checks its picture against the model's own pack_image_features: a model that packs the crop
    tokens otherwise (here its two crops swapped) is refused, not placed."""
    model = onevision("onevision_shrunk")
    own = type(model.model).pack_image_features

    def swapped(self, image_features, image_sizes, image_newline=None, vision_aspect_ratio="anyres_max_9"):
        feats = [torch.cat([f[:1], f[1:].flip(0)]) for f in image_features]
        return own(self, feats, image_sizes, image_newline, vision_aspect_ratio)

    monkeypatch.setattr(type(model.model), "pack_image_features", swapped)
    with pytest.raises(relprop.MethodError, match=r"pack_image_features packs the 1x2 tiles.*otherwise"):
        vlm_anyres.layout(model, _batch(32, (2, 5)))


def test_features_other_than_the_patches_are_refused(onevision):
    """SigLIP has no class token: "default" (drop the first feature) would drop a patch; refused."""
    model = onevision("onevision")
    model.config.vision_feature_select_strategy = "default"
    try:
        with pytest.raises(relprop.MethodError, match=r"'default' keeps 15 features per tile.*16 patches"):
            vlm_anyres.layout(model, _batch(32, None))
    finally:
        model.config.vision_feature_select_strategy = "full"
