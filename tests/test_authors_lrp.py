"""``lrp`` and ``partial_lrp`` under the ``"lrp"`` preset equal the authors' LRP-baseline pass,
reimplemented here from scratch.

The reference below re-runs the forward pass of a tiny timm ViT and a tiny HF BERT from their
weights, then walks back with the formulas of the authors' baseline code
(hila-chefer/Transformer-Explainability at c3e578f: ``modules/layers_lrp.py``,
``baselines/ViT/ViT_orig_LRP.py``, ``BERT_explainability/modules/BERT/BERT_orig_lrp.py``), written
out with plain tensor ops and never calling relprop's rules:

* linear layers: x⁺W⁺ / z⁺ and x⁻W⁻ / z⁻, each part with its own denominator, bias ignored
  (``layers_lrp.Linear`` with alpha=1);
* sums (residuals, the position embedding, the attention mask): the z-rule, not normalized
  (``layers_lrp.Add``);
* the attention products A·V and Q·Kᵀ: the z-rule on each operand, both shares halved (``cam /= 2``
  in ``Attention.relprop``); R_A is read after the halving;
* LayerNorm, GELU, tanh, softmax, dropout, scaling: relevance passed on unchanged;
* the patch embedding: z^B with the per-image minimum and maximum as bounds (``layers_lrp.Conv2d``
  on 3 channels);
* the relevance seed: one-hot at the target class.

The authors' stabilizer adds 1e-9 to every denominator, also where they route relevance (Clone,
IndexSelect); relprop pushes ε away from 0 only in its rules. To compare rules rather than the
place of ε, both run in float64 with ε = 0 (the reference divides exactly, 0 where a denominator
is 0): they agree to float64 rounding. ``benchmarks/authors_reference.py`` runs the authors' own
code and measures what ε and float32 change.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import models
import relprop


def div(num, den):
    """num / den, 0 where den == 0 (the authors' safe_divide without its 1e-9)."""
    return num / den.masked_fill(den == 0, 1) * (den != 0)


def lrp_linear(x, weight, r):
    """layers_lrp.Linear (alpha=1): R_x for y = x Wᵀ (+ b ignored), separate denominators per sign."""
    xp, xn = x.clamp(min=0), x.clamp(max=0)
    wp, wn = weight.clamp(min=0), weight.clamp(max=0)
    return xp * (div(r, xp @ wp.t()) @ wp) + xn * (div(r, xn @ wn.t()) @ wn)


def z_sum(u, v, r):
    """layers_lrp.Add: z-rule shares of u + v."""
    s = div(r, u + v)
    return u * s, v * s


def z_product(a, b, r):
    """z-rule shares of a @ b (each share alone carries all of r), both halved as the authors' code does."""
    s = div(r, a @ b)
    return a * (s @ b.transpose(-1, -2)) / 2, b * (a.transpose(-1, -2) @ s) / 2


def z_box(x, weight, stride, r):
    """layers_lrp.Conv2d on pixels: z^B with per-image bounds l = min x, h = max x (bias ignored)."""
    low = x.amin(dim=(1, 2, 3), keepdim=True).expand_as(x)
    high = x.amax(dim=(1, 2, 3), keepdim=True).expand_as(x)
    wp, wn = weight.clamp(min=0), weight.clamp(max=0)
    xs = [t.detach().requires_grad_(True) for t in (x, low, high)]
    z = F.conv2d(xs[0], weight, stride=stride) - F.conv2d(xs[1], wp, stride=stride) - F.conv2d(xs[2], wn, stride=stride)
    gx, gl, gh = torch.autograd.grad(z, xs, div(r, z.detach()))
    return x * gx + low * gl + high * gh  # gl, gh already carry the minus signs


def heads(t, h):
    b, n, d = t.shape
    return t.reshape(b, n, h, d // h).transpose(1, 2)


def merge(t):
    b, h, n, d = t.shape
    return t.transpose(1, 2).reshape(b, n, h * d)


# ------------------------------------------------------------------ ViT (ViT_orig_LRP.relprop)
def vit_reference(model, x, targets):
    """(pixel relevance [B, H, W], R_A of every block) by the authors' baseline pass."""
    pe = model.patch_embed.proj
    tokens = F.conv2d(x, pe.weight, pe.bias, stride=pe.stride).flatten(2).transpose(1, 2)
    h = torch.cat([model.cls_token.expand(len(x), -1, -1), tokens], 1)
    h0, pos = h, model.pos_embed
    h = h + pos
    saved = []
    for blk in model.blocks:
        at = blk.attn
        n1 = blk.norm1(h)
        q, k, v = heads(F.linear(n1, at.qkv.weight, at.qkv.bias), at.num_heads * 3).chunk(3, dim=1)
        a = torch.softmax(q @ k.transpose(-1, -2) * at.scale, -1)
        ctx = merge(a @ v)
        h1 = h + F.linear(ctx, at.proj.weight, at.proj.bias)
        n2 = blk.norm2(h1)
        f1 = F.linear(n2, blk.mlp.fc1.weight, blk.mlp.fc1.bias)
        h2 = h1 + F.linear(F.gelu(f1), blk.mlp.fc2.weight, blk.mlp.fc2.bias)
        saved.append((h, n1, q, k, v, a, ctx, h1, n2, f1, h2))
        h = h2
    last = model.norm(h)
    logits = F.linear(last[:, 0], model.head.weight, model.head.bias)
    torch.testing.assert_close(logits, model(x), rtol=1e-9, atol=1e-9)  # the forward pass is the model's

    r = lrp_linear(last[:, 0], model.head.weight, F.one_hot(torch.tensor(targets), logits.shape[-1]).to(x.dtype))
    rh = torch.zeros_like(last)
    rh[:, 0] = r  # IndexSelect of the class token; the final LayerNorm passes R on
    r_attn = []
    for blk, (hin, n1, q, k, v, a, ctx, h1, n2, f1, h2) in zip(reversed(model.blocks), reversed(saved)):
        at = blk.attn
        r_res, r_mlp = z_sum(h1, h2 - h1, rh)
        r_mlp = lrp_linear(F.gelu(f1), blk.mlp.fc2.weight, r_mlp)
        r_mlp = lrp_linear(n2, blk.mlp.fc1.weight, r_mlp)  # GELU and norm2 pass R on
        rh = r_res + r_mlp  # Clone
        r_res, r_att = z_sum(hin, h1 - hin, rh)
        r_ctx = heads(lrp_linear(ctx, at.proj.weight, r_att), at.num_heads)
        r_a, r_v = z_product(a, v, r_ctx)
        r_attn.append(r_a)
        r_q, r_kt = z_product(q, k.transpose(-1, -2), r_a)  # softmax and the scale pass R on
        r_qkv = torch.cat([merge(r_q), merge(r_kt.transpose(-1, -2)), merge(r_v)], -1)
        rh = r_res + lrp_linear(n1, at.qkv.weight, r_qkv)
    r_tokens, _ = z_sum(h0, pos.expand_as(h0), rh)  # the position embedding keeps its share
    g = model.patch_embed.grid_size
    r_grid = r_tokens[:, 1:].transpose(1, 2).reshape(len(x), -1, *g)
    return z_box(x, pe.weight, pe.stride, r_grid).sum(1), r_attn[::-1]


def _vit_case(n):
    model = models.timm_vit_tiny().double()
    x = models.image_batch(model, batch=n, seed=4).double()
    targets = list(range(n))
    lrp, partial = relprop.explain(model, x, method=["lrp", "partial_lrp"], target=targets, eps=0.0,
                                   fast_path=False, preset="lrp")  # the paper's plain-LRP rules
    return model, x, targets, lrp, partial


def _close(got, want):
    scale = want.abs().max()
    assert scale > 0
    torch.testing.assert_close(got / scale, want / scale, rtol=0, atol=1e-9)


def test_vit_lrp_and_partial_lrp_equal_the_authors_baseline_pass():
    model, x, targets, lrp, partial = _vit_case(1)
    pixels, r_attn = vit_reference(model, x, targets)
    _close(lrp.input_relevance.sum(1), pixels)
    for block, r_a in zip(lrp.blocks, r_attn):
        _close(block.relevance, r_a)
    m = r_attn[-1].clamp(min=0).mean(1)  # partial LRP: E_h (R_A)⁺ of the last block, class-token row
    _close(partial.matrix, m)
    _close(partial.scores, m[:, 0, 1:])


@pytest.mark.slow
def test_vit_lrp_batch_equals_the_authors_baseline_pass():
    model, x, targets, lrp, partial = _vit_case(3)
    pixels, r_attn = vit_reference(model, x, targets)
    _close(lrp.input_relevance.sum(1), pixels)
    _close(partial.scores, r_attn[-1].clamp(min=0).mean(1)[:, 0, 1:])


# ------------------------------------------------------------------ BERT (BERT_orig_lrp.relprop)
def bert_reference(model, ids, mask, targets):
    """(relevance entering the encoder [B, N, hidden], at the word embeddings [B, N, hidden], R_A of
    every layer) by the authors' baseline pass; the word-embedding step is relprop's extension."""
    bert = model.bert
    emb = bert.embeddings
    word = emb.word_embeddings(ids)
    rest = emb.token_type_embeddings(torch.zeros_like(ids)) + emb.position_embeddings(
        torch.arange(ids.shape[1]))[None]
    h = emb.LayerNorm(word + rest)
    h_enc = h
    additive = (1 - mask[:, None, None, :].to(h.dtype)) * torch.finfo(h.dtype).min
    saved = []
    for layer in bert.encoder.layer:
        sa, so = layer.attention.self, layer.attention.output
        nh = sa.num_attention_heads
        q, k, v = (heads(F.linear(h, m.weight, m.bias), nh) for m in (sa.query, sa.key, sa.value))
        scores = q @ k.transpose(-1, -2) * sa.scaling
        a = torch.softmax(scores + additive, -1)
        ctx = merge(a @ v)
        d1 = F.linear(ctx, so.dense.weight, so.dense.bias)
        ao = so.LayerNorm(d1 + h)
        f1 = F.linear(ao, layer.intermediate.dense.weight, layer.intermediate.dense.bias)
        d2 = F.linear(F.gelu(f1), layer.output.dense.weight, layer.output.dense.bias)
        out = layer.output.LayerNorm(d2 + ao)
        saved.append((h, q, k, v, scores, additive, a, ctx, d1, ao, f1, d2))
        h = out
    pooled = torch.tanh(F.linear(h[:, 0], bert.pooler.dense.weight, bert.pooler.dense.bias))
    logits = F.linear(pooled, model.classifier.weight, model.classifier.bias)
    torch.testing.assert_close(logits, model(input_ids=ids, attention_mask=mask).logits, rtol=1e-9, atol=1e-9)

    r = F.one_hot(torch.tensor(targets), logits.shape[-1]).to(h.dtype)
    r = lrp_linear(pooled, model.classifier.weight, r)  # dropout and tanh pass R on
    r = lrp_linear(h[:, 0], bert.pooler.dense.weight, r)
    rh = torch.zeros_like(h)
    rh[:, 0] = r
    r_attn = []
    for layer, (hin, q, k, v, scores, additive, a, ctx, d1, ao, f1, d2) in zip(reversed(bert.encoder.layer),
                                                                                reversed(saved)):
        sa, so = layer.attention.self, layer.attention.output
        nh = sa.num_attention_heads
        r_d2, r_ao = z_sum(d2, ao, rh)  # output LayerNorm passes R on
        r_f = lrp_linear(F.gelu(f1), layer.output.dense.weight, r_d2)
        r_ao = r_ao + lrp_linear(ao, layer.intermediate.dense.weight, r_f)  # Clone
        r_d1, r_h = z_sum(d1, hin, r_ao)  # attention-output LayerNorm passes R on
        r_ctx = heads(lrp_linear(ctx, so.dense.weight, r_d1), nh)
        r_a, r_v = z_product(a, v, r_ctx)
        r_attn.append(r_a)
        r_scores, _ = z_sum(scores, additive.expand_as(scores), r_a)  # softmax passes R on; the mask's share
        r_q, r_kt = z_product(q, k.transpose(-1, -2), r_scores)
        for lin, rr in ((sa.query, r_q), (sa.key, r_kt.transpose(-1, -2)), (sa.value, r_v)):
            r_h = r_h + lrp_linear(hin, lin.weight, merge(rr))
        rh = r_h
    r_word, _ = z_sum(word, rest, rh)  # relprop goes on through the embedding LayerNorm and sums
    return rh, r_word, r_attn[::-1], h_enc


def _bert_case(lengths):
    model = models.hf_bert("eager").double()
    batch = models.text_batch(lengths)
    targets = [i % 3 for i in range(len(lengths))]
    lrp, partial = relprop.explain(model, batch, method=["lrp", "partial_lrp"], target=targets, eps=0.0,
                                   fast_path=False, preset="lrp")  # the paper's plain-LRP rules
    return model, batch, targets, lrp, partial


@pytest.mark.parametrize("lengths", [(7,), pytest.param((7, 5, 9, 3), marks=pytest.mark.slow)],
                         ids=["one text", "padded batch"])
def test_bert_lrp_and_partial_lrp_equal_the_authors_baseline_pass(lengths):
    model, batch, targets, lrp, partial = _bert_case(lengths)
    r_enc, r_word, r_attn, _ = bert_reference(model, batch["input_ids"], batch["attention_mask"], targets)
    # the authors' BertModel.relprop stops at the encoder input: relprop records it as blocks[0].hidden_relevance
    _close(lrp.blocks[0].hidden_relevance, r_enc)
    _close(lrp.input_relevance, r_word.sum(-1))
    for block, r_a in zip(lrp.blocks, r_attn):
        _close(block.relevance, r_a)
    _close(partial.matrix, r_attn[-1].clamp(min=0).mean(1))


def test_float64_models_are_explained_in_float64():
    model, _, _, lrp, partial = _vit_case(1)
    assert lrp.input_relevance.dtype == torch.float64
    assert lrp.blocks[-1].relevance.dtype == torch.float64
