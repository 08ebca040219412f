"""The ``"pa_lrp"`` preset (Bakish, Zimerman, Chefer & Wolf, NeurIPS 2025): AttnLRP with the relevance of
position encodings reassigned to the tokens.

* a tiny RoPE model written out here (embedding, rotary rotation, mean pooling, a linear head) against a
  reference that applies the definition by hand: ε-rule on the head, the pooling and the sum, uniform rule
  (R/2 each) on x ⊙ cos and rotate(x) ⊙ sin, the halves at cos and sin summed over the dimensions and
  given to the token at that position;
* a tiny HF ViT: pa_lrp's patch scores = attnlrp's + Σ_d P ⊙ R_h / h of the position embedding's addend
  (ε-rule, Eq. 8), with R_h the relevance entering the first block;
* conservation: under pa_lrp the input relevance plus what biases, the softmax's bias term and the class
  token absorb equals the explained score, with nothing absorbed by position encodings; under attnlrp the
  position embedding absorbs a share (ViT);
* batch invariance, the model untouched, and the refusal for a model without a position encoding.
"""
from __future__ import annotations

import pytest
import torch

import models
import relprop
from relprop import PositionPathError
from relprop.engine.position_relevance import LABEL

VOCAB, DIM, CLASSES = 40, 8, 3


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


class TinyRope(torch.nn.Module):
    """Token embedding, a causal running mean over tokens (so that the content path mixes tokens, as
    attention does), RoPE rotation (cos/sin computed from the positions), mean over tokens, linear head."""

    def __init__(self, rope=True):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.head = torch.nn.Linear(DIM, CLASSES, bias=False)
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, DIM, 2).float() / DIM)), persistent=False)
        self.rope = rope

    def angles(self, n):
        freqs = torch.arange(n, dtype=torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    @staticmethod
    def mixing(n, dtype=torch.float32):
        ones = torch.ones(n, n, dtype=dtype).tril()
        return ones / ones.sum(1, keepdim=True)

    def forward(self, input_ids):
        x = self.mixing(input_ids.shape[1], self.embed.weight.dtype) @ self.embed(input_ids)
        if self.rope:
            cos, sin = self.angles(input_ids.shape[1])
            x = x * cos + rotate_half(x) * sin
        return self.head(x.mean(1))


def div(num, den):
    return num / den.masked_fill(den == 0, 1) * (den != 0)


@torch.no_grad()
def rope_reference(model, ids, target):
    """PA-LRP of TinyRope from the definition, in float64 (ε = 0), and its content part alone."""
    e = model.embed.weight.double()[ids]  # [B, S, D]
    mix = model.mixing(ids.shape[1], torch.float64)
    x = mix @ e
    cos, sin = (t.double() for t in model.angles(ids.shape[1]))
    a, b = x * cos, rotate_half(x) * sin
    z = a + b
    m = z.mean(1)
    w = model.head.weight.double()
    y = m @ w.t()
    rows = torch.arange(ids.shape[0])
    r_y = torch.zeros_like(y)
    r_y[rows, target] = y[rows, target]  # seed: the target logit's value
    r_m = m * (div(r_y, y) @ w)  # ε-rule, linear head (Eq. 8)
    r_z = z * div(r_m, z.sum(1))[:, None, :]  # ε-rule on the sum over tokens
    r_a, r_b = a * div(r_z, z), b * div(r_z, z)  # ε-rule on a + b
    r_x = r_a / 2  # uniform rule (Prop. 3.2) on x ⊙ cos ...
    r_rot = r_b / 2  # ... and on rotate(x) ⊙ sin
    h = DIM // 2
    r_x = r_x + torch.cat((r_rot[..., h:], -(-r_rot[..., :h])), dim=-1)  # rotate_half's routing, back
    r_pos = (r_a / 2 + r_b / 2).sum(-1)  # the factors' halves, summed over the dimensions
    r_e = e * (mix.t() @ div(r_x, x))  # ε-rule on the constant mixing matrix (a linear map without bias)
    return r_e.sum(-1) + r_pos, r_e.sum(-1)


def ids_batch(batch=3, n=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (batch, n), generator=g)


def test_rope_reference():
    """pa_lrp on TinyRope equals the definition written out by hand (float64, ε = 0)."""
    model = TinyRope().double()
    ids = ids_batch()
    target = torch.tensor([0, 1, 2])
    e = relprop.explain(model, ids, target=target, method="lrp", preset="pa_lrp", eps=0.0)
    ref, content = rope_reference(model, ids, target)
    torch.testing.assert_close(e.scores.double(), ref, rtol=1e-9, atol=1e-12)
    assert float((ref - content).abs().max()) > 1e-3 * float(ref.abs().max())  # the position part is not nil
    a = relprop.explain(model, ids, target=target, method="lrp", preset="attnlrp", eps=0.0)
    assert not torch.allclose(a.scores.double(), ref)  # AttnLRP gives the content path everything


def test_rope_conservation_and_refusal():
    """Under pa_lrp the token relevance sums to the explained score (no bias anywhere: nothing absorbed);
    a model without a position encoding is refused, not explained as AttnLRP."""
    model = TinyRope().double()
    ids = ids_batch()
    e = relprop.explain(model, ids, target=[0, 1, 2], method="lrp", preset="pa_lrp", eps=0.0)
    c = e.conservation
    torch.testing.assert_close(e.scores.double().sum(1), c.injected.double(), rtol=1e-9, atol=1e-12)
    assert LABEL not in c.absorbed_by
    with pytest.raises(PositionPathError, match="no position encoding"):
        relprop.explain(TinyRope(rope=False), ids, target=0, method="lrp", preset="pa_lrp")


@pytest.fixture(scope="module")
def vit():
    return models.zero_biases(models.hf_vit("eager"))


def test_vit_reference(vit):
    """pa_lrp's patch scores = attnlrp's + the ε-share of the position embedding (Eq. 8), per patch token,
    computed here from the relevance R_h entering the first block (recorded under attnlrp)."""
    x = models.image_batch(vit, batch=2)
    a = relprop.explain(vit, x, target=[0, 1], method="lrp", preset="attnlrp", eps=0.0, fast_path=False,
                        keep_blocks=True)
    p = relprop.explain(vit, x, target=[0, 1], method="lrp", preset="pa_lrp", eps=0.0)
    pos = vit.vit.embeddings.position_embeddings.detach()  # [1, 1 + N, D]
    with torch.no_grad():
        h = vit.vit.embeddings(x)  # tokens + position embeddings
    r_h = a.blocks[0].hidden_relevance  # relevance of the hidden state entering block 0, [B, 1 + N, D]
    share = (pos * div(r_h, h)).sum(-1)[:, 1:]  # the class token's position share stays absorbed
    torch.testing.assert_close(p.scores, a.scores + share, rtol=1e-4, atol=1e-6)
    assert float(share.abs().max()) > 1e-3 * float(a.scores.abs().max())


def test_vit_conservation(vit):
    """Conservation, bias-free ViT: input + absorbed = injected under both presets; attnlrp books a share at
    the position embedding, pa_lrp none (only the class token's own position share)."""
    x = models.image_batch(vit, batch=2)
    a = relprop.explain(vit, x, target=[0, 1], method="lrp", preset="attnlrp", fast_path=False).conservation
    p = relprop.explain(vit, x, target=[0, 1], method="lrp", preset="pa_lrp").conservation
    for c in (a, p):
        assert float(c.error.max()) < 1e-4, c
    lost = a.absorbed_by["vit.embeddings.position_embeddings"]
    assert float(lost.abs().min()) > 0
    assert "vit.embeddings.position_embeddings" not in p.absorbed_by
    prefix = p.absorbed_by["position embeddings of the prefix tokens (class, ...)"]
    torch.testing.assert_close(p.input - a.input, lost - prefix, rtol=1e-4, atol=1e-7)


def test_batch_invariance_and_model_untouched(vit):
    """Each sample's pa_lrp scores do not depend on the rest of the batch; parameters are unchanged."""
    before = {k: v.clone() for k, v in vit.state_dict().items()}
    x = models.image_batch(vit, batch=3)
    both = relprop.explain(vit, x, target=[0, 1, 2], method="lrp", preset="pa_lrp").scores
    for i in range(3):
        one = relprop.explain(vit, x[i:i + 1], target=[i], method="lrp", preset="pa_lrp").scores
        torch.testing.assert_close(one[0], both[i], rtol=1e-4, atol=1e-7)
    after = vit.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before) and not vit.training
    model = TinyRope()
    ids = ids_batch()
    s = relprop.explain(model, ids, target=[0, 1, 2], method="lrp", preset="pa_lrp").scores
    s1 = relprop.explain(model, ids[1:2], target=[1], method="lrp", preset="pa_lrp").scores
    torch.testing.assert_close(s1[0], s[1], rtol=1e-4, atol=1e-7)


def test_llama_rope():
    """A tiny HF LLaMA: the rotary factors are found (a note says the walk ran), conservation as AttnLRP's."""
    lm = models.hf_llama("eager")
    ids = torch.randint(3, 50, (2, 6), generator=torch.Generator().manual_seed(0))
    e = relprop.explain(lm, ids, target=[5, 7], method="lrp", preset="pa_lrp")
    assert any("pa_lrp" in n and "walked rule by rule" in n for n in e.notes)
    c = e.conservation
    assert float(c.error.max()) < 1e-4, c
    a = relprop.explain(lm, ids, target=[5, 7], method="lrp", preset="attnlrp")
    assert not torch.equal(a.scores, e.scores)

