"""Input-level gradient and perturbation methods (survey §2): input_x_gradient,
smoothgrad, integrated_gradients, value_zeroing, vit_cx.

Each reference below is written from the method's formula with plain PyTorch on a float64 deepcopy
of the model (autograd at the pixels or at ``inputs_embeds``, forward hooks that zero the values),
never through relprop's captured graph.
"""
import copy

import pytest
import torch
import torch.nn.functional as F

import models
import relprop
from relprop.graph.capture import CACHE


def _close(a, b, rel=1e-4):
    """max |a - b| <= rel * max |b| (random models give scores of very different magnitudes)."""
    a, b = a.double(), b.double()
    return float((a - b).abs().max()) <= rel * float(b.abs().max()) + 1e-12


def _double(model):
    return copy.deepcopy(model).double().eval()


def _logits(out):
    return out.logits if hasattr(out, "logits") else out


# ------------------------------------------------------------------ plain-PyTorch references

def _pixel_grad(model, x, target):
    """d logit_target / d pixels for one image [C, H, W] (float64)."""
    x = x.detach().double()[None].requires_grad_(True)
    (g,) = torch.autograd.grad(_logits(model(x))[0, target], x)
    return g[0]


def _embeds(model, ids):
    return model.bert.embeddings.word_embeddings(ids).detach()


def _embed_grad(model, e, target):
    """d logit_target / d word embeddings for one unpadded text [S, C] (float64)."""
    e = e.detach().double()[None].requires_grad_(True)
    out = model(inputs_embeds=e, attention_mask=torch.ones(e.shape[:2], dtype=torch.long))
    (g,) = torch.autograd.grad(out.logits[0, target], e)
    return g[0]


def _bert_score(model, e, target):
    with torch.no_grad():
        out = model(inputs_embeds=e.double()[None], attention_mask=torch.ones((1, e.shape[0]), dtype=torch.long))
    return float(out.logits[0, target])


def _noise(seed, shape, n):
    """The documented noise: images from one generator seeded with `seed`; texts position by position."""
    g = torch.Generator()
    if len(shape) == 2:
        out = torch.empty((n,) + tuple(shape))
        for p in range(shape[0]):
            g.manual_seed(seed * 1_000_003 + p)
            out[:, p] = torch.randn((n, shape[1]), generator=g)
        return out
    g.manual_seed(seed)
    return torch.randn((n,) + tuple(shape), generator=g)


LENGTHS = (7, 5, 9, 3)


# ------------------------------------------------------------------ input × gradient

def test_input_x_gradient_reference_vision(zoo):
    """Σ_c x ⊙ ∂f/∂x per pixel equals autograd on a float64 copy; patch scores are its patch sums."""
    model = zoo("timm_vit_tiny")
    x = models.image_batch(model, batch=2, seed=1)
    e = relprop.explain(model, x, target=2, method="input_x_gradient")
    ref_model = _double(model)
    for i in range(2):
        ref = (x[i].double() * _pixel_grad(ref_model, x[i], 2)).sum(0)
        assert _close(e.map[i], ref)
        cells = ref.reshape(4, 16, 4, 16).sum((1, 3)).reshape(16)
        assert _close(e.scores[i], cells)


def test_input_x_gradient_reference_text(zoo):
    """Σ_k e_k ∂f/∂e_k over the word embedding of each token, text by text, on a padded batch."""
    model = zoo("hf_bert_eager")
    batch = models.text_batch(LENGTHS, first_id=3)
    e = relprop.explain(model, batch, target=1, method="input_x_gradient")
    ref_model = _double(model)
    for i, n in enumerate(LENGTHS):
        emb = _embeds(ref_model, batch["input_ids"][i, :n])
        ref = (emb * _embed_grad(ref_model, emb, 1)).sum(-1)
        keep = e.mask[i, :n]
        assert keep.sum() >= n - 1
        assert _close(e.scores[i, :n][keep], ref[keep])
        assert (e.scores[i, n:] == 0).all()


# ------------------------------------------------------------------ SmoothGrad

def test_smoothgrad_reference_vision(zoo):
    """Mean over noisy copies x + σε (σ = 0.15·(max−min) per image) of (x+σε) ⊙ ∂f/∂x, summed over channels."""
    model = zoo("timm_vit_tiny")
    x = models.image_batch(model, batch=2, seed=2)
    n = 3
    e = relprop.explain(model, x, target=0, method="smoothgrad", n_samples=n, batch_size=4, seed=5)
    eps = _noise(5, x.shape[1:], n)
    ref_model = _double(model)
    for i in range(2):
        sigma = 0.15 * float(x[i].max() - x[i].min())
        acc = torch.zeros(x.shape[1:], dtype=torch.float64)
        for s in range(n):
            z = x[i].double() + sigma * eps[s].double()
            acc += z * _pixel_grad(ref_model, z, 0)
        assert _close(e.map[i], (acc / n).sum(0), rel=1e-4)
    plain = relprop.explain(model, x, target=0, method="smoothgrad", n_samples=n, seed=5, multiply_by_input=False)
    i = 1
    sigma = 0.15 * float(x[i].max() - x[i].min())
    acc = sum(_pixel_grad(ref_model, x[i].double() + sigma * eps[s].double(), 0) for s in range(n))
    assert _close(plain.map[i], (acc / n).sum(0), rel=1e-4)


def test_smoothgrad_reference_text_padded(zoo):
    """Text: σ from each text's own real positions; a padded batch matches each text's reference alone."""
    model = zoo("hf_bert_eager")
    batch = models.text_batch(LENGTHS, first_id=3)
    n = 3
    e = relprop.explain(model, batch, target=2, method="smoothgrad", n_samples=n, batch_size=5)
    ref_model = _double(model)
    for i, L in enumerate(LENGTHS):
        emb = _embeds(ref_model, batch["input_ids"][i, :L])
        sigma = 0.15 * float(emb.max() - emb.min())
        eps = _noise(0, (L, emb.shape[-1]), n).double()
        acc = torch.zeros_like(emb)
        for s in range(n):
            z = emb + sigma * eps[s]
            acc += z * _embed_grad(ref_model, z, 2)
        ref = (acc / n).sum(-1)
        keep = e.mask[i, :L]
        assert _close(e.scores[i, :L][keep], ref[keep], rel=1e-4)


def test_smoothgrad_seeded_and_reproducible(zoo):
    """A fixed seed reproduces the result exactly, another seed changes it, batch_size does not, and a
    callable target (one run per noisy copy of the whole batch) gives the packed result."""
    model = zoo("timm_vit_tiny")
    x = models.image_batch(model, batch=2, seed=3)
    a = relprop.explain(model, x, target=1, method="smoothgrad", n_samples=4, seed=7)
    b = relprop.explain(model, x, target=1, method="smoothgrad", n_samples=4, seed=7)
    c = relprop.explain(model, x, target=1, method="smoothgrad", n_samples=4, seed=8)
    d = relprop.explain(model, x, target=1, method="smoothgrad", n_samples=4, seed=7, batch_size=3)
    f = relprop.explain(model, x, target=lambda out: out[:, 1], method="smoothgrad", n_samples=4, seed=7)
    assert torch.equal(a.map, b.map)
    assert float((a.map - c.map).abs().max()) > 1e-3 * float(a.map.abs().max())
    assert _close(d.map, a.map, rel=1e-5) and _close(f.map, a.map, rel=1e-5)
    zero = relprop.explain(model, x, target=1, method="smoothgrad", n_samples=2, noise_level=0.0)
    assert _close(zero.map, relprop.explain(model, x, target=1, method="input_x_gradient").map, rel=1e-5)


# ------------------------------------------------------------------ Integrated Gradients

def test_integrated_gradients_reference_vision(zoo):
    """(x − x₀) ⊙ mean of ∂f/∂x at x₀ + (k+½)/m (x − x₀), explicit loop over the m steps."""
    model = zoo("timm_vit_tiny")
    x = models.image_batch(model, batch=2, seed=4)
    m = 5
    base = torch.full(x.shape[1:], 0.25)
    e0 = relprop.explain(model, x, target=3, method="integrated_gradients", n_steps=m, batch_size=3)
    e1 = relprop.explain(model, x, target=3, method="integrated_gradients", n_steps=m, baseline=base)
    ref_model = _double(model)
    for e, x0 in ((e0, torch.zeros(x.shape[1:])), (e1, base)):
        for i in range(2):
            acc = torch.zeros(x.shape[1:], dtype=torch.float64)
            for k in range(m):
                alpha = (k + 0.5) / m
                acc += _pixel_grad(ref_model, x0.double() + alpha * (x[i].double() - x0.double()), 3)
            ref = ((x[i].double() - x0.double()) * acc / m).sum(0)
            assert _close(e.map[i], ref, rel=1e-4)


def test_integrated_gradients_reference_text_padded(zoo):
    """Text: the path runs through the word embeddings (zero baseline); padded batch vs each text alone."""
    model = zoo("hf_bert_eager")
    batch = models.text_batch(LENGTHS, first_id=3)
    m = 4
    e = relprop.explain(model, batch, target=0, method="integrated_gradients", n_steps=m, batch_size=7)
    ref_model = _double(model)
    for i, L in enumerate(LENGTHS):
        emb = _embeds(ref_model, batch["input_ids"][i, :L])
        acc = sum(_embed_grad(ref_model, (k + 0.5) / m * emb, 0) for k in range(m))
        ref = (emb * acc / m).sum(-1)
        keep = e.mask[i, :L]
        assert _close(e.scores[i, :L][keep], ref[keep], rel=1e-4)


def test_integrated_gradients_completeness(zoo):
    """Σ IG ≈ f(x) − f(x₀) (Sundararajan et al., Prop. 1), for images and for text (embeddings)."""
    model = zoo("timm_vit_tiny")
    x = models.image_batch(model, batch=2, seed=6)
    e = relprop.explain(model, x, target=1, method="integrated_gradients", n_steps=48)
    with torch.no_grad():
        delta = model(x)[:, 1] - model(torch.zeros_like(x))[:, 1]
    total = e.map.sum((1, 2))
    assert torch.allclose(total, delta, rtol=2e-2, atol=1e-3 * float(delta.abs().max())), (total, delta)
    assert torch.allclose(e.scores.sum(1), total, rtol=1e-5)

    bert = zoo("hf_bert_eager")
    batch = models.text_batch((6, 4), first_id=3)
    t = relprop.explain(bert, batch, target=2, method="integrated_gradients", n_steps=48,
                        special_tokens_mask=torch.zeros(2, 6, dtype=torch.bool))
    ref_model = _double(bert)
    for i, L in enumerate((6, 4)):
        emb = _embeds(ref_model, batch["input_ids"][i, :L])
        d = _bert_score(ref_model, emb, 2) - _bert_score(ref_model, torch.zeros_like(emb), 2)
        got = float(t.scores[i].sum())
        assert abs(got - d) <= 2e-2 * abs(d), (got, d)


# ------------------------------------------------------------------ Value Zeroing

def _vz_rollout(dist_per_block):
    joint = None
    for d in dist_per_block:  # input -> output
        vz = d / d.sum(-1, keepdim=True)
        joint = vz if joint is None else vz @ joint
    return joint


def _vz_reference_timm(model, x):
    """Zero token j's value (all heads) through a hook on blocks[b].attn.qkv; distance of blocks[b]'s output."""
    model = _double(model)
    x = x.double()
    c = model.embed_dim
    dists = []
    for blk in model.blocks:
        got = {}
        keep = blk.register_forward_hook(lambda mod, inp, out: got.__setitem__("out", out))
        with torch.no_grad():
            model(x)
        ref = got["out"]
        n = ref.shape[1]
        d = torch.zeros(n, n, dtype=torch.float64)
        for j in range(n):
            def zero_v(mod, inp, out, j=j):
                out = out.clone()
                out[:, j, 2 * c:] = 0  # qkv output: [q | k | v], heads inside each part
                return out
            h = blk.attn.qkv.register_forward_hook(zero_v)
            with torch.no_grad():
                model(x)
            h.remove()
            for i in range(n):
                d[i, j] = 1 - F.cosine_similarity(got["out"][0, i], ref[0, i], dim=0)
        keep.remove()
        dists.append(d)
    return _vz_rollout(dists)


def test_value_zeroing_reference_vision(zoo):
    """Per block/token, the block output with v_j zeroed via a hook on timm's qkv; rows sum 1; rollout."""
    model = zoo("timm_vit_tiny")
    x = models.image_batch(model, batch=2, seed=7)
    e = relprop.explain(model, x, target=0, method="value_zeroing")
    for i in range(2):
        ref = _vz_reference_timm(model, x[i:i + 1])
        assert _close(e.matrix[i], ref, rel=1e-4)
        assert _close(e.scores[i], ref[0, 1:], rel=1e-4)
        assert torch.allclose(e.matrix[i].sum(-1), torch.ones(17), atol=1e-5)


def test_value_zeroing_reference_text_padded(zoo):
    """BERT: zero the value Linear's output at token j in layer l; distance of hidden_states[l+1]; padded batch."""
    model = zoo("hf_bert_eager")
    batch = models.text_batch(LENGTHS, first_id=3)
    e = relprop.explain(model, batch, target=0, method="value_zeroing")
    ref_model = _double(model)
    for i, L in enumerate(LENGTHS):
        ids = batch["input_ids"][i:i + 1, :L]
        with torch.no_grad():
            base = ref_model(ids, output_hidden_states=True).hidden_states
        dists = []
        for layer_idx, layer in enumerate(ref_model.bert.encoder.layer):
            d = torch.zeros(L, L, dtype=torch.float64)
            for j in range(L):
                def zero_v(mod, inp, out, j=j):
                    out = out.clone()
                    out[:, j] = 0
                    return out
                h = layer.attention.self.value.register_forward_hook(zero_v)
                with torch.no_grad():
                    hs = ref_model(ids, output_hidden_states=True).hidden_states
                h.remove()
                for t in range(L):
                    d[t, j] = 1 - F.cosine_similarity(hs[layer_idx + 1][0, t], base[layer_idx + 1][0, t], dim=0)
            dists.append(d)
        ref = _vz_rollout(dists)
        assert _close(e.matrix[i, :L, :L], ref, rel=1e-4)
        assert (e.matrix[i, :L, L:] == 0).all()  # padding's values are never read by real tokens
        keep = e.mask[i, :L]
        assert _close(e.scores[i, :L][keep], ref[0][keep], rel=1e-4)


# ------------------------------------------------------------------ ViT-CX

def _vitcx_reference(model, x, target, threshold=0.1, baseline="zero", relative=True):
    """Features of blocks[-1].norm1 (patch tokens), per-channel min-max, bilinear upsampling, sklearn
    clustering on the upsampled maps (cosine, average linkage), cluster means, masked scores, Σ s M / Σ M
    (relative: s minus the baseline image's score)."""
    from sklearn.cluster import AgglomerativeClustering
    model = _double(model)
    x = x.double()
    got = {}
    h = model.blocks[-1].norm1.register_forward_hook(lambda mod, inp, out: got.__setitem__("f", out))
    with torch.no_grad():
        model(x[None])
    h.remove()
    f = got["f"][0, model.num_prefix_tokens:]  # [16, C]
    H, W = x.shape[-2:]
    maps = []
    for ch in range(f.shape[1]):
        m = f[:, ch].reshape(4, 4)
        if m.max() == m.min():
            continue
        m = (m - m.min()) / (m.max() - m.min())
        maps.append(F.interpolate(m[None, None], size=(H, W), mode="bilinear", align_corners=False)[0, 0])
    maps = torch.stack(maps)
    labels = AgglomerativeClustering(n_clusters=None, distance_threshold=threshold, metric="cosine",
                                     linkage="average").fit(maps.reshape(len(maps), -1).numpy()).labels_
    labels = torch.as_tensor(labels)
    base = torch.zeros_like(x) if baseline == "zero" else x.mean((1, 2), keepdim=True).expand_as(x)
    num = torch.zeros(H, W, dtype=torch.float64)
    den = torch.zeros(H, W, dtype=torch.float64)
    with torch.no_grad():
        s0 = float(model(base[None])[0, target]) if relative else 0.0
    for k in range(int(labels.max()) + 1):
        mask = maps[labels == k].mean(0)
        with torch.no_grad():
            s = float(model((x * mask + base * (1 - mask))[None])[0, target]) - s0
        num += s * mask
        den += mask
    return num / den, int(labels.max()) + 1


@pytest.mark.parametrize("baseline,relative", [("zero", True), ("mean", True), ("zero", False)])
def test_vit_cx_reference(zoo, baseline, relative):
    """ViT-CX map against a plain-PyTorch + sklearn reference (clustering on the upsampled maps); relative=False
    is the paper's Σ s M / Σ M, the default subtracts the baseline image's score."""
    model = zoo("timm_vit_tiny")
    x = models.image_batch(model, batch=2, seed=8)
    e = relprop.explain(model, x, target=4, method="vit_cx", baseline=baseline, batch_size=5, distance_threshold=0.15,
                        relative=relative)
    for i in range(2):
        ref, k = _vitcx_reference(model, x[i], 4, threshold=0.15, baseline=baseline, relative=relative)
        assert k >= 2
        assert _close(e.map[i], ref, rel=1e-4)


def test_vit_cx_callable_target_matches_index_target(zoo):
    """A callable target (one run per mask index over the whole batch, filler rows where images have fewer
    masks) gives the map of the packed runs of an index target."""
    model = zoo("timm_vit_tiny")
    x = models.image_batch(model, batch=3, seed=9)
    t = torch.tensor([0, 1, 2])
    a = relprop.explain(model, x, target=t, method="vit_cx", distance_threshold=0.15)
    b = relprop.explain(model, x, target=lambda out: out.gather(1, t[:, None])[:, 0], method="vit_cx",
                        distance_threshold=0.15)
    assert _close(b.map, a.map, rel=1e-5)


def test_vit_cx_rejects_text(zoo):
    """vit_cx on a text model: a MethodError naming the vision-only requirement and text methods."""
    expected = (r"vision models only.*Methods that apply to BertForSequenceClassification: "
                r".*'attcat'.*'transformer_attribution'")
    with pytest.raises(relprop.MethodError, match=expected) as info:
        relprop.explain(zoo("hf_bert_eager"), models.text_batch(), target=0, method="vit_cx")
    assert "'vit_cx'" not in str(info.value).split("Methods that apply")[1]


# ------------------------------------------------------------------ shared properties

SAMPLING = {
    "input_x_gradient": {},
    "smoothgrad": {"n_samples": 3, "batch_size": 5},
    "integrated_gradients": {"n_steps": 4, "batch_size": 5},
    "value_zeroing": {},
    "vit_cx": {"batch_size": 7, "distance_threshold": 0.15},  # ~10 masks per image instead of ~45
}


@pytest.mark.parametrize("name", list(SAMPLING))
def test_class_specificity(zoo, name):
    """Gradient and ViT-CX scores depend on the target; value zeroing does not (timm ViT and BERT)."""
    for family in ("timm_vit_tiny", "hf_bert_eager"):
        if name == "vit_cx" and family == "hf_bert_eager":
            continue
        model = zoo(family)
        x = models.image_batch(model) if family in models.VISION else models.text_batch()
        a = relprop.explain(model, x, target=0, method=name, **SAMPLING[name]).scores
        b = relprop.explain(model, x, target=1, method=name, **SAMPLING[name]).scores
        rel = float((a - b).abs().max() / a.abs().max())
        if name == "value_zeroing":
            assert rel == 0.0
        else:
            assert rel > 1e-2, (name, family, rel)


@pytest.mark.parametrize("name", list(SAMPLING))
def test_batch_invariance_vision(zoo, name):
    """A batch of 3 images explains like each image alone (max abs diff < 1e-5 of the map's scale)."""
    model = zoo("hf_vit") if name == "vit_cx" else zoo("timm_vit_tiny")
    x = models.image_batch(model, batch=3, seed=9)
    full = relprop.explain(model, x, target=[0, 1, 2], method=name, **SAMPLING[name])
    for i in range(3):
        alone = relprop.explain(model, x[i:i + 1], target=i, method=name, **SAMPLING[name])
        for got, ref in ((full.map[i], alone.map[0]), (full.scores[i], alone.scores[0])):
            diff, scale = float((got - ref).abs().max()), float(ref.abs().max())
            assert diff < 1e-5 * max(1.0, scale) and diff <= 1e-4 * scale, (diff, scale)


@pytest.mark.parametrize("name", [n for n in SAMPLING if n != "vit_cx"])
def test_batch_invariance_text_padded(zoo, name):
    """A padded batch of 4 texts gives each text's own scores (< 1e-5), padding scored 0."""
    model = zoo("hf_bert_eager")
    batch = models.text_batch(LENGTHS, first_id=3)
    full = relprop.explain(model, batch, target=[0, 1, 2, 1], method=name, **SAMPLING[name])
    for i, n in enumerate(LENGTHS):
        one = {k: v[i:i + 1, :n] for k, v in batch.items()}
        alone = relprop.explain(model, one, target=[0, 1, 2, 1][i], method=name, **SAMPLING[name])
        diff = float((full.scores[i, :n] - alone.scores[0]).abs().max())
        scale = float(alone.scores.abs().max())  # random BERT gradients are tiny: compare relatively too
        assert diff < 1e-5 * max(1.0, scale) and diff <= 1e-4 * scale, (diff, scale)
        assert (full.scores[i, n:] == 0).all() and not full.mask[i, n:].any()
        if alone.matrix is not None:
            assert float((full.matrix[i, :n, :n] - alone.matrix[0]).abs().max()) < 1e-5


def test_reruns_reuse_the_capture(zoo):
    """Re-runs (noisy copies, path points, masks, zeroed values) export the model at most once more (the
    program for every size, where a first call's program took its sizes only and packing saves runs), and
    never again."""
    model = zoo("hf_vit")
    x = models.image_batch(model, batch=2)
    relprop.explain(model, x, target=0, method="input_x_gradient")
    traces = CACHE.traces
    for name, opts in SAMPLING.items():
        e = relprop.explain(model, x, target=0, method=name, **opts)
        assert torch.isfinite(e.scores).all() and e.map.shape == (2, 32, 32)
    assert CACHE.traces <= traces + 1
    traces = CACHE.traces
    for name, opts in SAMPLING.items():
        relprop.explain(model, x, target=1, method=name, **opts)
    assert CACHE.traces == traces


def test_sampling_reruns_pack_on_the_program_for_every_size():
    """A first call exported at its own sizes (the default) cannot run a batch of noisy copies: SmoothGrad
    and IG, whose packed re-runs save runs, get the program for every size (exported once, as a call at
    another size would) and give the scores of a capture that was dynamic from the start, bit for bit; a
    later call exports nothing, and a callable target (unpacked re-runs) exports nothing more."""
    batch = models.text_batch(lengths=(6, 4))
    out = {}
    for first in ("static", "dynamic"):
        model = models.hf_bert("eager")
        old, CACHE.first_export = CACHE.first_export, first
        try:
            before = CACHE.traces
            sg = relprop.explain(model, batch, target=1, method="smoothgrad", n_samples=6)
            ig = relprop.explain(model, batch, target=1, method="integrated_gradients", n_steps=6)
            made = CACHE.traces - before
            said = [n for n in sg.notes + ig.notes if "so that smoothgrad packs its re-runs" in n]
            assert len(said) == (1 if first == "static" else 0), sg.notes + ig.notes
            assert [p.batch_dynamic for p in CACHE.programs(model)] == ([False, True] if first == "static"
                                                                       else [True])
            again = CACHE.traces
            relprop.explain(model, batch, target=1, method="smoothgrad", n_samples=6)
            relprop.explain(model, batch, target=lambda out: out.logits[:, 1], method="smoothgrad", n_samples=6)
            assert CACHE.traces == again
            out[first] = (sg.scores, ig.scores, made)
        finally:
            CACHE.first_export = old
            CACHE.clear(model)
    assert out["static"][2] == 2 and out["dynamic"][2] == 1
    assert torch.equal(out["static"][0], out["dynamic"][0]) and torch.equal(out["static"][1], out["dynamic"][1])


def test_option_errors(zoo):
    """Bad options are MethodErrors that say what is expected."""
    model = zoo("timm_vit_tiny")
    x = models.image_batch(model)
    with pytest.raises(relprop.MethodError, match="baseline"):
        relprop.explain(model, x, method="integrated_gradients", baseline="blur")
    with pytest.raises(relprop.MethodError, match="does not broadcast"):
        relprop.explain(model, x, method="integrated_gradients", baseline=torch.zeros(5, 5))
    with pytest.raises(relprop.MethodError, match="n_samples"):
        relprop.explain(model, x, method="smoothgrad", n_samples=0)
    with pytest.raises(relprop.MethodError, match="batch_size"):
        relprop.explain(model, x, method="vit_cx", batch_size=0)
