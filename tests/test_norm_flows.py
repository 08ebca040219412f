"""Norm-based flows (Kobayashi et al. 2020, Eq. 5-6; Kobayashi et al. 2021, Eq. 6-9): attention_norm
aggregated over heads and blocks, and attn_res_ln_norm (attention + residual + LayerNorm), each
checked against a slow float64 reference written from the formulas with loops over blocks, heads
and token pairs, on values read from the eager model itself (hooks), not from relprop's trace.
Tiny BERT (post-norm) and ViT (pre-norm) built from configs."""
import copy

import pytest
import torch

import models
import relprop


def vit_blocks(model, x):
    """Per block of a timm ViT: h (block input = the residual), A, V, W_O (float64)."""
    m = copy.deepcopy(model).double()
    for mod in m.modules():
        if hasattr(mod, "fused_attn"):
            mod.fused_attn = False
    rec = [dict() for _ in m.blocks]
    hooks = []
    for b, blk in enumerate(m.blocks):
        hooks += [blk.register_forward_pre_hook(lambda mod, a, b=b: rec[b].__setitem__("h", a[0].detach())),
                  blk.attn.attn_drop.register_forward_hook(lambda mod, a, o, b=b: rec[b].__setitem__("A", o.detach())),
                  blk.attn.qkv.register_forward_hook(lambda mod, a, o, b=b: rec[b].__setitem__("qkv", o.detach()))]
    with torch.no_grad():
        m(x.double())
    for h in hooks:
        h.remove()
    for r, blk in zip(rec, m.blocks):
        bsz, n, _ = r["qkv"].shape
        r["V"] = r.pop("qkv").reshape(bsz, n, 3, blk.attn.num_heads, -1)[:, :, 2].permute(0, 2, 1, 3)
        r["W_O"] = blk.attn.proj.weight.detach()
        r["ln"] = None  # pre-norm: no LayerNorm after the residual sum inside the block
    return rec


def bert_blocks(model, batch):
    """Per layer of an eager HF BERT: h, A, V, W_O, and the LayerNorm after attention + residual:
    its input z, gamma and eps (float64)."""
    m = copy.deepcopy(model).double()
    rec = [dict() for _ in m.bert.encoder.layer]
    hooks = [layer.attention.output.LayerNorm.register_forward_pre_hook(
        lambda mod, a, b=b: rec[b].__setitem__("z", a[0].detach())) for b, layer in enumerate(m.bert.encoder.layer)]
    with torch.no_grad():
        out = m(**batch, output_attentions=True, output_hidden_states=True)
    for h in hooks:
        h.remove()
    heads = m.config.num_attention_heads
    for b, (r, layer) in enumerate(zip(rec, m.bert.encoder.layer)):
        h = out.hidden_states[b].detach()
        bsz, n, _ = h.shape
        with torch.no_grad():
            r["V"] = layer.attention.self.value(h).reshape(bsz, n, heads, -1).permute(0, 2, 1, 3)
        r["h"], r["A"] = h, out.attentions[b].detach()
        r["W_O"] = layer.attention.output.dense.weight.detach()
        ln = layer.attention.output.LayerNorm
        r["ln"] = (ln.weight.detach(), ln.eps)
    return rec


def transformed(r, s):
    """f_h(x_j) = W_O^h v_h[j]: [heads][tokens] vectors."""
    heads, n, d = r["V"].shape[1:]
    return [[r["W_O"][:, h * d:(h + 1) * d] @ r["V"][s, h, j] for j in range(n)] for h in range(heads)]


def ref_norm(r, s, fusion="combined"):
    """Kobayashi 2020: N[i, j] = ||sum_h A[h,i,j] f_h(x_j)|| or fused per-head norms ||A[h,i,j] f_h(x_j)||."""
    f = transformed(r, s)
    heads, n = len(f), len(f[0])
    m = torch.zeros(n, n, dtype=torch.float64)
    for i in range(n):
        for j in range(n):
            if fusion == "combined":
                m[i, j] = torch.linalg.norm(sum(r["A"][s, h, i, j] * f[h][j] for h in range(heads)))
            else:
                per = [float(torch.linalg.norm(r["A"][s, h, i, j] * f[h][j])) for h in range(heads)]
                m[i, j] = {"mean": sum(per) / heads, "max": max(per), "min": min(per)}[fusion]
    return m


def ref_res_ln(r, s):
    """Kobayashi 2021: N[i, j] = ||g_{z_i}(sum_h A[h,i,j] f_h(x_j) + [i == j] h_j)||,
    g_z(u) = gamma * (u - mean(u)) / sqrt(var(z) + eps) (no g in pre-norm blocks)."""
    f = transformed(r, s)
    heads, n = len(f), len(f[0])
    m = torch.zeros(n, n, dtype=torch.float64)
    for i in range(n):
        for j in range(n):
            u = sum(r["A"][s, h, i, j] * f[h][j] for h in range(heads))
            if i == j:
                u = u + r["h"][s, j]
            if r["ln"] is not None:
                gamma, eps = r["ln"]
                z = r["z"][s, i]
                u = gamma * (u - u.mean()) / torch.sqrt(z.var(unbiased=False) + eps)
            m[i, j] = torch.linalg.norm(u)
    return m


def rownorm(m):
    return torch.stack([row / row.sum() for row in m])


def rollout(maps, identity):
    n = maps[0].shape[0]
    joint = torch.eye(n, dtype=torch.float64)
    for m in maps:
        a = rownorm(m)
        if identity:
            a = rownorm(a + torch.eye(n, dtype=torch.float64))
        joint = a @ joint
    return joint


def _close(got, ref, rtol=1e-4):
    err = float((got.double() - ref).abs().max())
    assert err <= rtol * float(ref.abs().max()) + 1e-12, (err, float(ref.abs().max()))


@pytest.fixture(scope="module")
def vit():
    model = models.timm_vit_tiny()
    x = models.image_batch(model, batch=2, seed=1)
    return model, x, vit_blocks(model, x)


@pytest.fixture(scope="module")
def bert():
    model = models.hf_bert()
    batch = models.text_batch((6, 6))
    return model, batch, bert_blocks(model, batch)


def test_residual_decomposition_sums_to_the_layernorm_input(bert):
    """Kobayashi 2021 Eq. 8 holds on the hooked values: sum_j F_i(x_j) + b_O = z_i (the decomposition
    is exact), so the reference's pieces are the model's."""
    model, batch, rec = bert
    layer = model.bert.encoder.layer[0]
    r = rec[0]
    f = transformed(r, 0)
    heads, n = len(f), len(f[0])
    b_o = layer.attention.output.dense.bias.detach().double()
    for i in range(n):
        total = sum(sum(r["A"][0, h, i, j] * f[h][j] for h in range(heads)) for j in range(n)) + r["h"][0, i] + b_o
        assert torch.allclose(total, r["z"][0, i], atol=1e-8)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["vit", "bert"])
def test_attn_res_ln_norm_matches_reference(family, vit, bert):
    model, x, rec = vit if family == "vit" else bert
    e = relprop.explain(model, x, target=1, method="attn_res_ln_norm")
    for s in range(2):
        maps = [ref_res_ln(r, s) for r in rec]
        ref = rollout(maps, identity=False)
        _close(e.matrix[s], ref)
        row = ref[0, e.prefix_tokens:]
        _close(e.scores[s][e.mask[s]] if e.mask is not None else e.scores[s], row[e.mask[s]] if e.mask is not None
               else row)
    last = relprop.explain(model, x, target=1, method="attn_res_ln_norm", layers="last")
    _close(last.matrix[0], ref_res_ln(rec[-1], 0))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["vit", "bert"])
def test_attention_norm_rollout_and_head_fusion_match_reference(family, vit, bert):
    model, x, rec = vit if family == "vit" else bert
    e = relprop.explain(model, x, target=1, method="attention_norm", layers="rollout")
    ref = rollout([ref_norm(r, 0) for r in rec], identity=True)
    _close(e.matrix[0], ref)
    for fusion in ("mean", "max", "min"):
        e = relprop.explain(model, x, target=1, method="attention_norm", head_fusion=fusion)
        _close(e.matrix[0], ref_norm(rec[-1], 0, fusion))
    e = relprop.explain(model, x, target=1, method="attention_norm", layers="sum")
    _close(e.matrix[0], sum(ref_norm(r, 0) for r in rec))


def test_norm_flow_options(vit):
    model, x, _ = vit
    with pytest.raises(relprop.OptionError, match=r"Choices: \['combined'\]"):
        relprop.explain(model, x, method="attn_res_ln_norm", head_fusion="max")
    with pytest.raises(relprop.OptionError, match=r"Choices: \['combined', 'mean', 'max', 'min', 'gradient'\]"):
        relprop.explain(model, x, method="attention_norm", head_fusion="sum")
    with pytest.raises(relprop.OptionError, match="not both"):
        relprop.explain(model, x, method="attention_norm", block=0, end_block=1)
    info = relprop.methods()["attn_res_ln_norm"]
    assert not info["class_specific"] and "2021" in info["reference"]


def test_layer_scale_is_a_factor_of_the_attention_part():
    """DINOv2-style LayerScale (x + gamma * attn(norm1(x))): N[i, j] = ||gamma * sum_h A f_h(x_j) + [i == j] h_j||,
    checked with loops on the last block's hooked values."""
    model = models.timm_dinov2_reg4()
    x = models.image_batch(model, batch=1, seed=3)[:, :, :56, :56]
    e = relprop.explain(model, x, method="attn_res_ln_norm", layers="last")
    rec = vit_blocks(model, x)[-1]
    gamma = model.blocks[-1].ls1.gamma.detach().double()
    f = transformed(rec, 0)
    heads, n = len(f), len(f[0])
    ref = torch.zeros(n, n, dtype=torch.float64)
    for i in range(n):
        for j in range(n):
            u = gamma * sum(rec["A"][0, h, i, j] * f[h][j] for h in range(heads))
            ref[i, j] = torch.linalg.norm(u + (rec["h"][0, j] if i == j else 0.0))
    _close(e.matrix[0], ref)
