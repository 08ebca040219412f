"""The fused segment walk (relprop.engine.fused_segment, relprop.engine.chunk_gradients), the skipped
chunks without relevance (relprop.engine.chunked_walk) and the linear rules on the positions with
relevance (relprop.rules.stabilize.on_relevant_rows): each new path gives the numbers of the path it
replaces (float64, so that the comparison is not float32 rounding)."""

import pytest
import torch

import models
import relprop
from fused_cases import aten, batch as _batch, close as _close, model as _model, refuse_deferral, same as _same
from relprop.engine import chunk_gradients, chunked_walk, fused_segment, low_memory
from relprop.rules import stabilize
from relprop.rules.context import RuleContext
from relprop.rules.linear import alpha1_beta0
from relprop.rules.rule_registry import lookup


RUNS = [("transformer_attribution", "chefer2021"), ("transformer_attribution", "attnlrp"), ("gradient_rollout", None)]
SEGMENT_CASES = {"llama_sdpa": ("llama_sdpa", (7, 5, 9)), "llama_eager": ("llama_eager", (7, 5, 9)),
                 "bert_eager": ("bert_eager", (7, 5, 9)), "llama_sdpa_two": ("llama_sdpa", (8, 5))}


def _explain(name, lengths, method, preset, seed=0, fused=True):
    kw = {} if preset is None else {"preset": preset}
    tuning = relprop.Tuning(chunks=relprop.RowChunks(rows=3), fused_segment=fused)
    return relprop.explain(_model(name), _batch(name, lengths, seed), method=method, keep_blocks=False, tuning=tuning,
                           **kw)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("case", sorted(SEGMENT_CASES))
@pytest.mark.parametrize("method,preset", RUNS)
def test_fused_segment_walk_equals_two_passes(case, method, preset, monkeypatch):
    """Tuning.fused_segment True (each segment's core walked with its backward pass, each chunk computed
    once) and False (the backward pass, then the walk) give the same scores, head rows, input
    relevance and ledger, chunks of 3 rows, float64; BERT with padding, LLaMA with a batch of three and of
    two samples. The fused walk runs once per block where there is a relevance walk; gradient_rollout
    walks no relevance, so both settings take the two-pass path there."""
    name, lengths = SEGMENT_CASES[case]
    walks = []
    call = fused_segment.SegmentWalk.__call__
    monkeypatch.setattr(fused_segment.SegmentWalk, "__call__", lambda self, *a: walks.append(1) or call(self, *a))
    runs = []
    for fused in (True, False):
        walks.clear()
        runs.append(_explain(name, lengths, method, preset, seed=1 if case.endswith("two") else 0, fused=fused))
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


def test_rows_with_relevance_are_those_with_an_entry_other_than_zero():
    """on_relevant_rows and on_nonzero_rows find the rows by their max and min: a row counts where it
    has a negative entry only, a positive one, or a NaN; a row of +0 and -0 does not."""
    nan = float("nan")
    r = torch.zeros(80, 3)
    r[3, 1], r[7, 0], r[11, 2] = -2.0, 5.0, nan
    r[13], r[17, 0] = -0.0, -0.0
    seen = []

    def twice(rows):
        seen.append(rows.shape[0])
        return rows * 2
    out = stabilize.on_relevant_rows(twice, r)
    assert seen == [3]
    assert torch.equal(out[[3, 7]], r[[3, 7]] * 2) and torch.isnan(out[11, 2])
    wide = torch.zeros(4, stabilize.SPARSE_ROW)
    wide[2, 5], wide[1] = -1.0, -0.0
    seen.clear()
    out = stabilize.on_nonzero_rows(twice, wide)
    assert seen == [1] and torch.equal(out, wide * 2)


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
    """LLaMA explained at each sample's last position (lengths 12 and 11: rows 11 and 10), chunks of 3 rows:
    in the block next to the output only the product's rows 9:12 have relevance, and the rules of the
    core run on chunk 0:3 (the first chunk is always walked) and 9:12 only; the first block's core is
    walked on all four chunks. Scores, head rows, input relevance and ledger equal those of the whole
    path (keep_blocks=True), float64, to 1e-9, with the fused segment walk and without it, and on the
    counting path (chefer2021's normalization not deferred: refused after the first chunk's rules)."""
    model = _model("llama_sdpa")
    batch = models.decoder_batch(lengths=(12, 11))
    whole = relprop.explain(model, batch, method="transformer_attribution", preset=preset, keep_blocks=True)
    tuning = relprop.Tuning(chunks=relprop.RowChunks(rows=3), fused_segment=fused)
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
        refuse_deferral(monkeypatch)
    monkeypatch.setattr(chunked_walk, "_walk_chunks", spy_walk)
    monkeypatch.setattr(chunked_walk, "_rule", spy_rule)
    got = relprop.explain(model, batch, method="transformer_attribution", preset=preset, keep_blocks=False,
                          tuning=tuning)
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



# ------------------------------------------------------------------ f. the first backward pass's graph

@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("name,meet", [("hf_phi", True), ("hf_gpt_neox", False), ("hf_mistral", False)])
def test_the_first_pass_frees_its_graph_unless_the_paths_meet(name, meet, monkeypatch):
    """The segment's first backward pass (outputs to the core's output and the inputs) keeps its graph
    for the second (the core's operands on) only where a node lies on both paths: Phi's parallel block
    reads one LayerNorm's output in its attention and its MLP; GPT-NeoX's parallel residual has a
    LayerNorm for each; Mistral's blocks are sequential. Fused and two-pass walks give the same numbers
    (float64, chunks of 3 rows): a graph freed too early would raise in the second pass."""
    import zoo
    torch.manual_seed(0)
    model = getattr(zoo, name)().double().eval()
    batch = models.decoder_batch(lengths=(7, 9))
    seen = []
    meets = low_memory._paths_meet
    monkeypatch.setattr(low_memory, "_paths_meet", lambda *a: seen.append(meets(*a)) or seen[-1])
    runs = []
    for fused in (True, False):
        tuning = relprop.Tuning(chunks=relprop.RowChunks(rows=3), fused_segment=fused)
        runs.append(relprop.explain(model, batch, method="transformer_attribution", keep_blocks=False, tuning=tuning))
    assert seen and set(seen) == {meet}
    _same(*runs, name)
