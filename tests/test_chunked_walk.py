"""The row-chunked walk (relprop.engine.chunked_walk, on with relprop.engine.chunked_core.ROW_CHUNK):
a folded run whose attention cores are evaluated, differentiated and walked in chunks of query rows
gives the numbers of the folded run with whole cores (scores, head rows, the ledger, the input
relevance) for chunks of 1 row, 3 rows and all rows, on LLaMA, GPT-2 and BERT (padded batches, so
chefer2021's Lemma-2 normalization of the mask's sum sees non-zero masks)."""
import pytest

import models
import relprop
from relprop.engine import chunked_core
from relprop.engine.chunked_walk import plan_cores
from relprop.graph.capture import CACHE
from relprop.graph.inputs import bind_inputs

CASES = {
    "hf_llama_eager": lambda: (models.hf_llama("eager"), models.decoder_batch(lengths=(7, 5, 9))),
    "hf_gpt2_lm": lambda: (models.hf_gpt2_lm("sdpa"), models.decoder_batch(lengths=(7, 5, 9))),
    "hf_bert_eager": lambda: (models.TEXT["hf_bert_eager"](), models.text_batch(lengths=(7, 5, 9))),
}
RUNS = [("transformer_attribution", "chefer2021"), ("gradient_rollout", None), ("transformer_attribution", "attnlrp")]


def _explain(model, batch, method, preset, rows, monkeypatch):
    monkeypatch.setattr(chunked_core, "ROW_CHUNK", rows)
    kw = {} if preset is None else {"preset": preset}
    return relprop.explain(model, batch, method=method, keep_blocks=False, **kw)


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
def test_row_chunked_walk_equals_the_whole_cores(name, method, preset, monkeypatch):
    """In float64, so that the comparison shows the same sums and not float32 rounding: chunks change
    the order of the sums over the keys and the rows, and chefer2021's relevance of a random tiny
    model cancels enough that float32 rounding reaches 3e-5 of its largest score on some CPUs (AVX-512),
    where float64 agrees to 4e-14."""
    model, batch = CASES[name]()
    model = model.double()
    whole = _explain(model, batch, method, preset, None, monkeypatch)
    for rows in (1, 3, 10 ** 6):
        got = _explain(model, batch, method, preset, rows, monkeypatch)
        what = f"{name} {method} {preset} rows={rows}"
        assert got.kept_blocks is False and whole.kept_blocks is False
        _close(got.scores, whole.scores, what + " scores", 1e-9)
        _close(got.heads, whole.heads, what + " heads", 1e-9)
        _close(got.input_relevance, whole.input_relevance, what + " input relevance", 1e-9)
        if whole.conservation is not None:
            for field in ("injected", "input", "absorbed"):
                _close(getattr(got.conservation, field), getattr(whole.conservation, field), f"{what} {field}", 1e-9)
            assert set(got.conservation.absorbed_by) == set(whole.conservation.absorbed_by), what
            for label, v in whole.conservation.absorbed_by.items():
                _close(got.conservation.absorbed_by[label], v, f"{what} absorbed by {label}", 1e-9)


@pytest.mark.parametrize("name,method,options", [
    ("hf_bert_eager", "gradient_rollout", {"query": "mean"}),  # the first block is gathered whole
    ("hf_llama_eager", "transformer_attribution", {"end_block": 1}),  # the range ends before the first block
])
def test_row_chunked_walk_with_options_equals_the_whole_cores(name, method, options, monkeypatch):
    model, batch = CASES[name]()
    runs = []
    for rows in (None, 3):
        monkeypatch.setattr(chunked_core, "ROW_CHUNK", rows)
        runs.append(relprop.explain(model, batch, method=method, keep_blocks=False, **options))
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
