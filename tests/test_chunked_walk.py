"""The row-chunked walk (relprop.engine.chunked_walk, a schedule with cores in chunks of rows):
a folded run whose attention cores are evaluated, differentiated and walked in chunks of query rows
gives the numbers of the folded run with whole cores (scores, head rows, the ledger, the input
relevance) for chunks of 1 row, 3 rows and all rows, on LLaMA, GPT-2 and BERT (padded batches, so
chefer2021's Lemma-2 normalization of the mask's sum sees non-zero masks). chefer2021's normalization
is deferred: one pass over the chunks, its per-sample factors applied once every chunk is walked
(relprop.engine.deferred_shares), or the counting path where the walk cannot defer."""
import pytest
import torch

import models
import relprop
import zoo
from fused_cases import refuse_deferral
from chunking import rows
from relprop.engine import chunk_gradients, chunked_walk, deferred_shares
from relprop.engine.chunked_walk import plan_cores
from relprop.graph.capture import CACHE
from relprop.graph.inputs import bind_inputs

CASES = {
    "hf_llama_eager": lambda: (models.hf_llama("eager"), models.decoder_batch(lengths=(7, 5, 9))),
    "hf_gpt2_lm": lambda: (models.hf_gpt2_lm("sdpa"), models.decoder_batch(lengths=(7, 5, 9))),
    "hf_bert_eager": lambda: (models.TEXT["hf_bert_eager"](), models.text_batch(lengths=(7, 5, 9))),
}
RUNS = [("transformer_attribution", "chefer2021"), ("gradient_rollout", None), ("transformer_attribution", "attnlrp"),
        ("ta_without_gradient", "chefer2021")]


def _explain(model, batch, method, preset, n):
    kw = {} if preset is None else {"preset": preset}
    return relprop.explain(model, batch, method=method, keep_blocks=False, tuning=rows(n), **kw)


def _close(a, b, what, tol=1e-5):
    if a is None or b is None:
        assert a is None and b is None, what
        return
    scale = b.abs().max().clamp_min(1e-30)
    assert float((a - b).abs().max() / scale) <= tol, what


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_block_of_the_zoo_models_has_a_row_local_core(name):
    model, batch = CASES[name]()
    kwargs = bind_inputs(model, batch)
    if "use_cache" in model.forward.__code__.co_varnames:
        kwargs["use_cache"] = False
    a = CACHE.get(model, kwargs).analysis
    cores = plan_cores(a)
    assert sorted(b.index for _, b in cores.values()) == [b.index for b in a.blocks]


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("method,preset", RUNS)
def test_row_chunked_walk_equals_the_whole_cores(name, method, preset):
    """In float64, so that the comparison shows the same sums and not float32 rounding: chunks change
    the order of the sums over the keys and the rows, and chefer2021's relevance of a random tiny
    model cancels enough that float32 rounding reaches 3e-5 of its largest score on some CPUs (AVX-512),
    where float64 agrees to 4e-14 (LLaMA to models.LLAMA_FLOAT64_AGREEMENT: its norms and softmax stay float32)."""
    model, batch = CASES[name]()
    model = model.double()
    whole = _explain(model, batch, method, preset, None)
    tol = models.LLAMA_FLOAT64_AGREEMENT if name == "hf_llama_eager" else 1e-9  # (its float32 norms and softmax)
    for n in (1, 3, 10 ** 6):
        got = _explain(model, batch, method, preset, n)
        what = f"{name} {method} {preset} rows={n}"
        assert got.kept_blocks is False and whole.kept_blocks is False
        _close(got.scores, whole.scores, what + " scores", tol)
        _close(got.heads, whole.heads, what + " heads", tol)
        _close(got.input_relevance, whole.input_relevance, what + " input relevance", tol)
        if whole.conservation is not None:
            for field in ("injected", "input", "absorbed"):
                _close(getattr(got.conservation, field), getattr(whole.conservation, field), f"{what} {field}", tol)
            assert set(got.conservation.absorbed_by) == set(whole.conservation.absorbed_by), what
            for label, v in whole.conservation.absorbed_by.items():
                _close(got.conservation.absorbed_by[label], v, f"{what} absorbed by {label}", tol)


@pytest.mark.parametrize("name,method,options", [
    ("hf_bert_eager", "gradient_rollout", {"query": "mean"}),  # the first block is gathered whole
    ("hf_llama_eager", "transformer_attribution", {"end_block": 1}),  # the range ends before the first block
])
def test_row_chunked_walk_with_options_equals_the_whole_cores(name, method, options):
    model, batch = CASES[name]()
    runs = []
    for n in (None, 3):
        runs.append(relprop.explain(model, batch, method=method, keep_blocks=False, tuning=rows(n), **options))
    whole, got = runs
    _close(got.scores, whole.scores, f"{name} {options} scores")
    _close(got.heads, whole.heads, f"{name} {options} heads")


def test_causal_rows_of_chunks_agree_with_the_whole_map():
    """first_block_rows.causal_rows on chunks of rows (it reads only the keys after each chunk's first
    row) says what query.causal_block says of the whole map: causal maps, one entry above the
    diagonal in each position of a chunk, padding rows (not read), 3-d and 4-d maps."""
    import torch

    from relprop.methods.first_block_rows import causal_rows
    from relprop.methods.query import causal_block
    n = 7
    g = torch.Generator().manual_seed(0)
    causal = torch.rand(2, 3, n, n, generator=g).tril()
    real = torch.ones(2, n, dtype=torch.bool)
    real[1, 5:] = False
    maps = [causal, causal[:, 0]]
    for i, j in [(0, 1), (2, 3), (2, 6), (5, 6), (6, 6)]:
        for b in (0, 1):
            m = causal.clone()
            m[b, 1, i, j] = 0.5
            maps += [m, m[:, 1]]
    for a in maps:
        for chunk in (1, 2, 3, n):
            got = all(causal_rows(a[..., lo:lo + chunk, :], real, lo) for lo in range(0, n, chunk))
            assert got == causal_block(a, real), chunk


def _chunk_calls(monkeypatch):
    """The chunks that chunked_walk recomputes, as (lo, hi, with dA: False in a counting pass): by
    chunk_values, or by the segment's backward pass walking its core (ChunkGradients)."""
    calls = []
    recompute = chunked_walk.chunk_values
    from_backward = chunk_gradients.ChunkGradients.__call__

    def counted(core, attention, value, lo, hi, compute=None, dout=None, keys=None):
        calls.append((lo, hi, dout is not None))
        return recompute(core, attention, value, lo, hi, compute, dout, keys)

    def counted_backward(self, lo, hi, keys, counting=False):
        calls.append((lo, hi, not counting))
        return from_backward(self, lo, hi, keys, counting)

    monkeypatch.setattr(chunked_walk, "chunk_values", counted)
    monkeypatch.setattr(chunk_gradients.ChunkGradients, "__call__", counted_backward)
    return calls


def _factors(monkeypatch):
    """The per-sample factors each deferral gives."""
    seen = []
    factors = deferred_shares.Deferral.factors

    def spy(self):
        g = factors(self)
        if g is not None:
            seen.append([t.clone() for t in g])
        return g

    monkeypatch.setattr(deferred_shares.Deferral, "factors", spy)
    return seen


def _same_walk(got, whole, what):
    """Scores, head rows, input relevance and every figure of the ledger agree."""
    _close(got.scores, whole.scores, what + " scores")
    _close(got.heads, whole.heads, what + " heads")
    _close(got.input_relevance, whole.input_relevance, what + " input relevance")
    c, w = got.conservation, whole.conservation
    for field in ("injected", "input", "absorbed"):
        _close(getattr(c, field), getattr(w, field), f"{what} {field}")
    assert set(c.absorbed_by) == set(w.absorbed_by), what
    for label, v in w.absorbed_by.items():
        _close(c.absorbed_by[label], v, f"{what} absorbed by {label}")
    assert [b.name for b in c.blocks] == [b.name for b in w.blocks], what
    for b, wb in zip(c.blocks, w.blocks):
        for field in ("relevance_in", "relevance_out", "absorbed"):
            _close(getattr(b, field), getattr(wb, field), f"{what} block {b.name} {field}")


def test_chefer2021_normalization_is_deferred_one_pass_over_the_chunks(monkeypatch):
    """transformer_attribution under chefer2021: each chunk of each core is recomputed once, with dA
    (no counting pass), and the counting path is not taken."""
    model, batch = CASES["hf_llama_eager"]()
    calls = _chunk_calls(monkeypatch)
    seen = _factors(monkeypatch)

    def counted(*args, **kw):
        raise AssertionError("the counting path ran")

    monkeypatch.setattr(chunked_walk, "_walk_counted", counted)
    _explain(model, batch, "transformer_attribution", "chefer2021", 3)
    queries = batch["input_ids"].shape[1]
    cores = len(model.model.layers)
    assert calls == [(lo, min(lo + 3, queries), True) for lo in range(0, queries, 3)] * cores
    assert len(seen) == cores  # one deferred normalization (the mask's sum) per core


def _two_samples(name):
    """A model and a batch of two samples: texts of different lengths (padded; LLaMA is causal), or
    two images for BEiT, whose relative position bias is the finite constant of the scores' sum."""
    if name == "hf_beit":
        return zoo.hf_beit().eval(), torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    model, _ = CASES[name]()
    return model, (models.text_batch if name == "hf_bert_eager" else models.decoder_batch)(lengths=(8, 5), seed=1)


@pytest.mark.parametrize("name", ["hf_bert_eager", "hf_llama_eager", "hf_beit"])
def test_deferred_factors_per_sample_equal_the_whole_walk(name, monkeypatch):
    """Two samples, chunks of 1 and 3 rows: one pass over the chunks gives the whole walk's scores,
    head rows, input relevance and ledger (injected, input, absorbed by label and per block).
    (With an additive mask of 0 and a large negative number the mask's share is 0 and the factor of
    the scores' share Σ R / Σ R_u, near 1; BEiT's bias gives factors of either sign.)"""
    model, batch = _two_samples(name)
    whole = _explain(model, batch, "transformer_attribution", "chefer2021", None)
    for n in (1, 3):
        calls = _chunk_calls(monkeypatch)
        seen = _factors(monkeypatch)
        got = _explain(model, batch, "transformer_attribution", "chefer2021", n)
        assert calls and all(with_da for _, _, with_da in calls), "a counting pass ran"
        assert len(seen) == len(got.conservation.blocks) and all(g.shape == (2,) for gs in seen for g in gs)
        if name == "hf_beit":
            assert any((gu[0] - gu[1]).abs() > 0.1 for gu, _ in seen), "the samples' factors are alike"
        _same_walk(got, whole, f"{name} rows={n}")


def test_counting_path_where_the_walk_cannot_defer(monkeypatch):
    """Where the walk refuses to defer on the first chunk (forced here once its rules ran), the chunk's
    work is dropped and the counting path gives the whole walk's numbers."""
    model, batch = CASES["hf_bert_eager"]()
    whole = _explain(model, batch, "transformer_attribution", "chefer2021", None)
    refuse_deferral(monkeypatch)
    calls = _chunk_calls(monkeypatch)
    got = _explain(model, batch, "transformer_attribution", "chefer2021", 3)
    assert any(not with_da for _, _, with_da in calls), "no counting pass ran"
    _same_walk(got, whole, "counting path")


def test_two_normalizing_sums_take_the_counting_path(monkeypatch):
    """MPNet adds a relative position bias, then the mask, to the scores: two normalizing sums, the
    second one's relevance scaled by the first one's factors; the walk counts the sums first."""
    model = zoo.hf_mpnet().eval()
    batch = models.text_batch(lengths=(8, 5), seed=1, pad_id=1, first_id=zoo.FIRST_ID)
    whole = _explain(model, batch, "transformer_attribution", "chefer2021", None)
    calls = _chunk_calls(monkeypatch)
    got = _explain(model, batch, "transformer_attribution", "chefer2021", 3)
    assert any(not with_da for _, _, with_da in calls), "no counting pass ran"
    _same_walk(got, whole, "hf_mpnet")


def test_a_user_rule_below_the_normalization_takes_the_counting_path(monkeypatch):
    """A rule that is not relprop's own (here Q·Kᵀ's, overridden by a wrapper that is linear, so that
    the numbers can be compared) may be non-linear in the relevance: relevance whose factors are
    deferred is not walked through it; the walk counts the sums first."""
    from relprop.rules import override
    from relprop.rules.products import matmul

    def my_matmul(ctx, relevance):
        return matmul(ctx, relevance)

    model, batch = CASES["hf_llama_eager"]()
    model = model.double()
    with override({torch.ops.aten.matmul.default: my_matmul}, preset="chefer2021"):
        whole = _explain(model, batch, "transformer_attribution", "chefer2021", None)
        calls = _chunk_calls(monkeypatch)
        got = _explain(model, batch, "transformer_attribution", "chefer2021", 3)
    assert any(not with_da for _, _, with_da in calls), "no counting pass ran"
    _close(got.scores, whole.scores, "scores", models.LLAMA_FLOAT64_AGREEMENT)
    _close(got.input_relevance, whole.input_relevance, "input relevance", models.LLAMA_FLOAT64_AGREEMENT)


def test_a_single_query_core_is_not_chunked_and_a_rollout_is_refused_clearly():
    """CaiT's class attention has one query, read as a vector: no operand carries the query rows, so
    its core is not planned for chunks (it crashed the folded run's forward pass with an IndexError);
    folded, ``transformer_attribution`` is refused as on the full path, and ``lrp`` segmented runs."""
    from relprop.errors import MethodError
    entry = zoo.ZOO["timm_cait"]
    torch.manual_seed(0)
    model = entry.build().eval()
    inputs = entry.inputs(model, 2, 0)
    a = CACHE.get(model, bind_inputs(model, inputs)).analysis
    assert len(plan_cores(a)) < len(a.blocks)  # the class-attention block has none
    with pytest.raises(MethodError, match="maps 17 tokens to 1 queries"):
        relprop.explain(model, inputs, target=entry.target, method="transformer_attribution", keep_blocks=False)
    exp = relprop.explain(model, inputs, target=entry.target, method="lrp", preset="lrp", records_budget=0)
    assert any("rule-by-rule walk would hold" in n for n in exp.notes)
