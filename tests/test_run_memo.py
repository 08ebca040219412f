"""What one engine run reads once (relprop.graph.run_memo): facts about a tensor object while it lives
unchanged, facts under a canonical key; nothing outside a run; and, on a tiny LLaMA with row-chunked
cores, the blocks' masks read once for their key bounds and their boolean test."""
import pytest
import torch

import models
import relprop
from chunking import rows
from relprop.graph import key_bounds, run_memo, torch_fixes
from relprop.graph.capture import CACHE
from relprop.graph.inputs import bind_inputs

aten = torch.ops.aten


def _counting():
    calls = []

    def fact(t):
        calls.append(t)
        return int(t.sum())
    return fact, calls


def test_about_tensor_once_per_object_and_view_while_unchanged():
    fact, calls = _counting()
    base = torch.ones(4, 6)
    run_memo.about_tensor("sum", base, fact)
    run_memo.about_tensor("sum", base, fact)
    assert len(calls) == 2  # outside a run: computed each time
    calls.clear()
    with run_memo.once_per_run():
        assert run_memo.about_tensor("sum", base, fact) == 24
        assert run_memo.about_tensor("sum", base, fact) == 24
        assert len(calls) == 1
        # a new view object of the same elements in the same place is the same fact
        assert run_memo.about_tensor("sum", base[None].expand(2, 4, 6)[0], fact) == 24
        assert len(calls) == 1
        assert run_memo.about_tensor("sum", base[None].expand(2, 4, 6), fact) == 48  # another shape
        assert len(calls) == 2
        assert run_memo.about_tensor("sum", base[None].expand(2, 4, 6), fact) == 48  # (a recomputed expand)
        assert len(calls) == 2
        assert run_memo.about_tensor("sum", base[1:], fact) == 18  # other elements
        assert run_memo.about_tensor("other", base, fact) == 24  # another fact
        assert len(calls) == 4
        base[0, 0] = 5.0  # written to: read again (the version counter)
        assert run_memo.about_tensor("sum", base, fact) == 28
        assert len(calls) == 5
        # a tensor that died is never mistaken for a new one (identity checked through a weak reference)
        for _ in range(20):
            t = torch.zeros(3)
            run_memo.about_tensor("sum", t, fact)
            del t  # (freed at once: reference counting)
        assert len(calls) == 25
    calls.clear()
    run_memo.about_tensor("sum", base, fact)
    assert len(calls) == 1  # the run's memo is gone with it


def test_remembered_once_per_key_and_run_nested_runs_share_it():
    n = []

    def compute():
        n.append(1)
        return len(n)
    assert run_memo.remembered("k", compute) == 1 and run_memo.remembered("k", compute) == 2
    with run_memo.once_per_run():
        assert run_memo.remembered("k", compute) == 3
        with run_memo.once_per_run():  # an engine run inside another one reads the outer memo
            assert run_memo.remembered("k", compute) == 3
        assert run_memo.remembered("j", compute) == 4
    with run_memo.once_per_run():
        assert run_memo.remembered("k", compute) == 5


def test_mask_source_names_the_boolean_mask_and_the_numbers():
    graph = torch.fx.Graph()
    m = graph.placeholder("mask")
    other = graph.placeholder("other")
    zero = graph.call_function(aten.scalar_tensor.default, (0.0,), {"dtype": torch.float32})
    low = graph.call_function(aten.scalar_tensor.default, (-3.0e38,), {"dtype": torch.float32})
    zero2 = graph.call_function(aten.scalar_tensor.default, (0.0,), {"dtype": torch.float32})
    low2 = graph.call_function(aten.scalar_tensor.default, (-3.0e38,), {"dtype": torch.float32})
    low64 = graph.call_function(aten.scalar_tensor.default, (-3.0e38,), {"dtype": torch.float64})
    a = graph.call_function(aten.where.self, (m, zero, low))
    b = graph.call_function(aten.where.self, (m, zero2, low2))  # another block's copy
    c = graph.call_function(aten.where.self, (m, 0.0, -3.0e38))
    d = graph.call_function(aten.where.self, (m, zero2, low64))  # another dtype
    e = graph.call_function(aten.where.self, (other, zero, low))  # another mask
    f = graph.call_function(aten.where.self, (m, other, low))  # a tensor branch: itself
    g = graph.call_function(aten.add.Tensor, (other, other))
    source = key_bounds.mask_source
    assert source(a) == source(b)
    assert len({source(n) for n in (a, c, d, e)}) == 4
    assert source(f) is f and source(g) is g
    assert source(graph.call_function(aten.where.self, (m, 0, 1))) != source(graph.call_function(aten.where.self,
                                                                                                  (m, 0.0, 1.0)))


def test_a_decoders_blocks_read_their_mask_once(monkeypatch):
    """A tiny LLaMA (3 blocks, sdpa: each block turns the boolean mask into its own float mask) in
    row-chunked segments: the key bounds are read once per run, the boolean mask's where-everywhere
    test at most twice (the forward pass, the recomputed segments), and the map equals the one
    without the memo."""
    model = models.hf_llama("sdpa")
    batch = models.decoder_batch(lengths=(9, 9))
    CACHE.get(model, bind_inputs(model, batch))
    tuning = rows(3, cpu_bytes=3 * 4 * 9 * 8 * 2, min_rows=1, small=True)
    reads, tests = [], []
    read, test = key_bounds._read, torch_fixes._selects_everywhere
    monkeypatch.setattr(key_bounds, "_read", lambda *a: reads.append(1) or read(*a))
    monkeypatch.setattr(torch_fixes, "_selects_everywhere", lambda t: tests.append(t.shape) or test(t))
    got = relprop.explain(model, batch, method="transformer_attribution", keep_blocks=False, tuning=tuning).scores
    assert len(reads) == 1
    big = [s for s in tests if len(s) == 4 and s[-1] == s[-2] == 9]
    assert 1 <= len(big) <= 2
    monkeypatch.setattr(run_memo, "_RUN", _NoRun())
    reads.clear()
    tests.clear()
    want = relprop.explain(model, batch, method="transformer_attribution", keep_blocks=False, tuning=tuning).scores
    assert len(reads) > 1 and len([s for s in tests if len(s) == 4 and s[-1] == s[-2] == 9]) > 2
    torch.testing.assert_close(got, want, rtol=0, atol=0)


class _NoRun:
    """A context variable that never holds a run (every fact computed at each call)."""

    def get(self):
        return None

    def set(self, value):
        return None

    def reset(self, token):
        pass


def test_an_inference_mode_tensor_is_read_each_time():
    """A tensor made under torch.inference_mode has no version counter: its facts are computed at each
    call, never remembered (and never an error)."""
    fact, calls = _counting()
    with torch.inference_mode():
        t = torch.ones(3)
    with run_memo.once_per_run():
        assert run_memo.about_tensor("sum", t, fact) == 3 and run_memo.about_tensor("sum", t, fact) == 3
    assert len(calls) == 2


@pytest.mark.parametrize("kind", ["remembered", "about_tensor"])
def test_without_a_run_nothing_is_kept(kind):
    fact, calls = _counting()
    t = torch.ones(3)
    for _ in range(3):
        if kind == "remembered":
            run_memo.remembered("x", lambda: fact(t))
        else:
            run_memo.about_tensor("x", t, fact)
    assert len(calls) == 3
