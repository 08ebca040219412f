"""``explain(..., keep_blocks=False)``: the rollout-style methods folded block by block during the
reverse walk (:mod:`relprop.methods.fold_maps`, :mod:`relprop.engine.fold_hooks`).

The folded scores must equal the full-matrix path's (``keep_blocks=True``, the reference every
other test checks against the papers) to float32 rounding, on encoders, a padded text batch and
causal decoders; the paper's Eq. 13–14 written out with loops over the kept records gives the same
row; the model is untouched; the blocks and the matrix are not kept and reading them says so.
"""
import copy
import functools

import pytest
import torch

import relprop
from relprop.engine import Request, RowChunks, Schedule, execute
from relprop.engine.trace import BlockRecord, NotKept
from relprop.graph.capture import CACHE
from relprop.graph.inputs import bind_inputs
from relprop.methods import get_method
from relprop.methods.fold_maps import RowFold
from relprop.targets import resolve

import models
from fold_checks import TOL, assert_folded_like_kept

FOLDED = ("transformer_attribution", "rollout", "gradient_rollout", "ta_without_gradient")
#: every test here captures a model (torch.export: seconds on a loaded machine), so all but the
#: argument check are slow; the models are built once per session and the captures cached with them
slow = pytest.mark.slow


@functools.lru_cache(maxsize=None)
def _model(make):
    return make()


def _pair(model, x, **kw):
    full = relprop.explain(model, x, keep_blocks=True, **kw)
    folded = relprop.explain(model, x, keep_blocks=False, **kw)
    return full, folded


CASES = {
    "timm_vit_tiny": (models.VISION["timm_vit_tiny"], models.image_batch, {}),
    "hf_bert_eager_padded": (models.TEXT["hf_bert_eager"], lambda m: models.text_batch(), {"target": 1}),
    "hf_distilbert_sdpa_padded": (models.TEXT["hf_distilbert_sdpa"], lambda m: models.text_batch(), {"target": 0}),
    "hf_gpt2_lm_causal": (models.DECODERS["hf_gpt2_lm"], lambda m: models.decoder_batch(), {"target": "next_token"}),
    "hf_llama_causal": (models.DECODERS["hf_llama"], lambda m: models.decoder_batch(), {"target": "next_token"}),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("method", FOLDED)
@slow
def test_folded_equals_full_matrix_path(case, method):
    make, inputs, kw = CASES[case]
    model = _model(make)
    full, folded = _pair(model, inputs(model), method=method, **kw)
    assert_folded_like_kept(full, folded)
    assert not folded.kept_blocks and full.kept_blocks


@pytest.mark.parametrize("options", [
    {"normalize_rows": True, "start_block": 1},
    {"query": "mean"},
    {"end_block": -1, "head_fusion": "max"},
    {"start_block": -1, "positive": False, "head_fusion": "gradient"},
])
@slow
def test_folded_options_equal_full_path(options):
    model = _model(models.TEXT["hf_bert_eager"])
    full, folded = _pair(model, models.text_batch(), target=1, method="transformer_attribution", **options)
    assert_folded_like_kept(full, folded)


@slow
def test_folded_row_is_eq_13_14_with_loops():
    """The folded scores against CVPR 2021 Eq. 13–14 written out element by element from the
    full path's records: Ā_b = I + E_h (∇A_b ⊙ R_A,b)⁺, C = Ā_{B-1} ⋯ Ā_0, scores = C[query, :] less
    the query's own identity share (the tiny BERT shows its [CLS]: no special token is known)."""
    model = _model(models.TEXT["hf_bert_eager"])
    x = models.text_batch(lengths=(5, 3))
    full, folded = _pair(model, x, target=1)
    blocks = full.blocks
    n = blocks[0].attention.shape[-1]
    for s in range(2):
        c = torch.eye(n, dtype=torch.float64)
        for b in blocks:  # input -> output: C <- Ā_b C
            m = (b.gradient[s] * b.relevance[s]).clamp(min=0).double()
            bar = torch.eye(n, dtype=torch.float64)
            for i in range(n):
                for j in range(n):
                    bar[i, j] += sum(float(m[h, i, j]) for h in range(m.shape[0])) / m.shape[0]
            c = bar @ c
        q = int(full.query[s].argmax())
        c[q, q] -= 1  # the query row's own identity share left out (identity="exclude", the default)
        expected = c[q].float() * x["attention_mask"][s].bool() * folded.mask[s]
        torch.testing.assert_close(folded.scores[s], expected, **TOL)


@slow
def test_model_untouched_and_records_not_kept():
    model = models.TEXT["hf_bert_eager"]()
    model.train()
    before = copy.deepcopy(model.state_dict())
    e = relprop.explain(model, models.text_batch(), target=1, keep_blocks=False)
    assert model.training
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.grad is None for p in model.parameters())
    for field in ("blocks", "matrix"):
        with pytest.raises(relprop.MethodError, match="keep_blocks=True"):
            getattr(e, field)
    assert "not kept" in repr(e)
    assert e.conservation is not None and e.input_relevance is not None  # the walk's own results stay
    assert any("keep_blocks=False" in note for note in e.notes)


@slow
def test_engine_hands_blocks_over_from_the_output_back():
    """The engine calls a fold with every block once, output block first, with A, dA and R_A."""
    model = _model(models.TEXT["hf_bert_eager"])
    x = models.text_batch(lengths=(4, 6))
    kwargs = bind_inputs(model, x)
    captured = CACHE.get(model, kwargs)
    seen = []

    class Recorder:
        name = "recorder"

        def __call__(self, rec):
            seen.append((rec.index, tuple(rec.attention.shape), rec.gradient is not None, rec.relevance is not None))

        def result(self):
            return len(seen)

    trace = execute(Request(captured, model, kwargs, resolve(1, 2, captured.primary), folds=(Recorder(),)),
                    Schedule(segmented=True, records="folded", cores=RowChunks()))
    n = len(captured.analysis.blocks)
    assert [s[0] for s in seen] == list(range(n - 1, -1, -1))
    assert all(s[1][0] == 2 and s[1][-2:] == (6, 6) and s[2] and s[3] for s in seen)
    assert trace.folded == [n]
    with pytest.raises(relprop.MethodError, match="keep_blocks"):
        len(trace.blocks)


@slow
def test_falls_back_where_folding_does_not_apply():
    model = _model(models.TEXT["hf_bert_eager"])
    x = models.text_batch(lengths=(4, 6))
    for kw, why in [({"layers": "sum"}, "layers='sum'"), ({"discard_ratio": 0.5}, "discard_ratio"),
                    ({"method": ["transformer_attribution", "lrp"]}, "'lrp'")]:
        got = relprop.explain(model, x, target=1, keep_blocks=False, **kw)
        for e in got if isinstance(got, list) else [got]:
            assert e.kept_blocks and len(e.blocks) == 2, kw
            assert any("not folded" in note and why in note for note in e.notes), (kw, e.notes)
    swin = models.SWIN["hf_swin"]()
    e = relprop.explain(swin, models.swin_images(swin), target=0, keep_blocks=False)
    assert e.kept_blocks and any("windows" in note for note in e.notes)


@slow
def test_folded_errors_are_the_full_paths():
    model = _model(models.TEXT["hf_bert_eager"])
    x = models.text_batch(lengths=(4, 6))
    with pytest.raises(relprop.MethodError, match="start_block=5 out of range"):
        relprop.explain(model, x, target=1, keep_blocks=False, start_block=5)
    with pytest.raises(relprop.MethodError, match="gives them none"):
        relprop.explain(model, x, target=1, keep_blocks=False, preset="cp_lrp")
    with pytest.raises(relprop.MethodError, match="two token streams"):  # the ablation is not dropped silently
        relprop.explain(model, x, target=1, keep_blocks=False, normalize_self=False)


def test_keep_blocks_is_checked_before_any_work():
    with pytest.raises(relprop.OptionError, match=r"keep_blocks='no' is not a choice.*\[None, True, False\]"):
        relprop.explain(torch.nn.Linear(2, 2), torch.zeros(1, 2), keep_blocks="no")


def test_not_kept_refuses_every_use():
    nk = NotKept("the per-block records (exp.blocks)", "transformer_attribution")
    for use in (len, bool, iter, lambda v: v[0], lambda v: v.shape):
        with pytest.raises(relprop.MethodError, match="keep_blocks=True"):
            use(nk)


@slow
def test_several_folded_methods_share_one_run():
    model = _model(models.DECODERS["hf_llama"])
    x = models.decoder_batch(lengths=(6, 4))
    full = relprop.explain(model, x, method=list(FOLDED), target="next_token", keep_blocks=True)
    folded = relprop.explain(model, x, method=list(FOLDED), target="next_token", keep_blocks=False)
    for f, s in zip(full, folded):
        assert f.method == s.method
        assert_folded_like_kept(f, s)


def _synthetic(causal: bool, pad: bool, seed: int = 0, batch: int = 2, heads: int = 3, n: int = 5, blocks: int = 3):
    """A trace-like object with random block records: softmax-normalized A (causal: lower
    triangular), dA non-zero on the rows the target reads (row 0, or a decoder's last real row), R_A
    of both signs; ``pad`` masks the last token of sample 1."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(batch, n, dtype=torch.long)
    if pad:
        mask[1, -1] = 0
    records = []
    for i in range(blocks):
        logits = torch.randn(batch, heads, n, n, generator=g)
        if causal:
            logits = logits.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        a = logits.softmax(-1)
        grad = torch.randn(batch, heads, n, n, generator=g)
        if i == blocks - 1:  # the block next to the output: only the rows the target reads
            keep = torch.zeros(batch, 1, n, 1)
            for s in range(batch):
                keep[s, 0, int(mask[s].sum()) - 1 if causal else 0] = 1
            grad = grad * keep
        records.append(BlockRecord(index=i, name=f"b{i}", layer=f"layers.{i}", attention=a, gradient=grad,
                                   relevance=torch.randn(batch, heads, n, n, generator=g) * a, hidden=None,
                                   hidden_gradient=None, hidden_relevance=None))
    trace = type("T", (), {})()
    trace.blocks, trace.token_mask, trace.batch_size, trace.stages, trace.token_mixing = (
        records, mask.bool(), batch, None, None)
    return trace, mask


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("method,options", [
    ("transformer_attribution", {}), ("transformer_attribution", {"normalize_rows": True, "start_block": 1}),
    ("transformer_attribution", {"query": "mean"}), ("rollout", {}), ("gradient_rollout", {"end_block": -1}),
])
def test_row_fold_equals_the_full_matrix_on_synthetic_records(causal, method, options):
    """Fast (no model): :class:`RowFold` fed the records output block first equals the method's
    full-matrix path on the same records (encoder and causal reading, a padded sample)."""
    trace, mask = _synthetic(causal, pad=True)
    info = get_method(method)
    full = info.fn(trace, **options)
    fold = RowFold(info, options, len(trace.blocks), mask, None, None)
    for rec in reversed(trace.blocks):
        fold(rec)
    got = fold.result()
    if causal and options.get("query") != "mean":  # a decoder's query: its last real position
        assert got["query"].argmax(1).tolist() == [4, 3]
    torch.testing.assert_close(got["tokens"], full["tokens"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got["query"], full["query"].to(got["query"].dtype), rtol=0, atol=0)
    if full.get("heads") is not None:
        torch.testing.assert_close(got["heads"], full["heads"], rtol=1e-5, atol=1e-6)
    with pytest.raises(relprop.MethodError, match="keep_blocks=True"):
        got["matrix"].shape


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("method,options", [
    ("transformer_attribution", {}), ("transformer_attribution", {"normalize_rows": True, "head_fusion": "max"}),
    ("rollout", {}), ("gradient_rollout", {"head_fusion": "gradient", "positive": False}),
])
def test_fold_in_query_row_chunks_equals_the_unchunked_fold(causal, method, options):
    """Fast (no model): each block's I + M_b built and multiplied into the row in chunks of query
    rows (as small as one row) gives the row of the unchunked fold and of the full-matrix path."""
    trace, mask = _synthetic(causal, pad=True)
    info = get_method(method)
    full = info.fn(trace, **options)
    rows = {}
    for chunk_bytes in (1 << 40, 1, 2 * (2 * 3 * 5 * 4)):  # one chunk; one row; two rows of batch 2, 3 heads, 5 keys
        fold = RowFold(info, options, len(trace.blocks), mask, None, None, chunk_bytes)
        for rec in reversed(trace.blocks):
            fold(rec)
        rows[chunk_bytes] = fold.result()["tokens"]
        torch.testing.assert_close(rows[chunk_bytes], full["tokens"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(rows[1], rows[1 << 40], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("case", ["hf_bert_eager_padded", "hf_llama_causal"])
@slow
def test_folded_in_one_row_chunks_equals_full_matrix_path(case):
    """Through explain(): every block folded one query row at a time equals the full-matrix path."""
    make, inputs, kw = CASES[case]
    model = _model(make)
    for method in ("transformer_attribution", "gradient_rollout"):
        full, folded = _pair(model, inputs(model), method=method, tuning=relprop.Tuning(fold_chunk_bytes=1), **kw)
        assert_folded_like_kept(full, folded)
