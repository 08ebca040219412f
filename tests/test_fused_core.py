"""The fused attention core (relprop.graph.fused_attention), the chunks of rows with an open key
(relprop.graph.key_bounds.rows_open), the fused segment walk (relprop.engine.fused_segment,
relprop.engine.chunk_gradients), the skipped chunks without relevance (relprop.engine.chunked_walk)
and the linear rules on the positions with relevance (relprop.rules.stabilize.on_relevant_rows): each
new path gives the numbers of the path it replaces (float64, so that the comparison is not float32
rounding)."""
import dataclasses
import functools

import pytest
import torch

import models
import relprop
from relprop.engine import chunk_gradients, chunked_core, chunked_walk, deferred_shares, fused_segment, low_memory
from relprop.engine.chunked_walk import plan_cores
from relprop.graph.attention_core import evaluate_rows
from relprop.graph.capture import CACHE
from relprop.graph.fused_attention import sdpa_form, sdpa_rows
from relprop.graph.inputs import bind_inputs
from relprop.graph.key_bounds import additive_mask, key_bounds, rows_open
from relprop.rules import stabilize
from relprop.rules.context import RuleContext
from relprop.rules.linear import alpha1_beta0
from relprop.rules.rule_registry import lookup

aten = torch.ops.aten
F64_MIN = torch.finfo(torch.float64).min

BUILDERS = {f"{name}_{attn}": functools.partial(build, attn) for name, build in
            (("llama", models.hf_llama), ("gpt2", models.hf_gpt2_lm), ("bert", models.hf_bert))
            for attn in ("sdpa", "eager")}


@functools.lru_cache(maxsize=None)
def _model(name, double=True):
    model = BUILDERS[name]()
    return model.double() if double else model


def _batch(name, lengths=(7, 5, 9), seed=0):
    return (models.text_batch if name.startswith("bert") else models.decoder_batch)(lengths=lengths, seed=seed)


def _cores(name, double=True):
    model = _model(name, double)
    kwargs = bind_inputs(model, _batch(name))
    if "use_cache" in model.forward.__code__.co_varnames:
        kwargs["use_cache"] = False
    return [c for c, _ in plan_cores(CACHE.get(model, kwargs).analysis).values()]


def _close(a, b, what, tol):
    if a is None or b is None:
        assert a is None and b is None, what
        return
    err = float((a - b).abs().max() / b.abs().max().clamp_min(1e-300)) if b.numel() else 0.0
    assert err <= tol, f"{what}: {err}"


def _same(got, ref, what, tol=1e-12):
    """Scores, head rows, input relevance and every figure of the ledger agree to ``tol``."""
    for field in ("scores", "heads", "input_relevance"):
        _close(getattr(got, field), getattr(ref, field), f"{what} {field}", tol)
    c, w = got.conservation, ref.conservation
    assert (c is None) == (w is None), what
    if w is None:
        return
    scale = w.injected.abs().max()
    for field in ("injected", "input", "absorbed"):
        assert float((getattr(c, field) - getattr(w, field)).abs().max() / scale) <= tol, f"{what} {field}"
    assert set(c.absorbed_by) == set(w.absorbed_by), what
    for label, v in w.absorbed_by.items():
        assert float((c.absorbed_by[label] - v).abs().max() / scale) <= tol, f"{what} absorbed by {label}"
    for b, wb in zip(c.blocks, w.blocks, strict=True):
        for field in ("relevance_in", "relevance_out", "absorbed"):
            _close(getattr(b, field), getattr(wb, field), f"{what} block {b.name} {field}", tol)


# ------------------------------------------------------------------ a. recognition

@pytest.mark.parametrize("name,double,scale", [
    ("llama_sdpa", False, 1.0), ("llama_sdpa", True, 1.0), ("llama_eager", False, 8 ** -0.5),
    ("llama_eager", True, None), ("gpt2_sdpa", False, 1.0), ("gpt2_eager", False, 8 ** -0.5),
    ("gpt2_eager", True, 8 ** -0.5), ("bert_eager", False, 8 ** -0.5), ("bert_sdpa", False, 1.0)])
def test_sdpa_form_recognizes_the_cores_of_the_tiny_models(name, double, scale):
    """Every core of the tiny models is softmax(Q·Kᵀ·s + M)·V with M the additive mask, except
    LLaMA eager in float64: its softmax runs in float32 (``softmax(..., dtype=torch.float32)``, then a
    cast back), which a fused float64 kernel would not reproduce, so the form is None (None is what
    ``scale`` says). An sdpa model's graph decomposes SDPA with Q and Kᵀ each scaled by √s before the
    product, outside the core: its form has s = 1; an eager model's has 1/√8 (head size 8). The
    sdpa cores hold the decomposed safe softmax's row test, the eager ones none."""
    cores = _cores(name, double)
    assert len(cores) == 2
    for core in cores:
        form = sdpa_form(core)
        print(name, double, [str(n.target) for n in core.nodes], form)
        assert sdpa_form(core) is form  # (memoized on the product node)
        if scale is None:
            assert form is None
            assert any(n.target is aten._to_copy.default for n in core.nodes)
            continue
        assert form is not None
        assert (form.q, form.kt, form.v) == (core.nodes[0].args[0], core.nodes[0].args[1], core.nodes[-1].args[1])
        assert form.mask is additive_mask(core) and form.mask is not None
        assert form.scale == pytest.approx(scale, rel=1e-12)
        assert any(n.target is aten.where.self for n in core.nodes) == name.endswith("sdpa")


# ------------------------------------------------------------------ b. sdpa_rows on random operands

B, H, N, D = 2, 4, 9, 8
CHUNKS = [(0, 3), (3, 6), (6, 9), (4, 5)]


def _causal(closed=F64_MIN):
    return torch.zeros(1, 1, N, N, dtype=torch.float64).masked_fill(torch.ones(N, N, dtype=torch.bool).triu(1), closed)


def _masks(kind):
    """The mask's values: causal (finfo.min or -inf), a finite ALiBi-like bias per head (every key
    open), padding broadcast over the query rows ([batch, 1, 1, keys]: keys 6: and 8: closed)."""
    i = torch.arange(N, dtype=torch.float64)
    return {"causal_min": lambda: _causal().expand(B, 1, N, N),
            "causal_inf": lambda: _causal(float("-inf")).expand(B, 1, N, N),
            "alibi": lambda: -torch.arange(1.0, H + 1, dtype=torch.float64).view(1, H, 1, 1) * (i.view(N, 1) - i).abs(),
            "padding": lambda: torch.zeros(B, 1, 1, N, dtype=torch.float64).masked_fill(
                i >= torch.tensor([6.0, 8.0], dtype=torch.float64).view(B, 1, 1, 1), F64_MIN)}[kind]()


def _operands(core, mask, seed=0):
    form = sdpa_form(core)
    g = torch.Generator().manual_seed(seed)
    q, kt, v = (torch.randn(*s, generator=g, dtype=torch.float64) for s in ((B, H, N, D), (B, H, D, N), (B, H, N, D)))
    return {form.q: q, form.kt: kt, form.v: v, form.mask: mask}


@pytest.mark.parametrize("kind", ["causal_min", "causal_inf", "alibi", "padding"])
@pytest.mark.parametrize("name", ["llama_sdpa", "gpt2_eager"])
def test_sdpa_rows_equal_the_node_by_node_chunk(name, kind):
    """sdpa_rows equals evaluate_rows' A·V on each chunk and its keys (those key_bounds keeps: cut on a
    causal mask, all on ALiBi, the last open one on padding). LLaMA sdpa's core has the safe softmax
    and s = 1, GPT-2 eager's none and s = 1/√8. The padding mask ([B, 1, 1, keys]) is read whole: the
    core is given with the mask moved from its split operands to its whole ones."""
    core = _cores(name)[0]
    mask = _masks(kind)
    form = sdpa_form(core)
    if kind == "padding":
        core = dataclasses.replace(core, rows=tuple(n for n in core.rows if n is not form.mask),
                                   whole=core.whole + (form.mask,))
    values = _operands(core, mask).__getitem__
    bounds = key_bounds(core, values, CHUNKS)
    expected = {"causal_min": [3, 6, 9, 5], "causal_inf": [3, 6, 9, 5], "alibi": [N] * 4, "padding": [8] * 4}
    assert bounds == expected[kind]
    assert rows_open(core, values, CHUNKS) == [True] * len(CHUNKS)
    for (lo, hi), kept in zip(CHUNKS, bounds):
        got = sdpa_rows(form, core, values, lo, hi, (kept, N))
        ref = evaluate_rows(core, values, lo, hi, keys=(kept, N))[core.nodes[-1]]
        assert got is not None and got.shape == ref.shape == (B, H, hi - lo, D)
        _close(got, ref, f"{name} {kind} rows {lo}:{hi}", 1e-12)


@pytest.mark.parametrize("name", ["llama_sdpa", "gpt2_eager"])
def test_a_chunk_with_a_fully_masked_row_is_evaluated_node_by_node(name, monkeypatch):
    """Row 4 of sample 1 has no open key: rows_open is False for the chunks that hold it only, and
    core_forward evaluates those node by node (sdpa_rows is not called on them), so its output equals
    the node-by-node evaluation: 0 on that row under LLaMA's decomposed safe softmax (where the fused
    kernel gives the mean of V, uniform weights)."""
    core = _cores(name)[0]
    mask = _causal().expand(B, 1, N, N).clone()
    mask[1, 0, 4, :] = F64_MIN
    values = _operands(core, mask).__getitem__
    assert rows_open(core, values, CHUNKS) == [True, False, True, False]
    fused = []
    spied = chunked_core.sdpa_rows
    monkeypatch.setattr(chunked_core, "sdpa_rows", lambda *a: fused.append(a[3:5]) or spied(*a))
    monkeypatch.setattr(chunked_core, "FUSED_FORWARD", True)
    out = chunked_core.core_forward(core, values, 3)
    assert fused == [(0, 3), (6, 9)]
    ref = evaluate_rows(core, values, 0, N)[core.nodes[-1]]
    _close(out, ref, name, 1e-12)
    if name == "llama_sdpa":
        assert bool((out[1, :, 4] == 0).all())
        kernel = sdpa_rows(sdpa_form(core), core, values, 3, 6, (N, N))
        assert float(kernel[1, :, 1].abs().max()) > 1e-3  # (what fusing that chunk would have given)


class _ScalarBias(torch.nn.Module):
    """A residual self-attention block whose scores get a Python number added before the softmax: the
    graph holds aten.add.Tensor(scores, 1.0) (a number, not an operand node)."""

    def __init__(self, d=8):
        super().__init__()
        self.qkv, self.o = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, 2, d // 2).permute(2, 0, 3, 1, 4)
        a = torch.softmax(q @ k.transpose(-1, -2) * 0.5 + 1.0, -1)
        return x + self.o((a @ v).transpose(1, 2).reshape(b, n, d))


class _First(torch.nn.Module):
    def forward(self, x):
        return x[:, 0]


def test_a_number_added_to_the_scores_is_not_a_mask_operand(monkeypatch):
    """softmax(Q·Kᵀ·s + 1.0)·V: the number is no operand from outside the core. sdpa_form must not
    take it for the mask (a form whose mask is 1.0, not a node, sends core_forward's sdpa_rows to
    value(1.0): KeyError), and a folded run gives the numbers of the node-by-node forward pass."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), _ScalarBias(), _ScalarBias(), _First(),
                                torch.nn.Linear(8, 3)).eval().double()
    x = torch.randn(2, 9, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    monkeypatch.setattr(chunked_core, "ROW_CHUNK", 3)
    runs = []
    for on in (False, True):
        monkeypatch.setattr(chunked_core, "FUSED_FORWARD", on)
        runs.append(relprop.explain(model, x, method="transformer_attribution", keep_blocks=False))
    _same(runs[1], runs[0], "a number added to the scores")
    for core, _ in plan_cores(CACHE.get(model, bind_inputs(model, x)).analysis).values():
        form = sdpa_form(core)
        assert form is None or form.mask is None or isinstance(form.mask, torch.fx.Node), form


def test_sdpa_rows_refuses_operands_the_kernel_does_not_take():
    """A mask of another dtype than Q, a boolean mask, half-precision operands: None (node by node)."""
    core = _cores("llama_sdpa")[0]
    form = sdpa_form(core)
    ops = _operands(core, _causal().expand(B, 1, N, N))
    assert sdpa_rows(form, core, ops.__getitem__, 0, 3, (3, N)) is not None
    for change in ({form.mask: ops[form.mask].float()}, {form.mask: ops[form.mask] == 0},
                   {n: ops[n].half() for n in (form.q, form.kt, form.v)}):
        assert sdpa_rows(form, core, {**ops, **change}.__getitem__, 0, 3, (3, N)) is None


# ------------------------------------------------------------------ c. the fused forward pass

def _left_padded(lengths=(9, 8, 9)):
    batch = models.decoder_batch(lengths=lengths)
    ids, mask = batch["input_ids"].clone(), batch["attention_mask"].clone()
    for i, n in enumerate(lengths):  # each row's tokens moved to its end
        ids[i], mask[i] = torch.roll(ids[i], N - n), torch.roll(mask[i], N - n)
    return {"input_ids": ids, "attention_mask": mask}


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("padding", ["right", "left"])
def test_core_forward_fused_equals_node_by_node(padding, monkeypatch):
    """LLaMA sdpa (float64), ROW_CHUNK=3: each call of core_forward in the folded run gives the same
    A·V with FUSED_FORWARD True and False (to 1e-12), and so does the whole explanation. With left
    padding sample 1's first row is a padding query with no open key: chunk 0:3 of every core is
    evaluated node by node, the others by the kernel; with right padding every chunk is fused."""
    model = _model("llama_sdpa")
    batch = _left_padded() if padding == "left" else models.decoder_batch(lengths=(7, 5, 9))
    monkeypatch.setattr(chunked_core, "ROW_CHUNK", 3)
    forward, spied = chunked_core.core_forward, chunked_core.sdpa_rows
    fused, compared = [], []

    def both(core, value, chunk, compute=None):
        monkeypatch.setattr(chunked_core, "FUSED_FORWARD", False)
        ref = forward(core, value, chunk, compute)
        monkeypatch.setattr(chunked_core, "FUSED_FORWARD", True)
        got = forward(core, value, chunk, compute)
        _close(got, ref, f"core {core.block}", 1e-12)
        compared.append(core.block)
        return got

    monkeypatch.setattr(chunked_core, "sdpa_rows", lambda *a: fused.append(a[3]) or spied(*a))
    monkeypatch.setattr(chunked_core, "core_forward", both)
    relprop.explain(model, batch, method="transformer_attribution", keep_blocks=False)
    assert sorted(set(compared)) == [0, 1]
    assert sorted(set(fused)) == ([3, 6] if padding == "left" else [0, 3, 6])
    monkeypatch.setattr(chunked_core, "core_forward", forward)
    runs = []
    for on in (True, False):
        monkeypatch.setattr(chunked_core, "FUSED_FORWARD", on)
        runs.append(relprop.explain(model, batch, method="transformer_attribution", keep_blocks=False))
    _same(*runs, f"{padding} padding")


# ------------------------------------------------------------------ d. the fused segment walk

RUNS = [("transformer_attribution", "chefer2021"), ("transformer_attribution", "attnlrp"), ("gradient_rollout", None)]
SEGMENT_CASES = {"llama_sdpa": ("llama_sdpa", (7, 5, 9)), "llama_eager": ("llama_eager", (7, 5, 9)),
                 "bert_eager": ("bert_eager", (7, 5, 9)), "llama_sdpa_two": ("llama_sdpa", (8, 5))}


def _explain(name, lengths, method, preset, seed=0):
    kw = {} if preset is None else {"preset": preset}
    return relprop.explain(_model(name), _batch(name, lengths, seed), method=method, keep_blocks=False, **kw)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("case", sorted(SEGMENT_CASES))
@pytest.mark.parametrize("method,preset", RUNS)
def test_fused_segment_walk_equals_two_passes(case, method, preset, monkeypatch):
    """low_memory.FUSED True (each segment's core walked with its backward pass, each chunk computed
    once) and False (the backward pass, then the walk) give the same scores, head rows, input
    relevance and ledger, ROW_CHUNK=3, float64; BERT with padding, LLaMA with a batch of three and of
    two samples. The fused walk runs once per block where there is a relevance walk; gradient_rollout
    walks no relevance, so both settings take the two-pass path there."""
    name, lengths = SEGMENT_CASES[case]
    monkeypatch.setattr(chunked_core, "ROW_CHUNK", 3)
    walks = []
    call = fused_segment.SegmentWalk.__call__
    monkeypatch.setattr(fused_segment.SegmentWalk, "__call__", lambda self, *a: walks.append(1) or call(self, *a))
    runs = []
    for fused in (True, False):
        monkeypatch.setattr(low_memory, "FUSED", fused)
        walks.clear()
        runs.append(_explain(name, lengths, method, preset, seed=1 if case.endswith("two") else 0))
        assert len(walks) == (2 if fused and method == "transformer_attribution" else 0), fused
    _same(*runs, f"{case} {method} {preset}")


# ------------------------------------------------------------------ e. linear rules on the relevant rows

def _row_fn(seen):
    """A map of each position's row to a row, zero for a zero relevance row; records the rows it gets."""
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(6, 5, generator=g, dtype=torch.float64), torch.randn(4, 5, generator=g, dtype=torch.float64)

    def fn(r, x):
        seen.append(r.shape[:-1].numel())
        return (r @ a) * (x @ b).tanh()
    return fn


@pytest.mark.parametrize("relevant,positions,sparse", [
    (5, 100, True), (50, 100, True), (51, 100, False), (0, 100, True), (3, 63, False), (3, 64, True)])
def test_on_relevant_rows_equals_fn_on_everything(relevant, positions, sparse):
    """on_relevant_rows(fn, R, x) equals fn(R, x) (to float rounding), gives exact zeros on the
    positions without relevance, and computes fn on the relevant positions only when there are at
    least RELEVANT_ROWS positions and at most half of them have relevance (else on everything)."""
    assert stabilize.RELEVANT_ROWS == 64
    g = torch.Generator().manual_seed(positions + relevant)
    shape = (2, positions // 2) if positions % 2 == 0 else (positions,)
    x = torch.randn(*shape, 4, generator=g, dtype=torch.float64)
    r = torch.zeros(*shape, 6, dtype=torch.float64)
    flat = r.view(-1, 6)
    chosen = torch.randperm(positions, generator=g)[:relevant]
    flat[chosen] = torch.randn(relevant, 6, generator=g, dtype=torch.float64)
    flat[chosen[:1], 1:] = 0  # (a row with one nonzero entry has relevance)
    seen = []
    got = stabilize.on_relevant_rows(_row_fn(seen), r, x)
    assert seen == [relevant if sparse else positions]
    ref = _row_fn([])(r, x)
    assert got.shape == ref.shape == shape + (5,)
    _close(got, ref, "on_relevant_rows", 1e-12)
    others = torch.ones(positions, dtype=torch.bool)
    others[chosen] = False
    assert bool((got.reshape(-1, 5)[others] == 0).all())


@pytest.mark.parametrize("bias", [False, True])
def test_chefer2021_linear_rule_on_sparse_relevance_equals_alpha1_beta0(bias, monkeypatch):
    """chefer2021's aten.linear rule on relevance at 3 of 2×40 positions equals alpha1_beta0 on
    everything (float64, to 1e-12) and computes the rule on those 3 rows only."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 40, 16, generator=g, dtype=torch.float64)
    weight = torch.randn(7, 16, generator=g, dtype=torch.float64)
    b = torch.randn(7, generator=g, dtype=torch.float64) if bias else None
    r = torch.zeros(2, 40, 7, dtype=torch.float64)
    r[0, 39], r[1, 12], r[1, 39] = (torch.randn(7, generator=g, dtype=torch.float64) for _ in range(3))
    args = (x, weight, b) if bias else (x, weight)
    node = torch.fx.Graph().call_function(aten.linear.default, ())
    ctx = RuleContext(node=node, args=args, kwargs={}, out=torch.nn.functional.linear(x, weight, b),
                      live=(True, False, False)[:len(args)], batch_dim=0, batch_size=2, eps=1e-9, preset="chefer2021")
    rows = []
    monkeypatch.setattr("relprop.rules.linear.alpha1_beta0",
                        lambda xs, *a, **k: rows.append(xs.shape[:-1].numel()) or alpha1_beta0(xs, *a, **k))
    got = lookup("chefer2021", aten.linear.default)(ctx, r)[0]
    assert rows == [3]
    ref = alpha1_beta0(x, weight.t(), r, 1e-9)
    _close(got, ref, "linear rule", 1e-12)
    assert bool((got[0, :39] == 0).all()) and bool((got[1, 13:39] == 0).all())


# ------------------------------------------------------------------ f. chunks without relevance skipped

@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("preset,counting", [("chefer2021", False), ("chefer2021", True), ("attnlrp", False)])
def test_chunks_without_relevance_are_not_walked(preset, counting, fused, monkeypatch):
    """LLaMA explained at each sample's last position (lengths 12 and 11: rows 11 and 10), ROW_CHUNK=3:
    in the block next to the output only the product's rows 9:12 have relevance, and the rules of the
    core run on chunk 0:3 (the first chunk is always walked) and 9:12 only; the first block's core is
    walked on all four chunks. Scores, head rows, input relevance and ledger equal those of the whole
    path (keep_blocks=True), float64, to 1e-9, with the fused segment walk and without it, and on the
    counting path (chefer2021's normalization not deferred: refused after the first chunk's rules)."""
    model = _model("llama_sdpa")
    batch = models.decoder_batch(lengths=(12, 11))
    whole = relprop.explain(model, batch, method="transformer_attribution", preset=preset, keep_blocks=True)
    monkeypatch.setattr(chunked_core, "ROW_CHUNK", 3)
    monkeypatch.setattr(low_memory, "FUSED", fused)
    walk_chunks, rule = chunked_walk._walk_chunks, chunked_walk._rule
    current, walked = [], {}

    def spy_walk(walker, r, core, *a, **k):
        current.append(core)
        walked.setdefault(core.block, [])
        return walk_chunks(walker, r, core, *a, **k)

    def spy_rule(walker, node, r, *a, **k):
        if node is current[-1].nodes[-1]:
            if not a[2]:  # (not a counting pass)
                walked[current[-1].block].append((bool(r.any()), r.shape[-2]))
        return rule(walker, node, r, *a, **k)

    if counting:
        done = deferred_shares.Deferral.chunk_done

        def refuse(self):
            done(self)
            if self.node is not None:
                self.cannot("refused by the test")
        monkeypatch.setattr(deferred_shares.Deferral, "chunk_done", refuse)
    monkeypatch.setattr(chunked_walk, "_walk_chunks", spy_walk)
    monkeypatch.setattr(chunked_walk, "_rule", spy_rule)
    got = relprop.explain(model, batch, method="transformer_attribution", preset=preset, keep_blocks=False)
    assert got.kept_blocks is False and whole.kept_blocks is True
    if counting:  # (the refused deferred attempt walks chunk 0:3 first; the counting passes walk every chunk)
        walked = {b: w[-4:] if b == 0 else w[1:] for b, w in walked.items()}
    assert walked == {1: [(False, 3), (True, 3)], 0: [(True, 3)] * 4}
    _same(got, whole, f"{preset} fused={fused}", 1e-9)


# ------------------------------------------------------------------ g. the product's backward by hand

@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("name", ["llama_sdpa", "bert_eager"])
@pytest.mark.parametrize("preset", ["chefer2021", "attnlrp"])
def test_product_by_hand_equals_autograd(name, preset, monkeypatch):
    """ChunkGradients._by_hand (dA = dO·Vᵀ, ∇V = Aᵀ·dO, A·V read from the forward pass) gives the
    operands' gradients (what each fused segment walk returns) and the explanation of the autograd
    path (_product_by_hand False), float64, to 1e-10."""
    monkeypatch.setattr(chunked_core, "ROW_CHUNK", 3)
    by_hand = []
    hand = chunk_gradients.ChunkGradients._by_hand
    monkeypatch.setattr(chunk_gradients.ChunkGradients, "_by_hand",
                        lambda self, *a: by_hand.append(1) or hand(self, *a))
    call = fused_segment.SegmentWalk.__call__
    grads = []

    def record(self, senv, grad):
        out = call(self, senv, grad)
        grads.append({n.name: g.clone() for n, g in out.items()})
        return out

    monkeypatch.setattr(fused_segment.SegmentWalk, "__call__", record)
    runs, logs = [], []
    for use in (True, False):
        if not use:
            monkeypatch.setattr(chunk_gradients, "_product_by_hand", lambda *a: False)
        by_hand.clear()
        grads.clear()
        runs.append(_explain(name, (7, 5, 9), "transformer_attribution", preset))
        logs.append(list(grads))
        assert bool(by_hand) == use
    assert len(logs[0]) == len(logs[1]) == 2
    for got, ref in zip(*logs):
        assert set(got) == set(ref) and len(ref) >= 3
        for n in ref:
            _close(got[n], ref[n], f"gradient at {n}", 1e-10)
    _same(*runs, f"{name} {preset}", 1e-10)
