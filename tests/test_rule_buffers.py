"""Rules and evaluation that reuse their own buffers (fewer attention-sized allocations).

On long inputs every attention-sized tensor is fresh memory the kernel faults in page by page, so
the rules compute into buffers they made themselves, the decomposed safe softmax of an exported SDPA
evaluates without its zero-filled tensor and without the where's copy (also under autograd, where
the selected operand feeds nothing else differentiable), and a walk recomputes a discarded score
once. Each of these must give the values (and gradients) of the plain formula bit for bit, never
write into an input, and step aside under autograd where that would change a gradient. One test
bounds the number of attention-sized tensors a folded Transformer Attribution creates per block.
"""
import collections
import os
import traceback

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import relprop
from relprop.graph.capture import CACHE
from relprop.graph.inputs import bind_inputs
from relprop.graph.nodes import evaluate
from relprop.graph.torch_fixes import safe_target
from relprop.rules.context import RuleContext
from relprop.rules.passthrough import where_route
from relprop.rules.stabilize import safe_divide, safe_divide_nonnegative, times_fresh

from models import VOCAB, hf_bert

aten = torch.ops.aten


def _reference_safe_divide(num, den, eps):
    """num / (den + ε·sign den), sign 0 → +; 0 where den = 0 or the quotient is not finite."""
    sign = torch.where(den < 0, -1.0, 1.0).to(den.dtype)
    out = num / (den + eps * sign)
    out = torch.where(den == 0, torch.zeros((), dtype=out.dtype), out)
    return torch.where(torch.isfinite(out), out, torch.zeros((), dtype=out.dtype))


def _special(shape, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(shape, generator=g, dtype=dtype)
    flat = t.view(-1)
    specials = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-12, -1e-12], dtype=dtype)
    idx = torch.randint(0, flat.numel(), (min(flat.numel(), 7),), generator=g)
    flat[idx] = specials[: idx.numel()]
    return t


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 5), cols=st.integers(1, 7), seed=st.integers(0, 10_000),
       broadcast=st.booleans(), dtype=st.sampled_from([torch.float32, torch.float64]),
       eps=st.sampled_from([1e-9, 1e-6, 0.0]))
def test_safe_divide_equals_its_formula_bit_for_bit_and_leaves_inputs(rows, cols, seed, broadcast, dtype, eps):
    den = _special((rows, cols), seed, dtype)
    num = _special((1, cols) if broadcast else (rows, cols), seed + 1, dtype)
    num0, den0 = num.clone(), den.clone()
    got = safe_divide(num, den, eps)
    want = _reference_safe_divide(num, den, eps)
    assert torch.equal(got, want)
    assert torch.equal(num.nan_to_num(1.5), num0.nan_to_num(1.5)) and torch.equal(den.nan_to_num(1.5),
                                                                                   den0.nan_to_num(1.5))


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 5), cols=st.integers(1, 7), seed=st.integers(0, 10_000),
       eps=st.sampled_from([1e-9, 1e-6, 0.0]))
def test_safe_divide_nonnegative_equals_its_formula_where_den_is_nonnegative(rows, cols, seed, eps):
    den = _special((rows, cols), seed, torch.float32).abs()
    den[den.isnan()] = 0.0
    num = _special((rows, cols), seed + 1, torch.float32)
    want = num / (den + eps)
    want = torch.where(den == 0, torch.zeros(()), want)
    want = torch.where(torch.isfinite(want), want, torch.zeros(()))
    assert torch.equal(safe_divide_nonnegative(num, den, eps), want)


def test_safe_divide_under_autograd_keeps_the_graph():
    num = torch.randn(3, 4, requires_grad=True)
    den = torch.randn(3, 4)
    out = safe_divide(num, den)
    (g,) = torch.autograd.grad(out.sum(), num)
    assert torch.equal(g, safe_divide(torch.ones(3, 4), den))


def test_times_fresh_writes_into_the_fresh_tensor_only_when_it_holds_the_result():
    fresh, other = torch.randn(2, 3, 4), torch.randn(3, 4)
    want = fresh * other
    out = times_fresh(fresh, other)
    assert out is fresh and torch.equal(out, want)
    small = torch.randn(3, 4)
    big = torch.randn(2, 3, 4)
    out = times_fresh(small, big)  # the result is larger than the fresh tensor: a new one
    assert out is not small and torch.equal(out, small * big)
    leaf = torch.randn(3, 4, requires_grad=True)
    out = times_fresh(torch.randn(3, 4), leaf)  # autograd records it: out of place
    assert out.requires_grad


def _where_ctx(cond, a, b, live):
    out = torch.where(cond, a, b)
    return RuleContext(node=None, args=(cond, a, b), kwargs={}, out=out, live=live, batch_dim=0, batch_size=1,
                       eps=1e-9, preset="chefer2021", options={})


def _where_reference(cond, a, b, r):
    zero = torch.zeros(())
    return (None, torch.where(cond, r, zero) if torch.is_tensor(a) else None,
            torch.where(cond, zero, r) if torch.is_tensor(b) else None)


@pytest.mark.parametrize("pattern", ["none", "all", "some"])
@pytest.mark.parametrize("a_live", [False, True])
def test_where_route_gives_every_element_to_its_source(pattern, a_live):
    r = torch.randn(1, 2, 5, 5)
    cond = {"none": torch.zeros(1, 2, 5, 1, dtype=torch.bool), "all": torch.ones(1, 2, 5, 1, dtype=torch.bool),
            "some": torch.tensor([True, False, False, True, False]).view(1, 1, 5, 1).expand(1, 2, 5, 1)}[pattern]
    a, b = torch.zeros(1, 2, 5, 5), torch.rand(1, 2, 5, 5)
    shares = where_route(_where_ctx(cond, a, b, (False, a_live, True)), r)
    want = _where_reference(cond, a, b, r)
    for got, ref in zip(shares[1:], want[1:]):
        if got is None:  # skipped only for a constant operand that would have absorbed zeros
            assert not bool(ref.any())
        else:
            assert torch.equal(got, ref)
    if pattern == "none" and not a_live:
        assert shares[2] is r and shares[1] is None  # the whole relevance, not a copy
    if a_live:  # a live operand gets its (possibly zero) share: its own path still runs
        assert shares[1] is not None


def test_where_evaluates_to_the_selected_operand_without_autograd_only():
    a, b = torch.zeros(2, 3), torch.randn(2, 3)
    none = torch.zeros(2, 1, dtype=torch.bool)
    where = safe_target(aten.where.self)
    assert where(none, a, b) is b
    assert where(~none, a, b) is a
    mixed = torch.tensor([[True], [False]])
    assert torch.equal(where(mixed, a, b), torch.where(mixed, a, b))
    bg = b.clone().requires_grad_(True)
    out = where(none, a, bg)
    assert out is not bg and out.grad_fn is not None
    assert where(none, a, torch.randn(1, 3)).shape == (2, 3)  # an operand smaller than the result: computed


def _captured_bert_sdpa(tokens=12):
    model = hf_bert(attn="sdpa")
    ids = torch.randint(5, VOCAB, (1, tokens), generator=torch.Generator().manual_seed(0))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    return model, inputs, CACHE.get(model, bind_inputs(model, inputs))


def test_full_like_read_element_wise_is_a_broadcast_and_otherwise_a_tensor():
    model, inputs, cap = _captured_bert_sdpa()
    fills = [n for n in cap.graph.nodes if n.op == "call_function" and n.target is aten.full_like.default]
    assert fills, "the exported SDPA of BERT has a decomposed safe softmax (full_like under where)"
    node = fills[0]
    x = torch.randn(1, 4, 12, 12)
    v = evaluate(node, lambda n: x if n is node.args[0] else n)
    assert v.stride() == (0, 0, 0, 0) and torch.equal(v, torch.full_like(x, node.args[1]))
    graph = torch.fx.Graph()  # the same op feeding a view: a materialized tensor
    p = graph.placeholder("x")
    f = graph.call_function(aten.full_like.default, (p, 0.5))
    graph.output(graph.call_function(aten.view.default, (f, [-1])))
    out = evaluate(f, lambda n: x)
    assert out.is_contiguous() and out.stride() != (0, 0, 0, 0) and torch.equal(out, torch.full_like(x, 0.5))


class _AttentionSized(TorchDispatchMode):
    """Counts the new floating-point tensors of exactly ``numel`` elements the ops make (views and
    the quarter-sized boolean masks excluded); ``sites`` counts them by op and by the innermost relprop
    frames that made them (what an assertion names when a count is exceeded)."""

    def __init__(self, numel):
        super().__init__()
        self.numel, self.count, self.sites = numel, collections.Counter(), collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = {t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves((args, kwargs))
               if torch.is_tensor(t) and t.device.type != "meta"}
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if torch.is_tensor(t) and t.device.type != "meta" and t.numel() == self.numel and t.is_floating_point() \
                    and t.untyped_storage().data_ptr() not in ins:
                self.count[str(func)] += 1
                self.sites[(str(func),) + _relprop_frames()] += 1
        return out


def _relprop_frames(depth=4):
    """The innermost ``depth`` frames of relprop's own code on the stack, as ``module:line:function``."""
    frames = [f for f in traceback.extract_stack() if f"{os.sep}relprop{os.sep}" in f.filename
              and f"{os.sep}tests{os.sep}" not in f.filename]
    inside = os.sep + "relprop" + os.sep
    return tuple(f"{f.filename.rsplit(inside, 1)[-1]}:{f.lineno}:{f.name}" for f in frames[-depth:])


def _sites(mode):
    return "\n".join(f"{n} × {' <- '.join(reversed(k))}" for k, n in sorted(mode.sites.items()))


def test_folded_transformer_attribution_makes_few_attention_sized_tensors_per_block():
    tokens = 40  # 4 heads × 40² = 6400 elements: no other tensor of the model has that size
    model, inputs, _ = _captured_bert_sdpa(tokens)
    mode = _AttentionSized(4 * tokens * tokens)
    with mode:
        exp = relprop.explain(model, inputs, target=1, method="transformer_attribution", keep_blocks=False)
    full = relprop.explain(model, inputs, target=1, method="transformer_attribution")
    torch.testing.assert_close(exp.scores, full.scores, rtol=1e-5, atol=1e-7)
    per_block = sum(mode.count.values()) / 2
    # per block: the forward pass without autograd 3 (scores, masked scores, softmax; the safe
    # softmax's where is the softmax), the block recomputed with autograd 3 and its backward 2 (∇A,
    # the softmax's backward; the where and its backward are the softmax's), the walk's recomputed
    # scores and masked scores 2 (the softmax is kept from the recomputed block: it is A), the rules
    # 3 (S·Vᵀ of A·V, the quotients R / z of the masked sum and of Q·Kᵀ; the sum's shares go into
    # S's buffer and into the masked scores', which are dead once the sum's rule has read them),
    # Eq. 13's map 1 (its positive part in place): 14 (the last block's per-head rows are weighted
    # one head at a time). Before the rules reused their buffers it was 46 (BERT-base at 512
    # tokens, counted the same way).
    assert per_block <= 14.0, f"{dict(mode.count)}; made at\n{_sites(mode)}"


def _safe_softmax_graph(extra_use: bool):
    """x -> s = softmax(x); a = where(cond, full_like(s, 0), s); y = a @ v (+ s·2 when
    ``extra_use``: s then feeds another differentiable op)."""
    g = torch.fx.Graph()
    x, cond, v = g.placeholder("x"), g.placeholder("cond"), g.placeholder("v")
    s = g.call_function(aten._softmax.default, (x, -1, False))
    zero = g.call_function(aten.full_like.default, (s, 0))
    a = g.call_function(aten.where.self, (cond, zero, s))
    y = g.call_function(aten.matmul.default, (a, v))
    if extra_use:
        y = g.call_function(aten.add.Tensor, (y, g.call_function(aten.mul.Tensor, (s, 2.0))))
    g.output(y)
    return g, a, y


def _grads(graph, a_node, y_node, cond, plain: bool):
    x = torch.randn(2, 5, 5, generator=torch.Generator().manual_seed(1)).requires_grad_(True)
    v = torch.randn(2, 5, 5, generator=torch.Generator().manual_seed(2))
    env = {}
    for node in graph.nodes:
        if node.op == "placeholder":
            env[node] = {"x": x, "cond": cond, "v": v}[node.target]
        elif node.op == "call_function":
            env[node] = evaluate(node, env.__getitem__, node.target if plain else None)
    ga, gx = torch.autograd.grad(env[y_node].sum(), [env[a_node], x])
    aliased = env[a_node] is env[a_node.args[2]]
    return (env[y_node].detach(), ga, gx), aliased


@pytest.mark.parametrize("extra_use", [False, True])
@pytest.mark.parametrize("masked_row", [False, True])
def test_where_of_the_safe_softmax_has_the_plain_gradients(extra_use, masked_row):
    graph, a, y = _safe_softmax_graph(extra_use)
    cond = torch.zeros(2, 5, 1, dtype=torch.bool)
    cond[1, 3] = masked_row
    want, _ = _grads(graph, a, y, cond, plain=True)
    got, aliased = _grads(graph, a, y, cond, plain=False)
    for g_, w_ in zip(got, want):
        assert torch.equal(g_, w_)
    # the where is the softmax itself only where that is exact: no masked row, no other use of s
    assert aliased == (not extra_use and not masked_row)


def _row_test_graph(c, dim, keepdim, other_reader: bool):
    """x -> any(logical_not(eq(x, c)), dim, keepdim) (the safe softmax's "row not all masked" test),
    and eq's value returned as well when ``other_reader``."""
    g = torch.fx.Graph()
    x = g.placeholder("x")
    eq = g.call_function(aten.eq.Scalar, (x, c))
    ne = g.call_function(aten.logical_not.default, (eq,))
    out = g.call_function(aten.any.dim, (ne, dim, keepdim))
    g.output((out, eq) if other_reader else out)
    return g, eq, ne, out


_MIN32 = float(torch.finfo(torch.float32).min)


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 6), cols=st.integers(1, 7), seed=st.integers(0, 2**16),
       c=st.sampled_from([_MIN32, float("-inf"), 0.0, 1.5]), dim=st.sampled_from([-1, 0, 1]),
       keepdim=st.booleans(), other_reader=st.booleans())
def test_row_test_of_the_safe_softmax_equals_the_plain_ops(rows, cols, seed, c, dim, keepdim, other_reader):
    gen = torch.Generator().manual_seed(seed)
    pool = torch.tensor([c, c, c, float("-inf"), float("nan"), -0.0, 0.0, _MIN32, 1.5, 2.0])
    x = pool[torch.randint(0, len(pool), (rows, cols), generator=gen)]
    x[torch.rand(rows, cols, generator=gen) < 0.3] = c  # rows entirely c occur often
    if seed % 3 == 0:
        x[0] = c
    graph, eq, ne, out = _row_test_graph(c, dim, keepdim, other_reader)
    env, plain = {}, {}
    for node in graph.nodes:
        if node.op == "placeholder":
            env[node] = plain[node] = x
        elif node.op == "call_function":
            env[node] = evaluate(node, env.__getitem__)
            plain[node] = node.target(*torch.fx.node.map_arg(node.args, plain.__getitem__))
    assert torch.equal(env[out], plain[out]) and env[out].dtype == torch.bool
    # deferred only where nothing else reads the comparison
    assert torch.is_tensor(env[eq]) == other_reader and torch.is_tensor(env[ne]) == other_reader
    if other_reader:
        assert torch.equal(env[eq], plain[eq]) and torch.equal(env[ne], plain[ne])


def test_folded_transformer_attribution_makes_no_attention_sized_boolean_tensor():
    tokens = 40
    model, inputs, _ = _captured_bert_sdpa(tokens)

    class _Booleans(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if torch.is_tensor(t) and t.dtype == torch.bool and t.numel() == 4 * tokens * tokens:
                    type(self).count += 1
            return out

    with _Booleans():
        exp = relprop.explain(model, inputs, target=1, method="transformer_attribution", keep_blocks=False)
    full = relprop.explain(model, inputs, target=1, method="transformer_attribution")
    torch.testing.assert_close(exp.scores, full.scores, rtol=1e-5, atol=1e-7)
    # the safe softmax's row test (eq, logical_not: two per evaluation, three evaluations per
    # block: 12 for this 2-block model) runs as one min-max reduction over the masked scores; what
    # is left is made once per call, whatever the depth: the support of the query rows
    # (relprop.methods.query.support_of) when the first block is handed to the fold
    assert _Booleans.count <= 1


@settings(max_examples=40, deadline=None)
@given(batch=st.integers(1, 3), heads=st.integers(1, 5), n=st.integers(1, 40), seed=st.integers(0, 2**16),
       kind=st.sampled_from(["one-hot", "mean", "random"]), transposed=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.float64]))
def test_weighted_rows_of_per_head_maps_equal_the_weighted_sum_bit_for_bit(batch, heads, n, seed, kind,
                                                                           transposed, dtype):
    from relprop.methods.query import weighted_rows
    gen = torch.Generator().manual_seed(seed)
    m = torch.randn(batch, heads, n, n, generator=gen, dtype=dtype)
    m = m.transpose(-1, -2) if transposed else m
    w = {"one-hot": torch.eye(n, dtype=dtype)[seed % n].expand(batch, n).clone(),
         "mean": torch.full((batch, n), 1.0 / n, dtype=dtype),
         "random": torch.rand(batch, n, generator=gen, dtype=dtype)}[kind]
    want = (w[:, None, :, None] * m).sum(-2)  # Σ_i w[b, i] · m[b, h, i, :], all heads at once
    got = weighted_rows(w, m)
    assert got.shape == (batch, heads, n) and torch.equal(got, want)
    # a fused map [batch, rows, cols] as before
    assert torch.equal(weighted_rows(w, m[:, 0]), (w[:, :, None] * m[:, 0]).sum(-2))


@pytest.mark.parametrize("memory", ["default", "low"])
def test_a_sum_writes_into_its_output_only_when_the_walk_says_it_is_dead(monkeypatch, memory):
    import models
    import relprop.rules.residual as residual
    calls = []
    plain = residual.z_rule_sum

    def spy(u, v, z, relevance, eps, z_writable=False):
        before = z.clone()
        out = plain(u, v, z, relevance, eps, z_writable)
        calls.append((z_writable, z_writable or torch.equal(before, z)))  # z changed only if writable
        return out

    monkeypatch.setattr(residual, "z_rule_sum", spy)
    model, inputs, _ = _captured_bert_sdpa()
    relprop.explain(model, inputs, target=1, method="transformer_attribution", keep_blocks=False)
    assert calls and all(ok for _, ok in calls) and any(w for w, _ in calls)
    # HF ViT returning its hidden states: the residual sums it returns are never written into
    calls.clear()
    vit = models.hf_vit()
    x = models.image_batch(vit, batch=1)
    with torch.no_grad():
        own = vit(pixel_values=x, output_hidden_states=True).hidden_states
    exp = relprop.explain(vit, {"pixel_values": x, "output_hidden_states": True}, target=1,
                          method="transformer_attribution", memory=memory)
    returned = [n for n in CACHE.get(vit, bind_inputs(vit, {"pixel_values": x, "output_hidden_states": True}))
                .graph.nodes if n.target is aten.add.Tensor and n.users and any(u.op == "output" for u in n.users)]
    assert returned, "HF ViT returns residual sums as hidden states"
    for mine, theirs in zip(exp.outputs.hidden_states, own):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
    assert any(not w for w, _ in calls) and any(w for w, _ in calls)


def test_shares_memory_sees_views_and_nothing_else():
    from relprop.graph.aliasing import shares_memory
    t = torch.randn(3, 4)
    assert shares_memory(t, t) and shares_memory(t, t[1:]) and shares_memory(t[1:], t.t())
    assert shares_memory(t, None, 2.0, torch.randn(2), t.view(-1))
    assert not shares_memory(t, t.clone(), torch.randn(3, 4), None)
    assert not shares_memory(None, t) and not shares_memory(t)


def test_kept_storages_count_an_address_only_while_its_storage_lives():
    """The values no rule may overwrite are known by their storages, weakly: a view of a kept value is
    held, a new tensor given a freed value's address is not (``torch.frombuffer`` twice over one buffer is
    that case made on purpose: two storages, one after the other, at one address). Gathered as plain
    addresses, whether a rule could write into the new tensor depended on where the allocator put it."""
    from relprop.graph.aliasing import KeptStorages, storage_of
    buf = bytearray(4 * 64)
    first = torch.frombuffer(buf, dtype=torch.float32)
    other = torch.randn(8)
    kept = KeptStorages([first, None, 3.0, other])
    assert kept.holds(first) and kept.holds(first[5:].view(-1, 1)) and kept.holds(other)
    assert not kept.holds(torch.randn(64)) and not kept.holds(None)
    address = storage_of(first)
    del first
    second = torch.frombuffer(buf, dtype=torch.float32)
    assert storage_of(second) == address and not kept.holds(second)
