"""Vision transformers at other input and patch sizes, and with register tokens: nothing
may assume a 14x14 grid, 224 pixels or a single prefix token.

Models (tests/models.py): timm ViT at 384x384 with patch 32 (12x12), timm ViT on 96x64 (a 6x4 grid),
timm DINOv2 with a class token and 4 registers (LayerScale), timm ViT with 4 registers and global
average pooling (no class token), HF ViT with patch 32, HF DINOv2 with registers.
"""
import pytest
import torch
import torch.nn.functional as F

import models
import relprop
from relprop.graph.capture import CACHE
from relprop.graph.inputs import bind_inputs
from relprop.engine import Request, Schedule, execute
from relprop.methods.query import query_weights
from relprop.targets import Target, resolve
from snapshot import assert_same, snapshot

SIZES = list(models.SIZES)
#: (grid, prefix tokens) each model must report
EXPECTED = {
    "timm_vit_384_patch32": ((12, 12), 1),
    "timm_vit_rectangular": ((6, 4), 1),
    "timm_dinov2_reg4": ((4, 4), 5),
    "timm_vit_reg4_gap": ((4, 4), 4),
    "hf_vit_patch32": ((3, 3), 1),
    "hf_dinov2_registers": ((4, 4), 5),
}
SMALL = [n for n in SIZES if n != "timm_vit_384_patch32"]


@pytest.fixture(scope="module")
def sized():
    cache = {}

    def get(name, bias_free=False):
        key = (name, bias_free)
        if key not in cache:
            m = models.SIZES[name]()
            cache[key] = models.zero_biases(m) if bias_free else m
        return cache[key]
    return get


@pytest.mark.parametrize("name", SIZES)
def test_grid_prefix_and_map_follow_the_model(sized, name):
    """The patch grid comes from the patch embedding and the prefix (class + register tokens) from
    the token count; scores are one per patch and the map is them on that grid, upsampled to the
    input's own (possibly non-square) size."""
    model = sized(name)
    x = models.sized_images(model)
    e = relprop.explain(model, x, target=1)
    (gh, gw), prefix = EXPECTED[name]
    assert e.grid == (gh, gw) and e.prefix_tokens == prefix
    assert e.scores.shape == (2, gh * gw) and e.map.shape == (2,) + tuple(x.shape[-2:])
    assert e.matrix.shape == (2, prefix + gh * gw, prefix + gh * gw)
    up = F.interpolate(e.scores.reshape(2, 1, gh, gw), size=tuple(x.shape[-2:]), mode="bilinear",
                       align_corners=False)[:, 0]
    assert torch.allclose(e.map, up)


@pytest.mark.parametrize("name", SIZES)
def test_conservation_bias_free(sized, name):
    """Input + absorbed = injected (1) to 1e-4 relative, end to end and per block."""
    model = sized(name, bias_free=True)
    e = relprop.explain(model, models.sized_images(model), target=2)
    c = e.conservation
    assert torch.allclose(c.injected, torch.ones(2))
    assert float(c.error.max()) < 1e-4, c
    assert len(c.blocks) == 2 and all(float(b.error.max()) < 1e-4 for b in c.blocks)


@pytest.mark.parametrize("name", ["timm_vit_rectangular", "timm_vit_reg4_gap"])
def test_every_method_runs(sized, name):
    """Every method (vision ones included) gives finite scores on the model's own grid."""
    model = sized(name)
    x = models.sized_images(model)
    (gh, gw), _ = EXPECTED[name]
    exps = relprop.explain(model, x, target=[0, 3], method=list(relprop.methods()), n_samples=2, n_steps=2)
    for e in exps:
        assert e.scores.shape == (2, gh * gw) and torch.isfinite(e.scores).all(), e.method
        assert e.map.shape == (2,) + tuple(x.shape[-2:]), e.method


@pytest.mark.parametrize("name", ["timm_vit_rectangular", "timm_dinov2_reg4", "timm_vit_reg4_gap"])
def test_batch_invariance(sized, name):
    """A batch of 3 explains exactly like each image alone (< 1e-5)."""
    model = sized(name)
    x = models.sized_images(model, batch=3, seed=4)
    full = relprop.explain(model, x, target=[0, 1, 2])
    for i in range(3):
        alone = relprop.explain(model, x[i:i + 1], target=i)
        assert (full.scores[i] - alone.scores[0]).abs().max() < 1e-5
        assert (full.map[i] - alone.map[0]).abs().max() < 1e-5


@pytest.mark.parametrize("name", SMALL)
def test_class_specific(sized, name):
    """The explanation depends on the class. For the pooled models the query row is the mean of
    the rows the head reads (16 patches; HF DINOv2: the class token and 16 patches), which carries
    the rollout's identity (1/16 or 1/17 per row); in these random tiny models the class-dependent
    part is ~1e-8 and vanishes next to it in float32, so the block next to the output is compared
    without the rollout (ta_last_block: the same E_h(dA ⊙ R_A)⁺)."""
    model = sized(name)
    x = models.sized_images(model)
    pooled = ("timm_vit_reg4_gap", "hf_dinov2_registers")
    method = "ta_last_block" if name in pooled else "transformer_attribution"
    a = relprop.explain(model, x, target=0, method=method).scores
    b = relprop.explain(model, x, target=1, method=method).scores
    assert (a - b).abs().max() / a.abs().max() > 1e-2


@pytest.mark.parametrize("name", ["timm_dinov2_reg4", "timm_vit_reg4_gap", "hf_vit_patch32"])
def test_model_untouched(sized, name):
    model = sized(name)
    before = snapshot(model)
    relprop.explain(model, models.sized_images(model), target=1)
    assert_same(before, snapshot(model))


def _trace(model, x, target):
    kw = bind_inputs(model, x)
    score, tgt = resolve(target, x.shape[0])
    return execute(Request(CACHE.get(model, kw), model, kw, Target(score, tgt)), Schedule(relevance="none"))


def test_pooled_model_without_class_token_reads_the_mean_of_its_patches(sized):
    """No class token, registers, global average pooling: the query is the mean of the patch rows
    (the rows the head reads); the 4 registers are left out. A head that reads the class token and
    the mean of the patches (HF DINOv2 with registers) reads 17 rows: the query is their mean (it was
    row 0 alone, which left out what the head reads of the patches)."""
    model = sized("timm_vit_reg4_gap")
    x = models.sized_images(model)
    w = query_weights(_trace(model, x, 1))
    assert torch.equal(w[:, :4], torch.zeros(2, 4))
    assert torch.allclose(w[:, 4:], torch.full((2, 16), 1 / 16))
    keep = relprop.explain(model, x, target=1, identity="keep")
    assert torch.allclose(keep.scores, keep.matrix[:, 4:, 4:].mean(1))  # the rows of the 16 patches, averaged
    # the default leaves out each query row's own identity share (1/16 of each patch's score), as Eq. 14's
    # map leaves out [CLS]'s; what remains is the blocks' terms (~1e-8 on this random model), kept exactly
    e = relprop.explain(model, x, target=1)
    assert torch.allclose(keep.scores - e.scores, torch.full((2, 16), 1 / 16), rtol=0, atol=1e-7)
    assert (e.scores > 0).all() and e.scores.max() < 1e-6
    hf = sized("hf_dinov2_registers")
    w = query_weights(_trace(hf, models.sized_images(hf), 1))
    expected = torch.zeros(2, 21)
    expected[:, 0] = expected[:, 5:] = 1 / 17  # [CLS], 4 registers, 16 patches
    assert torch.allclose(w, expected)
