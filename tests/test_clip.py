"""CLIP (HuggingFace ``CLIPModel``), unmodified: the image tower (``wrt="pixel_values"``) and the
text tower (``wrt="input_ids"``, the default) explained for an image-text similarity target
. Tiny random towers: 32x32 images in 4x4 patches of 8, texts of 4-8 tokens."""

import pytest
import torch

import models
import relprop
from relprop.rules.linear import alpha1_beta0
from snapshot import assert_same, snapshot

IMAGE_METHODS = ["transformer_attribution", "rollout", "gradient_rollout", "raw_attention", "lrp", "attention_gradcam",
                 "input_x_gradient"]
TEXT_METHODS = ["transformer_attribution", "rollout", "gradient_rollout", "raw_attention", "lrp", "grads", "cat"]


@pytest.fixture(scope="module")
def clip():
    return models.hf_clip()


def similarity_to_text(j):
    return lambda o: o.logits_per_image[:, j]


def similarity_to_image(i):
    return lambda o: o.logits_per_text[:, i]


# ------------------------------------------------------------------ image tower

def test_image_tower_methods_and_conservation(clip):
    batch = models.clip_batch(images=2)
    exps = relprop.explain(clip, batch, target=similarity_to_text(1), method=IMAGE_METHODS, wrt="pixel_values")
    for e in exps:
        assert e.modality == "vision" and e.scores.shape == (2, 16) and e.map.shape == (2, 32, 32), e.method
        assert torch.isfinite(e.scores).all(), e.method
    c = exps[0].conservation
    assert torch.allclose(c.injected, torch.ones(2))  # seeded once, at the similarity (not at the embeddings too)
    assert float(c.error.max()) < 1e-4, c
    assert "vision_model.embeddings.class_embedding" in " ".join(c.absorbed_by) or \
        any("class_embedding" in k for k in c.absorbed_by)


def test_image_tower_int_target_is_the_similarity_to_that_text(clip):
    batch = models.clip_batch(images=2)
    a = relprop.explain(clip, batch, target=2, wrt="pixel_values")
    b = relprop.explain(clip, batch, target=similarity_to_text(2), wrt="pixel_values")
    assert torch.allclose(a.scores, b.scores) and torch.equal(a.target, torch.tensor([2, 2]))


def test_image_tower_text_specific(clip):
    batch = models.clip_batch(images=2)
    a, b = (relprop.explain(clip, batch, target=similarity_to_text(j), wrt="pixel_values", method=m).scores
            for j in (0, 1) for m in ["transformer_attribution"])
    assert (a - b).abs().max() > 1e-4


def test_image_tower_batch_invariance(clip):
    """Three images against the same texts explain like each image alone (< 1e-5)."""
    batch = models.clip_batch(images=3, seed=2)
    full = relprop.explain(clip, batch, target=similarity_to_text(0), wrt="pixel_values")
    for i in range(3):
        one = {**batch, "pixel_values": batch["pixel_values"][i:i + 1]}
        alone = relprop.explain(clip, one, target=similarity_to_text(0), wrt="pixel_values")
        assert (full.scores[i] - alone.scores[0]).abs().max() < 1e-5
        assert (full.conservation.input[i] - alone.conservation.input[0]).abs() < 1e-5


# ------------------------------------------------------------------ text tower

def test_text_tower_methods_and_conservation(clip):
    batch = models.clip_batch(images=2)
    exps = relprop.explain(clip, batch, target=similarity_to_image(0), method=TEXT_METHODS)
    n = batch["input_ids"].shape[1]
    for e in exps:
        assert e.modality == "text" and e.scores.shape == (3, n), e.method
        assert torch.isfinite(e.scores).all(), e.method
        assert (e.scores[batch["attention_mask"] == 0] == 0).all(), e.method  # padding scores nothing
    c = exps[0].conservation
    assert torch.allclose(c.injected, torch.ones(3))
    assert float(c.error.max()) < 1e-4, c


def test_text_tower_query_is_the_pooled_eos_token(clip):
    """The text tower pools the EOS token (argmax of ids == eos): the causal mask makes it the only
    row of the last block that reaches the output, and the methods read that row."""
    batch = models.clip_batch(images=2)
    e = relprop.explain(clip, batch, target=similarity_to_image(1), method="raw_attention")
    eos = (batch["input_ids"] == models.CLIP_EOS).int().argmax(-1)
    last = e.blocks[-1].attention.mean(1)  # [texts, tokens, tokens]
    ref = last[torch.arange(3), eos]
    keep = e.mask
    assert torch.allclose(e.scores[keep], ref[keep], atol=1e-6)
    grad_rows = (e.blocks[-1].gradient != 0).any(1).any(-1)  # rows the target depends on
    assert torch.equal(grad_rows.float().argmax(-1), eos) and int(grad_rows.sum()) == 3


def test_text_tower_padding_batch_invariance(clip):
    """Texts of different lengths, right-padded, explain like each text alone (< 1e-5)."""
    lengths = (6, 4, 8)
    batch = models.clip_batch(images=2, lengths=lengths, seed=3)
    full = relprop.explain(clip, batch, target=similarity_to_image(0), method=["transformer_attribution", "lrp"])
    for i, n in enumerate(lengths):
        one = {"input_ids": batch["input_ids"][i:i + 1, :n], "attention_mask": batch["attention_mask"][i:i + 1, :n],
               "pixel_values": batch["pixel_values"]}
        alone = relprop.explain(clip, one, target=similarity_to_image(0), method=["transformer_attribution", "lrp"])
        for f, a in zip(full, alone):
            # the "lrp" preset's linear rule (the authors' LRP baseline) divides by x⁻W⁻ alone, which can be
            # near 0: float32 rounding of the batch's matmuls grows to ~2e-5 of the scores' scale there
            tol = 1e-5 if f.method != "lrp" else 1e-4 * float(a.scores.abs().max())
            assert (f.scores[i, :n] - a.scores[0]).abs().max() < tol, f.method
            assert (f.scores[i, n:] == 0).all()


def test_text_tower_image_specific(clip):
    batch = models.clip_batch(images=2)
    a, b = (relprop.explain(clip, batch, target=similarity_to_image(i), method="lrp").scores for i in (0, 1))
    assert (a - b).abs().max() > 1e-4


# ------------------------------------------------------------------ errors and the model

def test_int_target_on_text_tower_is_the_similarity_to_that_image(clip):
    """On the text tower, target=i reads logits_per_text[:, i] (the similarity with image i)."""
    batch = models.clip_batch(images=2)
    a = relprop.explain(clip, batch, target=1, method="lrp")
    b = relprop.explain(clip, batch, target=similarity_to_image(1), method="lrp")
    assert torch.allclose(a.scores, b.scores) and torch.equal(a.target, torch.tensor([1, 1, 1]))
    with pytest.raises(relprop.TargetError, match="out of range"):
        relprop.explain(clip, batch, target=2)  # there are 2 images


def test_unknown_wrt_is_an_error(clip):
    with pytest.raises(relprop.InputError, match="wrt='pixels'.*choices.*pixel_values"):
        relprop.explain(clip, models.clip_batch(), target=0, wrt="pixels")


def test_model_untouched(clip):
    before = snapshot(clip)
    relprop.explain(clip, models.clip_batch(), target=similarity_to_text(0), wrt="pixel_values",
                    method=["transformer_attribution", "lrp"])
    with pytest.raises(relprop.TargetError):
        relprop.explain(clip, models.clip_batch(), target=7)
    assert_same(before, snapshot(clip))


# ------------------------------------------------------------------ quick_gelu, from its definition

class QuickGeluMLP(torch.nn.Module):
    """fc1 → x·sigmoid(1.702x) (CLIP's quick_gelu, as HF writes it) → fc2."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = torch.nn.Linear(6, 8), torch.nn.Linear(8, 3)

    def forward(self, inputs_embeds):
        h = self.fc1(inputs_embeds)
        return self.fc2(h * torch.sigmoid(1.702 * h))


def test_quick_gelu_passes_relevance_like_gelu():
    """The paper treats GELU as the identity for relevance (CVPR 2021, §3.2 / its code): the captured
    x·sigmoid(1.702x) (a product of two live factors, each halved, Lemma 1) must give the same:
    R = α1β0(fc1) ∘ identity ∘ α1β0(fc2) applied to the one-hot seed."""
    model = QuickGeluMLP().eval()
    x = torch.randn(2, 4, 6)
    e = relprop.explain(model, {"inputs_embeds": x}, target=lambda o: o[:, 0, 1] + o[:, 2, 0], method="lrp",
                        preset="chefer2021")
    with torch.no_grad():
        h = model.fc1(x)
        a = h * torch.sigmoid(1.702 * h)
        seed = torch.zeros(2, 4, 3)
        seed[:, 0, 1], seed[:, 2, 0] = 1, 1
        r_a = alpha1_beta0(a, model.fc2.weight.t(), seed, 1e-9)
        r_x = alpha1_beta0(x, model.fc1.weight.t(), r_a, 1e-9)
    assert torch.allclose(e.input_relevance, r_x, atol=1e-6)
    assert float(e.conservation.error.max()) < 1e-5


@pytest.mark.parametrize("wrt", ["pixel_values", "input_ids"])
@pytest.mark.parametrize("preset", ["chefer2021", "lrp"])
def test_every_op_on_the_relevance_path_has_a_rule(clip, wrt, preset):
    """No op of either tower's captured graph lacks a rule (what the coverage report calls 'missing')."""
    from relprop.graph.capture import CACHE
    from relprop.engine.walk import check_rules
    from relprop.graph.inputs import bind_inputs
    captured = CACHE.get(clip, bind_inputs(clip, models.clip_batch()), wrt)
    assert captured.primary == wrt
    check_rules(captured, preset, "error")
