"""Causal decoders: GPT-2 (sequence classification and language model) and LLaMA
(RMSNorm, rotary embeddings, gated SiLU MLP, grouped-query attention), unmodified, eager and SDPA.

Per family: explain() runs for every applicable method, conservation under chefer2021 on bias-free
configs, a right-padded batch explains like each text alone, class (token) specificity, the model
untouched; plus slow references of the new rules (neg, pow/rsqrt/sqrt, products with a normalizing
statistic), the query row of a decoder, the next_token target, and the SDPA decomposition that lets
GPT-2 be captured.
"""
import pytest
import torch
import torch.fx

import models
import relprop
from relprop.graph.capture import CACHE
from relprop.graph.inputs import bind_inputs
from relprop.engine import Request, Schedule, execute
from relprop.methods.query import is_causal, query_weights
from relprop.rules import rule_registry as registry
from relprop.rules.context import RuleContext
from relprop.targets import Target, next_token, resolve
from snapshot import assert_same, snapshot

aten = torch.ops.aten
DECODERS = list(models.DECODERS)
LM_TOKENS = [5, 9, 11, 20]  # a fixed next token per sample of decoder_batch()
LENGTHS = (7, 5, 9, 3)


@pytest.fixture(scope="module")
def dec():
    cache = {}

    def get(name, bias_free=False):
        key = (name, bias_free and "gpt2" in name)  # LLaMA has no biases: the same model
        if key not in cache:
            m = models.DECODERS[name]()
            cache[key] = models.zero_biases(m) if bias_free else m
        return cache[key]
    return get


def _target(name, batch=None, tokens=LM_TOKENS):
    """A class for the classifier, else the given next token at the last non-padding position."""
    if "cls" in name:
        return [0, 1, 2, 1]
    return next_token(None if batch is None else batch["attention_mask"], tokens)


# --------------------------------------------------------------------------------- end to end

@pytest.mark.parametrize("name", DECODERS)
def test_conservation_bias_free(dec, name):
    """Input relevance + absorbed = injected (1 per sample) to 1e-4, end to end and in every block."""
    model = dec(name, bias_free=True)
    x = models.decoder_batch()
    e = relprop.explain(model, x, target=_target(name, x))
    c = e.conservation
    assert torch.allclose(c.injected, torch.ones(4))
    assert float(c.error.max()) < 1e-4, c
    assert len(c.blocks) == len(e.blocks) == 2
    for b in c.blocks:
        assert float(b.error.max()) < 1e-4, (b.name, b.relevance_in, b.relevance_out, b.absorbed)


@pytest.mark.parametrize("name", ["hf_gpt2_cls", "hf_llama"])
def test_every_applicable_method_runs(dec, name):
    """All methods but the vision-only one run on a padded batch: finite scores, zero on padding.
    GPT-2's attention output projection is a Conv1D (addmm), which attention_norm does not read:
    it says so and names the methods that apply (attn_res_ln_norm reads the same projection)."""
    model = dec(name)
    x = models.decoder_batch()
    skip = {"vit_cx"} | ({"attention_norm", "attn_res_ln_norm"} if "gpt2" in name else set())
    names = [m for m in relprop.methods() if m not in skip]
    exps = relprop.explain(model, x, target=_target(name, x), method=names, n_samples=2, n_steps=2)
    for e in exps:
        assert e.scores.shape == (4, 9), e.method
        assert torch.isfinite(e.scores).all(), e.method
        pad = x["attention_mask"] == 0
        assert (e.scores[pad] == 0).all() and not e.mask[pad].any(), e.method
    for m in skip:
        with pytest.raises(relprop.MethodError, match="transformer_attribution|raw_attention"):
            relprop.explain(model, x, target=_target(name, x), method=m)


@pytest.mark.parametrize("name", ["hf_gpt2_cls", "hf_gpt2_lm", "hf_llama"])
def test_batch_invariance_right_padding(dec, name):
    """A right-padded batch of 4 texts explains like each text alone: scores to 1e-5; the summed
    input relevance to 1e-4 relative (the residual z-rule divides by u + v, which magnifies the
    float32 rounding differences of a batched forward where u and v nearly cancel)."""
    model = dec(name)
    x = models.decoder_batch(LENGTHS)
    full = relprop.explain(model, x, target=_target(name, x))
    for i in (0, 3):  # lengths 7 and 3 in a batch padded to 9
        n = LENGTHS[i]
        one = {k: v[i:i + 1, :n] for k, v in x.items()}
        t = [0, 1, 2, 1][i] if "cls" in name else next_token(None, LM_TOKENS[i])
        alone = relprop.explain(model, one, target=t)
        assert (full.scores[i, :n] - alone.scores[0]).abs().max() < 1e-5
        assert (full.scores[i, n:] == 0).all()
        assert torch.isclose(full.conservation.input[i], alone.conservation.input[0], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name, a, b", [("hf_gpt2_cls", 0, 1), ("hf_gpt2_lm", 5, 40), ("hf_llama", 5, 40)])
def test_class_and_token_specific(dec, name, a, b):
    """transformer_attribution depends on the class / next token explained. The query position's
    own entry (C[q, q] >= 1, the identity of the rollout) is left out of the comparison."""
    model = dec(name)
    x = models.decoder_batch()
    ta = a if "cls" in name else next_token(x["attention_mask"], a)
    tb = b if "cls" in name else next_token(x["attention_mask"], b)
    ea, eb = relprop.explain(model, x, target=ta), relprop.explain(model, x, target=tb)
    q = query_positions_of(model, x, ta)
    keep = torch.ones_like(ea.scores, dtype=torch.bool)
    keep[torch.arange(4), q] = False
    sa, sb = ea.scores[keep], eb.scores[keep]
    assert (sa - sb).abs().max() / sa.abs().max() > 1e-2


def query_positions(trace):
    """The query row of each sample (decoders and class-token encoders have one-hot weights)."""
    w = query_weights(trace)
    assert torch.equal(w.max(-1).values, torch.ones(w.shape[0]))
    return w.argmax(-1)


def query_positions_of(model, x, target):
    kw = bind_inputs(model, x)
    score, tgt = resolve(target, x["input_ids"].shape[0])
    request = Request(CACHE.get(model, kw), model, kw, Target(score, tgt))
    return query_positions(execute(request, Schedule(relevance="none")))


@pytest.mark.parametrize("name", ["hf_gpt2_cls", "hf_llama_eager"])
def test_model_untouched(dec, name):
    model = dec(name)
    x = models.decoder_batch()
    before = snapshot(model)
    relprop.explain(model, x, target=_target(name, x))
    assert_same(before, snapshot(model))


# --------------------------------------------------------------------------------- query row and targets

def test_query_is_the_last_real_token(dec):
    """A decoder's attention is causal and its query row is the last non-padding position; the
    scores are that row of the aggregated matrix (no position after it has any relevance), less the
    query row's own identity share (1, at the last position: identity="exclude", relprop.methods.identity)."""
    model = dec("hf_gpt2_cls")
    x = models.decoder_batch()
    kw = bind_inputs(model, x)
    score, tgt = resolve(1, 4)
    trace = execute(Request(CACHE.get(model, kw), model, kw, Target(score, tgt)), Schedule(relevance="none"))
    assert is_causal(trace)
    assert query_positions(trace).tolist() == [n - 1 for n in LENGTHS]
    e = relprop.explain(model, x, target=1)
    for i, n in enumerate(LENGTHS):
        assert torch.equal(e.scores[i, :n - 1], e.matrix[i, n - 1, :n - 1])
        assert torch.allclose(e.scores[i, n - 1], e.matrix[i, n - 1, n - 1] - 1, atol=1e-6)


def test_query_follows_the_position_the_target_reads(dec):
    """A target read at position p (a callable) makes row p the query, for every sample."""
    model = dec("hf_llama")
    x = models.decoder_batch((9, 9, 9, 9))
    e = relprop.explain(model, x, target=lambda out: out.logits[:, 4, 7])
    assert query_positions_of(model, x, lambda out: out.logits[:, 4, 7]).tolist() == [4] * 4
    assert torch.equal(e.scores[:, :4], e.matrix[:, 4, :4])  # the query row's own entry less its identity share:
    assert torch.allclose(e.scores[:, 4], e.matrix[:, 4, 4] - 1, atol=1e-6)
    assert (e.scores[:, 5:] == 0).all()


def test_encoders_keep_the_class_token_row(zoo):
    """The query of an encoder with a class token stays row 0 (not causal)."""
    model = zoo("hf_bert_eager")
    x = models.text_batch()
    assert query_positions_of(model, x, 1).tolist() == [0, 0, 0, 0]


def test_next_token_target(dec):
    """next_token: the logit of the given (or predicted) token at the last non-padding position;
    target="next_token" takes the mask from the inputs and the predicted token."""
    model = dec("hf_gpt2_lm")
    x = models.decoder_batch()
    logits = model(**x, use_cache=False).logits
    last = torch.tensor([n - 1 for n in LENGTHS])
    rows = logits[torch.arange(4), last]
    fn = next_token(x["attention_mask"], LM_TOKENS)
    assert torch.allclose(fn(logits), rows[torch.arange(4), torch.tensor(LM_TOKENS)])
    assert torch.allclose(next_token(x["attention_mask"])(logits), rows.max(-1).values)
    a = relprop.explain(model, x, target="next_token")
    b = relprop.explain(model, x, target=next_token(x["attention_mask"], rows.argmax(-1)))
    assert torch.allclose(a.scores, b.scores) and torch.allclose(a.target_scores, rows.max(-1).values, atol=1e-5)
    with pytest.raises(relprop.TargetError, match="language model"):
        next_token()(torch.zeros(4, 3))
    with pytest.raises(relprop.TargetError, match="out of range"):
        next_token(x["attention_mask"], 999)(logits)
    c = relprop.explain(model, x)  # target=None: a language model explains its predicted next token
    assert torch.equal(c.scores, a.scores) and torch.equal(c.target_scores, a.target_scores)


# --------------------------------------------------------------------------------- capture

@pytest.mark.parametrize("name", ["hf_gpt2_cls", "hf_gpt2_lm", "hf_llama"])
def test_sdpa_capture_matches_the_model(dec, name):
    """GPT-2 with SDPA is captured (the decomposition keeps the fused op's output layout) and the
    captured graph computes the model's logits; blocks are named by module, input to output."""
    from relprop.engine.forward import forward
    model = dec(name)
    x = models.decoder_batch()
    kw = bind_inputs(model, x)
    cap = CACHE.get(model, kw)
    _, out = forward(cap, model, kw)
    ref = model(**x, use_cache=False).logits
    assert torch.allclose(out.logits if hasattr(out, "logits") else out[0], ref, atol=1e-5)
    prefix = "transformer.h" if "gpt2" in name else "model.layers"
    assert [b.name for b in cap.analysis.blocks] == [f"{prefix}.0.{'attn' if 'gpt2' in name else 'self_attn'}",
                                                     f"{prefix}.1.{'attn' if 'gpt2' in name else 'self_attn'}"]


# --------------------------------------------------------------------------------- decomposed GELU and RMSNorm

class _Net(torch.nn.Module):
    def __init__(self, mid, width=16):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(8, width, bias=False)
        self.mid = mid
        self.b = torch.nn.Linear(width, 3, bias=False)

    def forward(self, x):
        return self.b(self.mid(self.a(x)))


def _input_relevance(model, x, target=1):
    kw = bind_inputs(model, x)
    score, tgt = resolve(target, x.shape[0])
    tr = execute(Request(CACHE.get(model, kw), model, kw, Target(score, tgt)))
    return tr.input_relevance, tr.conservation


def test_gpt2_gelu_written_out_gives_the_identity_of_fused_gelu():
    """GPT-2's gelu_new (0.5·x·(1 + tanh(√(2/π)(x + 0.044715x³))), op by op) passes relevance like
    the fused GELU's identity rule (CVPR 2021 code): same input relevance to 1e-6."""
    from transformers.activations import NewGELUActivation
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    r_new, c = _input_relevance(_Net(NewGELUActivation()), x)
    r_fused, _ = _input_relevance(_Net(torch.nn.GELU(approximate="tanh")), x)
    assert float(c.error.max()) < 1e-5
    assert torch.allclose(r_new, r_fused, atol=1e-6)


def test_llama_rmsnorm_written_out_is_identity():
    """LLaMA's RMSNorm (x·rsqrt(mean(x²)+ε), then the gain) passes relevance unchanged, like
    LayerNorm in the CVPR 2021 code and like the fused aten.rms_norm: same input relevance."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(2))
    norm = LlamaRMSNorm(16)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    fused = torch.nn.RMSNorm(16, eps=norm.variance_epsilon)
    with torch.no_grad():
        fused.weight.copy_(norm.weight)
    r_llama, c = _input_relevance(_Net(norm), x)
    r_fused, _ = _input_relevance(_Net(fused), x)
    r_none, _ = _input_relevance(_Net(torch.nn.Identity()), x)
    assert float(c.error.max()) < 1e-5
    assert torch.allclose(r_llama, r_fused, atol=1e-6)
    # identity through the norm: the first linear layer sees the relevance the second one gave it
    assert torch.allclose(r_llama.sum(-1), r_none.sum(-1), atol=1e-5)


# --------------------------------------------------------------------------------- rule references

EPS = 1e-9


def _ctx(op, args, out, live, node=None):
    if node is None:
        node = torch.fx.Graph().call_function(op, ())
    return RuleContext(node=node, args=tuple(args), kwargs={}, out=out, live=tuple(live), batch_dim=0,
                       batch_size=out.shape[0], eps=EPS, preset="chefer2021")


def _z_share(x, dy_dx, y, r):
    """z-rule share of one element, R_x = x · (∂y/∂x) · R / y, with the stabilizer (0 where y = 0)."""
    if y == 0:
        return 0.0
    return x * dy_dx * r / (y + (EPS if y > 0 else -EPS))


@pytest.mark.parametrize("preset", ["chefer2021", "lrp"])
def test_negation_is_the_exact_z_rule(preset):
    """y = −x: the z-rule x·(−1)·R/y element by element equals R (rotate_half of RoPE)."""
    x = torch.tensor([[1.5, -2.0, 0.25], [3.0, -0.5, 4.0]], dtype=torch.float64)
    R = torch.tensor([[0.3, -1.0, 2.0], [0.5, 0.25, -4.0]], dtype=torch.float64)
    (rx,) = registry.lookup(preset, aten.neg.default)(_ctx(aten.neg.default, (x,), -x, (True,)), R)
    ref = torch.tensor([[_z_share(a, -1.0, -a, r) for a, r in zip(ra, rr)] for ra, rr in zip(x.tolist(), R.tolist())],
                       dtype=torch.float64)
    torch.testing.assert_close(rx, ref, rtol=1e-7, atol=0)


@pytest.mark.parametrize("op, args", [
    (aten.pow.Tensor_Scalar, lambda x: (x, 3.0)),
    (aten.rsqrt.default, lambda x: (x.abs() + 0.1,)),
    (aten.sqrt.default, lambda x: (x.abs(),)),
])
@pytest.mark.parametrize("preset", ["chefer2021", "lrp"])
def test_elementwise_nonlinearities_pass_relevance(op, args, preset):
    """Element-wise non-linearities of one input get the identity rule (CVPR 2021 code,
    RelProp.relprop for non-parametric layers): R_x = R_y, numbers get none."""
    x = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(3))
    a = args(x)
    out = op(*a)
    R = torch.randn(out.shape, generator=torch.Generator().manual_seed(4))
    r = registry.lookup(preset, op)(_ctx(op, a, out, (True,) + (False,) * (len(a) - 1)), R)
    assert len(r) == len(a) and torch.equal(r[0], R) and all(t is None for t in r[1:])


def _rmsnorm_graph(x):
    """fx nodes of x · rsqrt(mean(x², -1, keepdim) + ε), each with its value as meta['val']."""
    g = torch.fx.Graph()
    nx = g.placeholder("x")
    nx.meta["val"] = x
    p = g.call_function(aten.pow.Tensor_Scalar, (nx, 2))
    p.meta["val"] = x.pow(2)
    m = g.call_function(aten.mean.dim, (p, [-1], True))
    a = g.call_function(aten.add.Tensor, (m, 1e-6))
    s = g.call_function(aten.rsqrt.default, (a,))
    out = g.call_function(aten.mul.Tensor, (nx, s))
    return out, torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


@pytest.mark.parametrize("preset", ["chefer2021", "lrp"])
@pytest.mark.parametrize("statistic_first", [False, True])
def test_product_with_a_normalizing_statistic(preset, statistic_first):
    """x · rsqrt(mean(x²) + ε): the statistic (broadcast, reduced over that dimension) gets no
    relevance and x gets all of it — LayerNorm's convention in the CVPR 2021 code."""
    x = torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(5))
    node, stat = _rmsnorm_graph(x)
    if statistic_first:
        node.args = (node.args[1], node.args[0])
    args = (stat, x) if statistic_first else (x, stat)
    out = x * stat
    R = torch.randn(out.shape, generator=torch.Generator().manual_seed(6))
    r = registry.lookup(preset, aten.mul.Tensor)(_ctx(aten.mul.Tensor, args, out, (True, True), node), R)
    rx, rs = (r[1], r[0]) if statistic_first else (r[0], r[1])
    assert rs is None and torch.equal(rx, R)


@pytest.mark.parametrize("preset", ["chefer2021", "lrp"])
def test_broadcast_factor_that_is_not_a_statistic_is_a_gate(preset):
    """A live factor broadcast in the product but not reduced from the input (e.g. a per-token
    gate) is a gate: the halved z-rule, a·b·R/(a·b)/2 on each factor (Lemma 1 ii)."""
    a = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(7))
    b = torch.randn(2, 3, 1, generator=torch.Generator().manual_seed(8))
    g = torch.fx.Graph()
    na, nb = g.placeholder("a"), g.placeholder("b")
    nb2 = g.call_function(aten.sigmoid.default, (nb,))
    node = g.call_function(aten.mul.Tensor, (na, nb2))
    out = a * b
    R = torch.randn(out.shape, generator=torch.Generator().manual_seed(9))
    ra, rb = registry.lookup(preset, aten.mul.Tensor)(_ctx(aten.mul.Tensor, (a, b), out, (True, True), node), R)
    bb = b.expand_as(a)
    ref = torch.tensor([_z_share(u, v, u * v, r) / 2 for u, v, r in zip(a.flatten().tolist(), bb.flatten().tolist(),
                                                                       R.flatten().tolist())],
                       dtype=torch.float32).reshape(a.shape)
    torch.testing.assert_close(ra, ref, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(rb, ref, rtol=1e-5, atol=1e-7)  # in the product's shape; summed onto b later


def test_gated_mlp_product_is_halved_z_rule():
    """LLaMA's silu(x W1) ⊙ (x W3): two live factors of the same shape are a gate, not a
    statistic: each gets R/2 where the product is non-zero (Lemma 1 ii)."""
    a = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(10))
    b = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(11))
    R = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(12))
    g = torch.fx.Graph()
    node = g.call_function(aten.mul.Tensor, (g.placeholder("a"), g.placeholder("b")))
    ra, rb = registry.lookup("chefer2021", aten.mul.Tensor)(_ctx(aten.mul.Tensor, (a, b), a * b, (True, True), node), R)
    torch.testing.assert_close(ra, R / 2, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(rb, R / 2, rtol=1e-5, atol=1e-7)
