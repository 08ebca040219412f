"""The keys each chunk of query rows attends to (relprop.graph.key_bounds): a causal decoder's chunk
of rows lo..hi-1 is evaluated, differentiated, walked and folded on keys 0..hi-1 only, read from the
additive mask's values; everything else keeps all keys. The numbers equal those of whole cores
(float64, so that the comparison is not float32 rounding), for right and left padding, with and
without the safe softmax."""
import pytest
import torch

import models
import relprop
from relprop.engine import RowChunks, Tuning
from relprop.engine.chunked_walk import plan_cores
from relprop.graph import attention_core, fused_attention
from relprop.graph.capture import CACHE
from relprop.graph.inputs import bind_inputs
from relprop.graph.key_bounds import CLOSED, additive_mask, key_bounds


def _cores(model, batch):
    kwargs = bind_inputs(model, batch)
    if "use_cache" in model.forward.__code__.co_varnames:
        kwargs["use_cache"] = False
    captured = CACHE.get(model, kwargs)
    return captured, [c for c, _ in plan_cores(captured.analysis).values()]


def _left_padded(lengths=(9, 8, 9)):
    batch = models.decoder_batch(lengths=lengths)
    ids, mask = batch["input_ids"].clone(), batch["attention_mask"].clone()
    for i, n in enumerate(lengths):  # move each row's tokens to its end
        ids[i] = torch.roll(ids[i], ids.shape[1] - n)
        mask[i] = torch.roll(mask[i], ids.shape[1] - n)
    return {"input_ids": ids, "attention_mask": mask}


FLOAT32_MIN = torch.finfo(torch.float32).min


def _causal_mask(n, closed=FLOAT32_MIN):
    m = torch.zeros(1, 1, n, n)
    return m.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), closed)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_a_causal_core_reads_its_mask_as_the_bound(attn):
    model = models.hf_llama(attn)
    captured, cores = _cores(model, models.decoder_batch(lengths=(7, 5, 9)))
    assert cores and all(additive_mask(c) is not None for c in cores)
    core = cores[0]
    mask = _causal_mask(9)
    values = {additive_mask(core): mask, core.nodes[0].args[1]: torch.zeros(3, 4, 8, 9)}
    chunks = [(0, 3), (3, 6), (6, 9), (0, 1), (4, 5)]
    assert key_bounds(core, values.__getitem__, chunks) == [3, 6, 9, 1, 5]
    # a value between "closed" and "open", a row with no open key, -inf: what may be cut
    odd = mask.clone()
    odd[0, 0, 4, 8] = -1e20
    assert key_bounds(core, {**values, additive_mask(core): odd}.__getitem__, chunks) == [3, 9, 9, 1, 9]
    shut = mask.clone()
    shut[0, 0, 1, :] = CLOSED
    assert key_bounds(core, {**values, additive_mask(core): shut}.__getitem__, chunks) == [9, 6, 9, 1, 5]
    inf = _causal_mask(9, float("-inf"))
    assert key_bounds(core, {**values, additive_mask(core): inf}.__getitem__, chunks) == [3, 6, 9, 1, 5]
    # a mask broadcast over the rows (padding only): the last key open in any sample
    pad = torch.zeros(2, 1, 1, 9)
    pad[:, :, :, 6:] = CLOSED
    assert key_bounds(core, {**values, additive_mask(core): pad}.__getitem__, chunks) == [6] * 5


def test_a_core_without_a_mask_keeps_every_key():
    model = models.VISION["timm_vit_tiny"]()
    _, cores = _cores(model, torch.randn(1, 3, 64, 64))
    assert cores
    for core in cores:
        n = core.queries
        values = {core.nodes[0].args[1]: torch.zeros(1, 3, 8, n)}
        if additive_mask(core) is None:
            assert key_bounds(core, values.__getitem__, [(0, 3), (3, n)]) == [n, n]


@pytest.mark.parametrize("padding", ["right", "left"])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("method,preset", [("transformer_attribution", "chefer2021"),
                                           ("transformer_attribution", "attnlrp"), ("gradient_rollout", None)])
def test_cut_keys_give_the_numbers_of_whole_cores(padding, attn, method, preset, monkeypatch):
    """Left padding: sample 1's first row is a padding query that attends to no key (a uniform row
    of the eager softmax, a zero row of the safe softmax): its chunk keeps every key. In float32 for
    the eager model there (in float64 its own outputs are NaN on left padding), to 1e-4."""
    float32 = padding == "left" and attn == "eager"
    model = models.hf_llama(attn) if float32 else models.hf_llama(attn).double()
    tol = 1e-4 if float32 else models.LLAMA_FLOAT64_AGREEMENT  # (LLaMA's norms and eager softmax are float32)
    batch = models.decoder_batch(lengths=(7, 5, 9)) if padding == "right" else _left_padded()
    kw = {} if preset is None else {"preset": preset}
    cut = []
    evaluate = attention_core.evaluate_rows
    fused = fused_attention.sdpa_rows

    def spy(core, value, lo, hi, *args, keys=None, **kwargs):
        if keys is not None and keys[0] < keys[1]:
            cut.append((lo, hi, keys))
        return evaluate(core, value, lo, hi, *args, keys=keys, **kwargs)

    def spy_fused(form, core, value, lo, hi, keys):
        if keys[0] < keys[1]:
            cut.append((lo, hi, keys))
        return fused(form, core, value, lo, hi, keys)

    runs = []
    for chunks in (None, RowChunks(rows=3)):
        for module in ("relprop.engine.chunked_core", "relprop.engine.chunked_walk", "relprop.engine.chunk_gradients"):
            monkeypatch.setattr(f"{module}.evaluate_rows", spy)
        monkeypatch.setattr("relprop.engine.chunked_core.sdpa_rows", spy_fused)
        runs.append(relprop.explain(model, batch, method=method, keep_blocks=False, tuning=Tuning(chunks=chunks),
                                    **kw))
    whole, got = runs
    assert cut, "no chunk was evaluated on fewer keys"
    assert all(hi <= kept for lo, hi, (kept, _) in cut)
    for field in ("scores", "heads", "input_relevance"):
        a, b = getattr(got, field), getattr(whole, field)
        if b is None:
            assert a is None
            continue
        assert float((a - b).abs().max() / b.abs().max().clamp_min(1e-300)) <= tol, field
    if padding == "left":
        assert all(lo >= 3 for lo, _, _ in cut)  # (rows 0-2 hold a row with no open key)
    if whole.conservation is not None:
        for label, v in whole.conservation.absorbed_by.items():
            scale = whole.conservation.injected.abs().max()
            assert float((got.conservation.absorbed_by[label] - v).abs().max() / scale) <= tol, label


@pytest.mark.parametrize("preset", ["attnlrp", "cp_lrp"])
def test_the_segmented_fast_path_cuts_keys_too(preset):
    """``lrp`` with ``memory="low"`` (relprop.engine.fast_low) runs the cores' chunks on their keys."""
    model = models.hf_llama("sdpa").double()
    batch = models.decoder_batch(lengths=(7, 5, 9))
    target = torch.tensor([5, 6, 7])
    runs = []
    for chunks in (None, RowChunks(rows=3)):
        runs.append(relprop.explain(model, batch, target=target, method="lrp", preset=preset, memory="low",
                                    tuning=Tuning(chunks=chunks)))
    whole, got = runs
    scale = whole.scores.abs().max()
    assert float((got.scores - whole.scores).abs().max() / scale) <= 1e-9


def test_chunk_rows_follow_the_bytes_of_a_chunk():
    """A chunk's heads × rows × keys tensor stays within RowChunks.bytes (cpu_bytes on the CPU):
    fewer rows for more keys."""
    mib = 2 ** 20
    chunks = RowChunks()
    assert chunks.rows == 256 and chunks.bytes == 32 * mib and chunks.cpu_bytes == 16 * mib
    assert chunks.rows_for(8, 8192) == 128
    assert chunks.rows_for(8, 4096) == 256
    assert chunks.rows_for(8, 4096, cpu=True) == 128
    assert chunks.rows_for(8, 8192, cpu=True) == 64
    assert chunks.rows_for(32, 131072) == chunks.min_rows
    assert RowChunks(rows=3).rows_for(8, 8192) == 3


def test_chunks_cut_by_bytes_give_the_numbers_of_whole_cores():
    model = models.hf_llama("sdpa").double()
    batch = models.decoder_batch(lengths=(7, 5, 9))
    # 2 rows of 3 samples × 4 heads × 9 keys, the cores chunked although their rows fit 256
    by_bytes = RowChunks(rows=256, cpu_bytes=3 * 4 * 9 * 8 * 2, min_rows=1, small=True)
    runs = [relprop.explain(model, batch, method="transformer_attribution", keep_blocks=False,
                            tuning=Tuning(chunks=chunks)) for chunks in (None, by_bytes)]
    whole, got = runs
    assert float((got.scores - whole.scores).abs().max() / whole.scores.abs().max()) <= 1e-9
