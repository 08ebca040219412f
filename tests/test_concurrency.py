"""Determinism and threads.

* Same inputs, same outputs, bit for bit on CPU: twice in a row, and after the capture cache was
  cleared (a fresh torch.export of the model).
* Several threads explaining with the same model at once get exactly the sequential results, the
  model is captured once, and the interpreter keeps no state across calls except its
  lock-protected counter.
* The capture cache is bounded: an LRU of ``relprop.CACHE_SIZE`` programs per model, and of
  ``SPECIALIZATIONS`` input sizes per program.
"""
import threading

import pytest
import torch

import models
import relprop
from relprop.engine import forward as interpreter
from relprop.graph.capture import CACHE, CACHE_SIZE, CaptureCache
from snapshot import assert_same, snapshot

FIELDS = ("scores", "map", "input_relevance", "target_scores", "logits")


def _assert_identical(a, b):
    for f in FIELDS:
        x, y = getattr(a, f), getattr(b, f)
        assert (x is None) == (y is None), f
        if x is not None:
            assert torch.equal(x, y), f
    for ba, bb in zip(a.blocks, b.blocks):
        for f in ("attention", "gradient", "relevance", "hidden", "hidden_gradient"):
            x, y = getattr(ba, f), getattr(bb, f)
            assert (x is None) == (y is None) and (x is None or torch.equal(x, y)), (ba.name, f)
    assert torch.equal(a.conservation.input, b.conservation.input)
    assert torch.equal(a.conservation.absorbed, b.conservation.absorbed)


@pytest.mark.parametrize("name", ["timm_vit_tiny", "hf_bert_eager"])
def test_bit_for_bit_deterministic(zoo, name):
    model = zoo(name)
    x = models.image_batch(model) if name in models.VISION else models.text_batch()
    first = relprop.explain(model, x, target=1)
    second = relprop.explain(model, x, target=1)
    _assert_identical(first, second)
    relprop.clear_cache(model)
    recaptured = relprop.explain(model, x, target=1)
    _assert_identical(first, recaptured)


def test_threads_explaining_the_same_model():
    """Four threads, two input batches, one model, a cold cache: each thread's results equal the
    sequential ones bit for bit; the model is captured once and left untouched."""
    model = models.hf_bert()
    batches = [models.text_batch(seed=0), models.text_batch(seed=1)]
    targets = [0, 2]
    expected = [relprop.explain(model, b, target=t) for b, t in zip(batches, targets)]
    relprop.clear_cache(model)
    traces_before = CACHE.traces
    forwards_before = interpreter.STATS["forward"]
    before = snapshot(model)
    results, errors = {}, []
    start = threading.Barrier(4)

    def work(i):
        try:
            start.wait()
            for _ in range(2):
                results.setdefault(i, []).append(relprop.explain(model, batches[i % 2], target=targets[i % 2]))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i, exps in results.items():
        for e in exps:
            _assert_identical(expected[i % 2], e)
    assert CACHE.traces - traces_before == 1  # one capture, shared by all threads
    assert interpreter.STATS["forward"] - forwards_before == 8  # no lost update of the counter
    assert_same(before, snapshot(model))


def test_capture_cache_is_a_bounded_lru():
    """A cache of 2 programs per model keeps the two most recently used input structures (here: texts
    without a mask, with one, and with token types); every length of a structure shares its program (the
    programs are exported for every size at once here, so that each structure holds one)."""
    model = models.hf_bert()
    cache = CaptureCache(size=2, first_export="dynamic")
    batch = models.text_batch(lengths=(5, 3))
    inputs = {"ids": {"input_ids": batch["input_ids"]},
              "mask": {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]},
              "types": {**batch, "token_type_ids": torch.zeros_like(batch["input_ids"])}}
    for k in ("ids", "mask"):
        cache.get(model, inputs[k])
    cache.get(model, inputs["ids"])  # ids is now the most recently used
    cache.get(model, inputs["types"])  # evicts mask
    assert cache.traces == 3
    assert len(cache.programs(model)) == 2
    cache.get(model, inputs["ids"])
    longer = models.text_batch(lengths=(9, 7))
    cache.get(model, {"input_ids": longer["input_ids"]})  # another length: the same program
    assert cache.traces == 3  # still cached
    cache.get(model, inputs["mask"])
    assert cache.traces == 4  # was evicted, captured again
    assert len(cache.programs(model)) == 2


def test_specializations_are_a_bounded_lru():
    """Each program keeps its last ``specializations`` input sizes; an evicted size is specialized again
    (a graph copy and its analysis), never exported again."""
    model = models.hf_bert()
    cache = CaptureCache(specializations=2, first_export="dynamic")
    for n in (3, 4, 5, 3):
        cache.get(model, models.text_batch(lengths=(n, n)))
    assert cache.traces == 1
    assert cache.specializations == 4  # 3 was evicted by 5, made again
    assert sorted(c.sizes[next(iter(c.sizes))] for c in cache.captured(model)) == [3, 5]


def test_default_cache_size_is_documented():
    assert relprop.CACHE_SIZE == CACHE_SIZE == CACHE.size >= 1
    docs = relprop.__file__.replace("__init__.py", "../docs/performance.md")  # the README's details moved to docs/
    assert f"LRU of {CACHE_SIZE} per model" in open(docs).read()
