"""The stabilizer ε and the precision of relevance.

* The fast path (one modified-gradient backward) and the interpreter (rule by rule) apply the
  ε-rule's stabilizer at the same nodes, so they agree to float rounding for every ``eps``, in
  float32 and in float64, on a tiny ViT, BERT, a LLaMA-style decoder and EVA-02 (rotary
  embeddings, SwiGLU).
* A float64 model gets float64 relevance: scores, maps, block records, the conservation
  bookkeeping; its conservation error is at float64 rounding (eps=0, bias-free models) and the fast
  path matches it. (Half precision is upcast to float32: ``tests/test_dtypes.py``.)
"""
from __future__ import annotations

import copy

import pytest
import timm
import torch

import models
import relprop

EPS_VALUES = (0.0, 1e-9, 1e-6, 1e-3)


def eva02():
    torch.manual_seed(0)
    return timm.create_model("eva02_tiny_patch14_224", pretrained=False, num_classes=5, img_size=56, depth=2).eval()


def _images(size):
    return torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(0))


CASES = {
    "timm_vit_tiny": (models.timm_vit_tiny, lambda: _images(64), 1),
    "hf_bert": (lambda: models.hf_bert("eager"), models.text_batch, 1),
    "hf_llama": (models.hf_llama, models.decoder_batch, "next_token"),
    "timm_eva02": (eva02, lambda: _images(56), 1),
}
#: largest |fast − interpreter| / max |R| allowed. HF's LLaMA computes RMSNorm in float32 even in a
#: float64 model (``hidden_states.to(torch.float32)``), so its float64 relevance carries float32 rounding.
TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-12}
FLOAT32_INSIDE = {"hf_llama"}


def _cast(x, dtype):
    if torch.is_tensor(x):
        return x.to(dtype) if x.is_floating_point() else x
    return {k: _cast(v, dtype) for k, v in x.items()}


@pytest.fixture(scope="module")
def case():
    cache = {}

    def get(name, dtype):
        if (name, dtype) not in cache:
            make, inputs, target = CASES[name]
            cache[(name, dtype)] = (make().to(dtype), _cast(inputs(), dtype), target)
        return cache[(name, dtype)]
    return get


@pytest.mark.parametrize("preset", ["attnlrp", "cp_lrp"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("name", list(CASES))
def test_fast_path_equals_interpreter_for_every_eps(case, name, dtype, preset):
    """max |fast − interpreter| / max |R| below float rounding for eps in 0, 1e-9, 1e-6, 1e-3 (before
    the ε-rule's stabilizer entered the fast path at every ε-rule node, 3.6e-3 at eps=1e-6 and 0.7
    at eps=1e-3 on the ViT, in float64 as well)."""
    model, x, target = case(name, dtype)
    tol = TOLERANCE[torch.float32 if name in FLOAT32_INSIDE else dtype]
    for eps in EPS_VALUES:
        fast = relprop.explain(model, x, target=target, method="lrp", preset=preset, eps=eps)
        ref = relprop.explain(model, x, target=target, method="lrp", preset=preset, eps=eps, fast_path=False)
        assert fast.conservation is None and ref.conservation is not None  # which path ran
        assert fast.input_relevance.dtype == ref.input_relevance.dtype == dtype
        scale = float(ref.input_relevance.abs().max())
        assert scale > 0
        diff = float((fast.input_relevance - ref.input_relevance).abs().max())
        assert diff < tol * scale, (eps, diff / scale)


@pytest.mark.parametrize("name", ["timm_vit_tiny", "hf_bert"])
def test_float64_model_gets_float64_relevance(name):
    """A bias-free float64 model: float64 scores, maps, input relevance, block records and
    conservation bookkeeping; per sample input + absorbed = injected to float64 rounding (< 1e-10,
    eps=0) under "chefer2021" and "attnlrp"; the fast path gives the interpreter's relevance."""
    make, inputs, target = CASES[name]
    model = models.zero_biases(make()).double()
    x = _cast(inputs(), torch.float64)
    for preset in ("chefer2021", "attnlrp"):
        e = relprop.explain(model, x, target=target, method="lrp", preset=preset, fast_path=False, eps=0.0)
        assert e.scores.dtype == e.input_relevance.dtype == torch.float64
        c = e.conservation
        assert c.injected.dtype == c.input.dtype == c.absorbed.dtype == torch.float64
        assert float(c.error.max()) < 1e-10, c
        assert all(float(b.error.max()) < 1e-10 for b in c.blocks), c.blocks
        if preset == "attnlrp":
            fast = relprop.explain(model, x, target=target, method="lrp", preset=preset, eps=0.0)
            assert fast.input_relevance.dtype == torch.float64
            scale = float(e.input_relevance.abs().max())
            assert float((fast.input_relevance - e.input_relevance).abs().max()) < 1e-12 * scale
    e = relprop.explain(model, x, target=target)  # transformer_attribution, default eps
    assert e.scores.dtype == torch.float64
    assert all(b.relevance.dtype == b.attention.dtype == b.gradient.dtype == torch.float64 for b in e.blocks)
    if e.map is not None:
        assert e.map.dtype == torch.float64
    assert float(e.conservation.error.max()) < 1e-6  # the default eps takes its small share


def test_float64_after_float32_recaptures():
    """Converting a model that was explained in float32 to float64 captures it again (a capture
    holds the casts and constants of the parameters' dtype) and gives float64 relevance."""
    model = models.hf_llama()
    x = models.decoder_batch()
    e32 = relprop.explain(model, x, target="next_token", method="lrp", preset="attnlrp")
    model.double()
    e64 = relprop.explain(model, x, target="next_token", method="lrp", preset="attnlrp")
    assert e32.input_relevance.dtype == torch.float32 and e64.input_relevance.dtype == torch.float64
    torch.testing.assert_close(e64.input_relevance.float(), e32.input_relevance, rtol=0,
                               atol=1e-4 * float(e32.input_relevance.abs().max()))


def test_float32_unchanged_by_promotion():
    """On a float32 model nothing is promoted: relevance, records and bookkeeping stay float32."""
    model = models.timm_vit_tiny()
    e = relprop.explain(copy.deepcopy(model), _images(64), target=1)
    assert e.scores.dtype == e.input_relevance.dtype == e.conservation.injected.dtype == torch.float32
    assert all(b.relevance.dtype == torch.float32 for b in e.blocks)
