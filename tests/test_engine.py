"""End-to-end properties of the engine on tiny random models of every supported family: conservation,
batch invariance, the model untouched, clear errors, the capture cached."""
import copy

import pytest
import torch

import models
import relprop
from relprop.graph.capture import CACHE
from snapshot import assert_same, snapshot

VISION = list(models.VISION)
TEXT = list(models.TEXT)


def _inputs(name, model, batch=2):
    if name in models.VISION:
        return models.image_batch(model, batch=batch)
    return models.text_batch(pad_id=1 if "roberta" in name else 0)


@pytest.mark.parametrize("name", VISION + TEXT)
def test_conservation_end_to_end_and_per_block(zoo, name):
    """Input relevance + relevance absorbed by constants = injected relevance (Eq. 3, Lemmas 1-2),
    per sample, relative error < 1e-4; and the same inside every block."""
    model = zoo(name)
    e = relprop.explain(model, _inputs(name, model), target=1)
    c = e.conservation
    assert torch.allclose(c.injected, torch.ones_like(c.injected))
    assert float(c.error.max()) < 1e-4, c
    assert len(c.blocks) == len(e.blocks) == 2
    for b in c.blocks:
        assert float(b.error.max()) < 1e-4, (b.name, b.relevance_in, b.relevance_out, b.absorbed)
    assert torch.isfinite(e.scores).all()


def test_constants_absorb_relevance(zoo):
    """Position embeddings and the class token are constants: their share is reported as absorbed."""
    model = zoo("timm_vit_tiny")
    e = relprop.explain(model, models.image_batch(model), target=0)
    assert {"pos_embed", "cls_token"} <= set(e.conservation.absorbed_by)
    m = zoo("hf_bert_eager")
    e = relprop.explain(m, models.text_batch(), target=0)
    labels = " ".join(e.conservation.absorbed_by)
    assert "position_embeddings" in labels or "embedding" in labels


@pytest.mark.parametrize("name", ["timm_vit_tiny", "timm_deit_tiny_distilled", "hf_vit"])
def test_batch_invariance_vision(zoo, name):
    """A batch explains exactly like its samples one by one (max abs difference < 1e-5)."""
    model = zoo(name)
    x = models.image_batch(model, batch=4, seed=3)
    full = relprop.explain(model, x, target=[0, 1, 2, 3])
    for i in range(4):
        alone = relprop.explain(model, x[i:i + 1], target=i)
        assert (full.scores[i] - alone.scores[0]).abs().max() < 1e-5
        assert (full.map[i] - alone.map[0]).abs().max() < 1e-5
        assert (full.conservation.input[i] - alone.conservation.input[0]).abs() < 1e-5


@pytest.mark.parametrize("name", TEXT)
def test_batch_invariance_text_padded(zoo, name):
    """A padded batch of 4 texts of different lengths gives each text's own scores (< 1e-5)."""
    model = zoo(name)
    pad = 1 if "roberta" in name else 0
    lengths = (7, 5, 9, 3)
    batch = models.text_batch(lengths, pad_id=pad, first_id=3)
    full = relprop.explain(model, batch, target=[0, 1, 2, 1])
    for i, n in enumerate(lengths):
        one = {k: v[i:i + 1, :n] for k, v in batch.items()}
        alone = relprop.explain(model, one, target=[0, 1, 2, 1][i])
        assert (full.scores[i, :n] - alone.scores[0]).abs().max() < 1e-5
        assert (full.scores[i, n:] == 0).all() and not full.mask[i, n:].any()
        assert (full.conservation.input[i] - alone.conservation.input[0]).abs() < 1e-5


@pytest.mark.parametrize("name", ["timm_vit_tiny", "hf_bert_eager"])
def test_class_specific(zoo, name):
    """transformer_attribution depends on the target class (Fig. 3 of the paper)."""
    model = zoo(name)
    x = _inputs(name, model)
    e0 = relprop.explain(model, x, target=0)
    e1 = relprop.explain(model, x, target=1)
    a, b = e0.scores[:, 1:], e1.scores[:, 1:]  # position 0 of a text is [CLS] itself (C[0,0] >= 1)
    assert (a - b).abs().max() / a.abs().max() > 1e-2


def test_callable_target_equals_int_target(zoo):
    """A callable returning the class logit explains exactly like the class index."""
    model = zoo("hf_bert_eager")
    x = models.text_batch()
    a = relprop.explain(model, x, target=2)
    b = relprop.explain(model, x, target=lambda out: out.logits[:, 2])
    assert torch.allclose(a.scores, b.scores, atol=1e-7)
    assert b.target is None and a.target.tolist() == [2, 2, 2, 2]


def test_default_target_is_prediction(zoo):
    model = zoo("timm_vit_tiny")
    x = models.image_batch(model, batch=3)
    e = relprop.explain(model, x)
    assert e.target.tolist() == model(x).argmax(-1).tolist()


@pytest.mark.parametrize("name", ["timm_vit_tiny", "hf_bert_sdpa", "hf_deit"])
def test_model_untouched(zoo, name):
    """Parameters, buffers, training flags, hooks and classes are identical after explain()."""
    model = zoo(name)
    x = _inputs(name, model)
    before = snapshot(model)
    relprop.explain(model, x, target=1)
    assert_same(before, snapshot(model))


def test_model_untouched_when_explain_raises_and_train_mode_kept():
    """Also when explain() raises (target out of range), and a model in train mode stays in it."""
    model = models.hf_bert().train()
    model.classifier.register_forward_hook(lambda *a: None)
    before = snapshot(model)
    with pytest.raises(relprop.TargetError, match=r"valid class indices are 0\.\.2"):
        relprop.explain(model, models.text_batch(), target=7)
    assert_same(before, snapshot(model))
    assert model.training and model.bert.encoder.layer[0].attention.self.dropout.training
    e = relprop.explain(model, models.text_batch(), target=1)  # explained in eval mode
    assert_same(before, snapshot(model))
    ref = relprop.explain(copy.deepcopy(model).eval(), models.text_batch(), target=1)
    assert torch.allclose(e.scores, ref.scores)


@pytest.mark.parametrize("bad, pattern", [
    (3, r"0\.\.2"), (-1, r"0\.\.2"), ([0, 1], r"2 entries but the batch has 4"), (1.5, "integer|int"),
])
def test_target_errors(zoo, bad, pattern):
    model = zoo("hf_bert_eager")
    with pytest.raises(relprop.TargetError, match=pattern):
        relprop.explain(model, models.text_batch(), target=bad)


def test_unsupported_operation_message():
    """An op with no rule names the op, the module path it came from and the decorator."""
    model = models.UnruledOp().eval()
    x = torch.randn(2, 4)
    with pytest.raises(relprop.UnsupportedOperation) as info:
        relprop.explain(model, x, target=0, method="transformer_attribution")
    msg = str(info.value)
    assert "aten.exp.default" in msg and "inner.1" in msg and "Exp" in msg
    assert "@relprop.rule(torch.ops.aten.exp.default, preset='chefer2021')" in msg


def test_user_registered_rule_is_used():
    """@relprop.rule registers a rule in a preset; a user preset extends 'base'."""
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(3, 3, bias=False)
            self.b = torch.nn.Linear(3, 2, bias=False)

        def forward(self, x):
            return self.b(torch.exp(self.a(x)))

    @relprop.rule(torch.ops.aten.exp.default, preset="chefer2021")
    def exp_identity(ctx, relevance):
        return (relevance,)

    try:
        from relprop.engine import Request, execute
        from relprop.graph.inputs import bind_inputs
        from relprop.targets import Target, resolve
        model = Net().eval()
        with torch.no_grad():  # positive weights: every z_j > 0, so alpha1-beta0 loses nothing
            model.a.weight.uniform_(0.1, 1.0)
            model.b.weight.uniform_(0.1, 1.0)
        kw = bind_inputs(model, torch.rand(2, 3) + 0.1)
        cap = CACHE.get(model, kw)
        score, tgt = resolve(0, 2)
        trace = execute(Request(cap, model, kw, Target(score, tgt), preset="chefer2021"))
        assert float(trace.conservation.error.max()) < 1e-5
    finally:
        from relprop.rules.rule_registry import get_preset
        get_preset("chefer2021").rules.pop(torch.ops.aten.exp.default)


def test_capture_is_cached_and_batch_dynamic(zoo):
    """A second call with the same shapes does not trace; the first call of another batch size exports the
    program for every size once (unless an earlier call did), and every batch size after it reuses it."""
    model = zoo("timm_deit_small")
    relprop.explain(model, models.image_batch(model, batch=2), target=0)
    traces = CACHE.traces
    relprop.explain(model, models.image_batch(model, batch=2, seed=5), target=1)
    assert CACHE.traces == traces
    relprop.explain(model, models.image_batch(model, batch=3), target=1)
    assert CACHE.traces <= traces + 1 and any(p.batch_dynamic for p in CACHE.programs(model))
    traces = CACHE.traces
    relprop.explain(model, models.image_batch(model, batch=1), target=1)
    relprop.explain(model, models.image_batch(model, batch=4), target=1)
    assert CACHE.traces == traces


@pytest.mark.parametrize("name, first, n", [
    ("timm_vit_tiny", "blocks.0.attn", 2), ("hf_bert_eager", "bert.encoder.layer.0.attention.self", 2),
    ("hf_bert_sdpa", "bert.encoder.layer.0.attention.self", 2),
    ("hf_distilbert", "distilbert.transformer.layer.0.attention", 2),
    ("hf_vit", "vit.layers.0.attention", 2),
])
def test_blocks_found_structurally(zoo, name, first, n):
    """Attention blocks: the softmax whose output multiplies V, named by module, input→output."""
    model = zoo(name)
    e = relprop.explain(model, _inputs(name, model), target=0)
    modules = dict(model.named_modules())
    assert all(b.name in modules for b in e.blocks)
    assert len(e.blocks) == n and e.blocks[0].name == first
    assert [b.index for b in e.blocks] == list(range(n))
    for b in e.blocks:
        bsz, heads, s, s2 = b.attention.shape
        assert s == s2 and heads in (3, 4)
        assert b.gradient.shape == b.attention.shape == b.relevance.shape
        assert b.hidden.shape[:2] == (bsz, s) and b.hidden_gradient.shape == b.hidden.shape


def test_attention_and_gradient_match_eager_model():
    """A and dA = d logit_t / dA equal what the eager HF model exposes (output_attentions + retain_grad)."""
    model = models.hf_bert("eager")
    x = models.text_batch()
    e = relprop.explain(model, x, target=1)
    ref = copy.deepcopy(model)
    out = ref(**x, output_attentions=True)
    for a in out.attentions:
        a.retain_grad()
    out.logits[:, 1].sum().backward()
    for b, a in zip(e.blocks, out.attentions):
        assert torch.allclose(b.attention, a.detach(), atol=1e-6)
        assert torch.allclose(b.gradient, a.grad, atol=1e-6)


def test_fused_and_unfused_timm_attention_agree(zoo):
    """SDPA decomposed in the graph gives the same explanation as timm's explicit attention."""
    a, b = zoo("timm_vit_base_fused"), zoo("timm_vit_base_unfused")
    x = models.image_batch(a)
    ea, eb = relprop.explain(a, x, target=2), relprop.explain(b, x, target=2)
    assert torch.allclose(ea.scores, eb.scores, rtol=1e-3, atol=1e-6)


def test_explanation_shapes_vision(zoo):
    model = zoo("timm_deit_tiny_distilled")
    x = models.image_batch(model, batch=2)
    e = relprop.explain(model, x, target=0)
    assert e.scores.shape == (2, 16) and e.map.shape == (2, 64, 64) and e.prefix_tokens == 2
    assert e.input_relevance.shape == x.shape
    assert e.matrix.shape == (2, 18, 18)


def test_lrp_preset_is_not_conservative(zoo):
    """The paper's LRP baseline rules (authors' layers_lrp.py) do not conserve relevance."""
    from relprop.graph.inputs import bind_inputs
    from relprop.engine import Request, execute
    from relprop.targets import Target, resolve
    model = zoo("timm_vit_tiny")
    kw = bind_inputs(model, models.image_batch(model))
    score, tgt = resolve(0, 2)
    trace = execute(Request(CACHE.get(model, kw), model, kw, Target(score, tgt), preset="lrp"))
    assert float(trace.conservation.error.min()) > 1e-2


def test_transformer_attribution_reference(zoo):
    """Eq. 13-14 written out with loops over blocks, heads and tokens."""
    model = zoo("timm_vit_tiny")
    e = relprop.explain(model, models.image_batch(model, batch=2), target=3)
    for i in range(2):
        n = e.blocks[0].attention.shape[-1]
        c = torch.eye(n, dtype=torch.float64)
        for b in e.blocks:  # input -> output; C = Ā_B ... Ā_1 in input-to-output numbering
            heads = b.attention.shape[1]
            abar = torch.eye(n, dtype=torch.float64)
            for h in range(heads):
                abar += (b.gradient[i, h].double() * b.relevance[i, h].double()).clamp(min=0) / heads
            c = abar @ c
        assert torch.allclose(e.matrix[i].double(), c, rtol=1e-4, atol=1e-9)
        assert torch.allclose(e.scores[i].double(), c[0, 1:], rtol=1e-4, atol=1e-9)


def test_unknown_method_and_preset_errors(zoo):
    model = zoo("timm_vit_tiny")
    x = models.image_batch(model)
    with pytest.raises(relprop.MethodError, match="transformer_attribution"):
        relprop.explain(model, x, method="transformer_atribution")
    with pytest.raises(relprop.RelpropError, match="chefer2021"):
        relprop.explain(model, x, preset="chefer")
    with pytest.raises(relprop.MethodError, match="start_block"):
        relprop.explain(model, x, start_blok=1)


@pytest.mark.parametrize("name", ["timm_vit_tiny", pytest.param("hf_bert_eager", marks=pytest.mark.slow)])
def test_gradient_pass_reaches_the_input_only_when_a_method_reads_it(zoo, name, monkeypatch):
    """Without a method that reads Trace.input_gradient the gradient pass stops at the blocks (a
    ViT's patch embedding is not back-propagated); the records, scores and input relevance are the
    same bit for bit, and input_x_gradient in the same call still gets its gradient."""
    model = zoo(name)
    x = _inputs(name, model)
    asked = []
    grad = torch.autograd.grad

    def counting(outputs, inputs, *args, **kwargs):
        asked.append(len(inputs))
        return grad(outputs, inputs, *args, **kwargs)
    monkeypatch.setattr(torch.autograd, "grad", counting)
    alone = relprop.explain(model, x, target=1, method="transformer_attribution")
    n_alone, asked[:] = sum(asked), []
    both = relprop.explain(model, x, target=1, method=["transformer_attribution", "input_x_gradient"])
    monkeypatch.undo()
    assert sum(asked) == n_alone + 1  # the same tensors and the input's
    ixg = relprop.explain(model, x, target=1, method="input_x_gradient")
    assert torch.equal(alone.scores, both[0].scores)
    assert torch.equal(alone.input_relevance, both[0].input_relevance)
    for a, b in zip(alone.blocks, both[0].blocks):
        for field in ("attention", "gradient", "relevance", "hidden", "hidden_gradient"):
            assert torch.equal(getattr(a, field), getattr(b, field)), field
    assert torch.equal(both[1].scores, ixg.scores)
