"""cat, attcat, grads, attgrads (AttCAT paper, Grad-SAM), attention_norm (Kobayashi et al. 2020) and
gradcam on token features: each checked against a slow float64 reference written from its formula,
on attention maps, hidden states, values and gradients read from the eager model itself (hooks /
output_attentions), not from relprop's trace."""
import copy
import dataclasses

import pytest
import torch

import models
import relprop
from relprop.graph.capture import CACHE
from relprop.graph.inputs import bind_inputs
from relprop.engine import Request, Schedule, execute
from relprop.methods import get_method
from relprop.targets import Target, resolve

METHODS = ["cat", "attcat", "grads", "attgrads", "attention_norm", "gradcam"]


# ------------------------------------------------------------------ what the eager models compute

def _grads(score, tensors):
    """d score / d tensors without touching the parameters' .grad."""
    return torch.autograd.grad(score, tensors, allow_unused=False)


def vit_records(model, x, target):
    """Per block of a timm ViT (explicit attention): A, dA, h, dh, F = norm1(h), dF, V, W_O (float64)."""
    m = copy.deepcopy(model)
    for mod in m.modules():
        if hasattr(mod, "fused_attn"):
            mod.fused_attn = False
    rec = [dict() for _ in m.blocks]
    hooks = []
    for b, blk in enumerate(m.blocks):
        hooks += [
            blk.register_forward_pre_hook(lambda mod, a, b=b: rec[b].__setitem__("h", a[0])),
            blk.norm1.register_forward_hook(lambda mod, a, o, b=b: rec[b].__setitem__("F", o)),
            blk.attn.attn_drop.register_forward_hook(lambda mod, a, o, b=b: rec[b].__setitem__("A", o)),
            blk.attn.qkv.register_forward_hook(lambda mod, a, o, b=b: rec[b].__setitem__("qkv", o)),
        ]
    try:
        out = m(x)
    finally:
        for h in hooks:
            h.remove()
    keys = ["h", "F", "A"]
    g = _grads(out[:, target].sum(), [r[k] for r in rec for k in keys])
    for b, (r, blk) in enumerate(zip(rec, m.blocks)):
        for k, gk in zip(keys, g[3 * b:3 * b + 3]):
            r["d" + k] = gk.double()
            r[k] = r[k].detach().double()
        bsz, n, _ = r["qkv"].shape
        heads = blk.attn.num_heads
        r["V"] = r.pop("qkv").detach().double().reshape(bsz, n, 3, heads, -1)[:, :, 2].permute(0, 2, 1, 3)
        r["W_O"] = blk.attn.proj.weight.detach().double()
    return rec


def bert_records(model, batch, target):
    """Per layer of an eager HF BERT: A, dA, h (= F, post-norm), dh (= dF), V, W_O (float64)."""
    out = model(**batch, output_attentions=True, output_hidden_states=True)
    hs, att = out.hidden_states[:-1], out.attentions
    g = _grads(out.logits[:, target].sum(), list(hs) + list(att))
    rec = []
    for b, layer in enumerate(model.bert.encoder.layer):
        h = hs[b]
        bsz, n, _ = h.shape
        heads = model.config.num_attention_heads
        v = layer.attention.self.value(h).detach().double().reshape(bsz, n, heads, -1).permute(0, 2, 1, 3)
        r = {"h": h.detach().double(), "dh": g[b].double(), "A": att[b].detach().double(),
             "dA": g[len(hs) + b].double(), "V": v, "W_O": layer.attention.output.dense.weight.detach().double()}
        r["F"], r["dF"] = r["h"], r["dh"]
        rec.append(r)
    return rec


# ------------------------------------------------------------- the formulas, one sample at a time

def ref_cat(rec, s):
    n = rec[0]["h"].shape[1]
    out = torch.zeros(n, dtype=torch.float64)
    for r in rec:
        for i in range(n):
            out[i] += (r["dh"][s, i] * r["h"][s, i]).sum()
    return out


def ref_attcat(rec, s, valid, attention="received"):
    """Eq. 11-12; 'received': alpha_i = mean over heads and over the valid query rows of A[h, q, i]."""
    n = rec[0]["h"].shape[1]
    rows = [q for q in range(n) if valid[q]]
    out = torch.zeros(n, dtype=torch.float64)
    for r in rec:
        heads = r["A"].shape[1]
        for i in range(n):
            cat_i = (r["dh"][s, i] * r["h"][s, i]).sum()
            alpha = 0.0
            for h in range(heads):
                if attention == "received":
                    alpha += sum(r["A"][s, h, q, i] for q in rows) / len(rows) / heads
                else:
                    alpha += r["A"][s, h, 0, i] / heads
            out[i] += cat_i * alpha
    return out


def ref_grads(rec, s):
    r = rec[-1]
    heads, n = r["dA"].shape[1], r["dA"].shape[-1]
    m = torch.zeros(n, n, dtype=torch.float64)
    for h in range(heads):
        for i in range(n):
            for j in range(n):
                m[i, j] += r["dA"][s, h, i, j] / heads
    return m, m[0]


def ref_attgrads(rec, s, token_scores="rows"):
    """Grad-SAM: M = mean over blocks and heads of A * relu(dA); token i = sum of row i (or the CLS row)."""
    n = rec[0]["A"].shape[-1]
    m = torch.zeros(n, n, dtype=torch.float64)
    for r in rec:
        heads = r["A"].shape[1]
        for h in range(heads):
            for i in range(n):
                for j in range(n):
                    m[i, j] += r["A"][s, h, i, j] * max(float(r["dA"][s, h, i, j]), 0.0) / (heads * len(rec))
    scores = torch.stack([sum(m[i, j] for j in range(n)) for i in range(n)]) if token_scores == "rows" else m[0]
    return m, scores


def ref_attention_norm(rec, s):
    """N[i, j] = || sum_h A[h, i, j] W_O[:, h*d:(h+1)*d] v_h[j] ||."""
    r = rec[-1]
    heads, n, d = r["V"].shape[1], r["V"].shape[2], r["V"].shape[3]
    f = [[r["W_O"][:, h * d:(h + 1) * d] @ r["V"][s, h, j] for j in range(n)] for h in range(heads)]  # f_h(x_j)
    m = torch.zeros(n, n, dtype=torch.float64)
    for i in range(n):
        for j in range(n):
            vec = torch.zeros(r["W_O"].shape[0], dtype=torch.float64)
            for h in range(heads):
                vec += r["A"][s, h, i, j] * f[h][j]
            m[i, j] = vec.norm()
    return m, m[0]


def ref_gradcam(rec, s, pooled):
    """w_c = mean over the pooled tokens of dF[t, c]; cam_t = relu(sum_c w_c F[t, c])."""
    r = rec[-1]
    n, c = r["F"].shape[1], r["F"].shape[2]
    w = torch.zeros(c, dtype=torch.float64)
    for t in pooled:
        w += r["dF"][s, t] / len(pooled)
    return torch.stack([max(float(r["F"][s, t] @ w), 0.0) * torch.ones((), dtype=torch.float64) for t in range(n)])


def _reference(name, rec, s, valid, pooled, **opt):
    """(tokens, matrix or None) of method ``name`` for sample ``s``, from the formula."""
    if name == "cat":
        return ref_cat(rec, s), None
    if name == "attcat":
        return ref_attcat(rec, s, valid, **opt), None
    if name == "grads":
        m, t = ref_grads(rec, s)
        return t, m
    if name == "attgrads":
        m, t = ref_attgrads(rec, s, **opt)
        return t, m
    if name == "attention_norm":
        m, t = ref_attention_norm(rec, s)
        return t, m
    return ref_gradcam(rec, s, pooled), None


def _close(got, ref, rtol=1e-4):
    """Equal up to float32 noise, relative to the scale of the reference."""
    got = got.double()
    err = float((got - ref).abs().max())
    assert err <= rtol * float(ref.abs().max()) + 1e-12, (err, float(ref.abs().max()))


CASES = [("cat", {}), ("attcat", {}), ("attcat", {"attention": "cls"}), ("grads", {}), ("attgrads", {}),
         ("attgrads", {"token_scores": "cls"}), ("attention_norm", {}), ("gradcam", {})]


@pytest.mark.parametrize("name, opt", CASES)
def test_reference_vision_timm_vit(zoo, name, opt):
    """timm ViT: each method equals its formula on A, dA, h, dh, norm1 output, V, W_O from hooks."""
    model = zoo("timm_vit_tiny")
    x = models.image_batch(model, batch=2, seed=1)
    e = relprop.explain(model, x, target=2, method=name, **opt)
    rec = vit_records(model, x, 2)
    n = rec[0]["h"].shape[1]
    for s in range(2):
        tokens, matrix = _reference(name, rec, s, [True] * n, list(range(1, n)), **opt)
        _close(e.scores[s], tokens[1:])  # the class token is dropped from the scores
        if matrix is not None:
            _close(e.matrix[s], matrix)
        assert e.map.shape == (2, 64, 64)


@pytest.mark.parametrize("name, opt", CASES)
def test_reference_text_bert_padded(zoo, name, opt):
    """Eager BERT on a padded batch: each method equals its formula (padding left out of the means)."""
    model = zoo("hf_bert_eager")
    batch = models.text_batch((6, 4, 3))
    e = relprop.explain(model, batch, target=1, method=name, **opt)
    rec = bert_records(model, batch, 1)
    for s in range(3):
        valid = batch["attention_mask"][s].bool()
        tokens, matrix = _reference(name, rec, s, valid.tolist(), valid.nonzero()[:, 0].tolist(), **opt)
        _close(e.scores[s, valid], tokens[valid])
        assert (e.scores[s, ~valid] == 0).all()
        if matrix is not None:
            k = int(valid.sum())
            _close(e.matrix[s, :k, :k], matrix[:k, :k])


def test_grads_last_block_has_only_the_class_row(zoo):
    """In a classifier reading the class token, dA of the last block is zero outside the CLS row."""
    for fam in ("timm_vit_tiny", "hf_bert_eager"):
        model = zoo(fam)
        x = models.image_batch(model) if fam in models.VISION else models.text_batch()
        m = relprop.explain(model, x, target=0, method="grads").matrix
        assert m[:, 0].abs().amax() > 0 and (m[:, 1:] == 0).all()


def test_cat_equals_authors_output_hidden_states_form(zoo):
    """CAT of one BERT text is the authors' code: sum_b (grad(hs[b]) * hs[b]).sum(-1), b < L."""
    model = zoo("hf_bert_eager")
    one = {k: v[:1, :7] for k, v in models.text_batch().items()}
    out = model(**one, output_hidden_states=True)
    hs = out.hidden_states[:-1]
    g = _grads(out.logits[0, 2], list(hs))
    expected = sum((gb * hb).sum(-1) for gb, hb in zip(g, hs))[0]
    _close(relprop.explain(model, one, target=2, method="cat").scores[0], expected.double().detach())


# ------------------------------------------------------------------------------ shared properties

@pytest.mark.parametrize("family", ["timm_vit_tiny", "hf_bert_eager"])
def test_class_specific_and_agnostic(zoo, family):
    """Targets 0 and 1 give different scores for the class-specific methods, identical for attention_norm."""
    model = zoo(family)
    x = models.image_batch(model) if family in models.VISION else models.text_batch()
    both = zip(relprop.explain(model, x, target=0, method=METHODS), relprop.explain(model, x, target=1, method=METHODS))
    for name, (a, b) in zip(METHODS, both):
        rel = float((a.scores - b.scores).abs().max() / a.scores.abs().max())
        assert a.class_specific == (name != "attention_norm")
        if a.class_specific:
            assert rel > 1e-2, (name, rel)
        else:
            assert torch.equal(a.scores, b.scores) and torch.equal(a.matrix, b.matrix), name


@pytest.mark.parametrize("family", ["timm_deit_tiny_distilled", "hf_vit"])
def test_batch_invariance_vision(zoo, family):
    """A batch of 3 images explains like each image alone (max abs diff < 1e-5)."""
    model = zoo(family)
    x = models.image_batch(model, batch=3, seed=5)
    full = relprop.explain(model, x, target=[0, 1, 2], method=METHODS)
    for i in range(3):
        alone = relprop.explain(model, x[i:i + 1], target=i, method=METHODS)
        for name, f, a in zip(METHODS, full, alone):
            assert (f.scores[i] - a.scores[0]).abs().max() < 1e-5, name
            assert (f.map[i] - a.map[0]).abs().max() < 1e-5, name


@pytest.mark.parametrize("family", ["hf_bert_eager", "hf_roberta"])
def test_batch_invariance_text_padded(zoo, family):
    """A padded batch of texts of lengths 7, 5, 9, 3 gives each text's own scores (abs and relative)."""
    model = zoo(family)
    lengths = (7, 5, 9, 3)
    batch = models.text_batch(lengths, pad_id=1 if "roberta" in family else 0, first_id=3)
    targets = [0, 1, 2, 1]
    full = relprop.explain(model, batch, target=targets, method=METHODS)
    for i, n in enumerate(lengths):
        alone = relprop.explain(model, {k: v[i:i + 1, :n] for k, v in batch.items()}, target=targets[i],
                                method=METHODS)
        for name, f, a in zip(METHODS, full, alone):
            diff = float((f.scores[i, :n] - a.scores[0]).abs().max())
            scale = float(a.scores.abs().max())
            assert diff < 1e-5 and diff <= 1e-4 * scale + 1e-12, (name, i, diff, scale)
            assert (f.scores[i, n:] == 0).all()


@pytest.mark.parametrize("family", ["timm_vit_tiny", "hf_distilbert"])
def test_signs(zoo, family):
    """cat, attcat and grads are signed and take both signs on random models; attgrads, gradcam and
    attention_norm are >= 0."""
    model = zoo(family)
    x = models.image_batch(model, batch=3) if family in models.VISION else models.text_batch()
    for name, e in zip(METHODS, relprop.explain(model, x, target=1, method=METHODS)):
        assert e.signed == (name in ("cat", "attcat", "grads")), name
        if e.signed:
            assert e.scores.min() < 0 < e.scores.max(), name
        else:
            assert (e.scores >= 0).all() and e.scores.max() > 0, name
            if e.matrix is not None:
                assert (e.matrix >= 0).all(), name


# --------------------------------------------------------------------------------------- errors

def _trace(model, x):
    kw = bind_inputs(model, x)
    score, tgt = resolve(0, x.shape[0])
    return execute(Request(CACHE.get(model, kw), model, kw, Target(score, tgt)), Schedule(relevance="none"))


def test_missing_records_raise_method_error(zoo):
    """No W_O: attention_norm raises naming it and the methods that apply; no h: cat/attcat name it."""
    model = zoo("timm_vit_tiny")
    trace = _trace(model, models.image_batch(model))
    no_proj = dataclasses.replace(trace, blocks=[dataclasses.replace(b, out_proj_weight=None) for b in trace.blocks])
    with pytest.raises(relprop.MethodError, match="output projection W_O.*raw_attention"):
        get_method("attention_norm").fn(no_proj)
    no_h = dataclasses.replace(trace, blocks=[dataclasses.replace(b, hidden=None) for b in trace.blocks])
    for name in ("cat", "attcat"):
        with pytest.raises(relprop.MethodError, match="hidden states entering the block"):
            get_method(name).fn(no_h)
    no_f = dataclasses.replace(trace, blocks=[dataclasses.replace(b, features=None) for b in trace.blocks])
    with pytest.raises(relprop.MethodError, match="token features"):
        get_method("gradcam").fn(no_f)


def test_bad_options_raise_method_error(zoo):
    """Unknown option values and out-of-range blocks are MethodErrors that list the valid choices."""
    model = zoo("timm_vit_tiny")
    x = models.image_batch(model)
    with pytest.raises(relprop.MethodError, match="received"):
        relprop.explain(model, x, target=0, method="attcat", attention="rows")
    with pytest.raises(relprop.MethodError, match="'rows', 'cls'"):
        relprop.explain(model, x, target=0, method="attgrads", token_scores="columns")
    with pytest.raises(relprop.MethodError, match=r"blocks 0\.\.1"):
        relprop.explain(model, x, target=0, method="gradcam", block=2)
    first = relprop.explain(model, x, target=0, method="attention_norm", block=0)
    assert not torch.equal(first.scores, relprop.explain(model, x, target=0, method="attention_norm").scores)
