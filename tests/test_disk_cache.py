"""Captured programs on disk (relprop.graph.disk_cache, relprop.graph.serialize).

* A program read back from disk explains bit for bit like the freshly exported one, in this process
  after the in-memory cache is cleared and in a new process (slow).
* The key is what decides the graph, never a weight: a changed config, dtype, library version or
  parameter shape is another key (a new export); a copy of the model with other weights shares it.
* A file that cannot be read (garbage, truncated, another key) is rebuilt, never trusted.
* ``RELPROP_CACHE_DIR=off`` / ``relprop.set_cache_dir(None)`` writes nothing; a model with hooks is
  not cached on disk.
"""
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import transformers

import models
import relprop
from relprop.graph import disk_cache
from relprop.graph.capture import CACHE


@pytest.fixture
def cache_dir(tmp_path):
    previous = relprop.set_cache_dir(str(tmp_path))
    try:
        yield tmp_path
    finally:
        relprop.set_cache_dir(previous)


def _counts():
    return CACHE.traces, CACHE.loads


def _explain(model, batch=None):
    return relprop.explain(model, batch if batch is not None else models.text_batch(lengths=(9, 7)), target=0)


def test_a_program_read_from_disk_explains_bit_for_bit(cache_dir):
    model = models.hf_bert()
    relprop.clear_cache(model)
    exported = _explain(model)
    assert len(disk_cache.files()) == 1
    relprop.clear_cache(model)
    traces, loads = _counts()
    loaded = _explain(model)
    other_length = _explain(model, models.text_batch(lengths=(5, 4)))
    # the first call's program read once; another length exports the program of every size once
    assert _counts() == (traces + 1, loads + 1)
    for f in ("scores", "input_relevance", "target_scores"):
        assert torch.equal(getattr(exported, f), getattr(loaded, f)), f
    for a, b in zip(exported.blocks, loaded.blocks):
        assert torch.equal(a.attention, b.attention) and torch.equal(a.relevance, b.relevance)
    assert other_length.scores.shape == (2, 5)


def _config_variant(**change):
    torch.manual_seed(0)
    cfg = models._text_cfg(transformers.BertConfig, attn_implementation="eager", **change)
    return transformers.BertForSequenceClassification(cfg).eval()


def test_a_changed_config_is_another_key(cache_dir):
    _explain(models.hf_bert())
    traces, loads = _counts()
    _explain(_config_variant(hidden_act="relu"))  # the same parameters, another activation
    assert _counts() == (traces + 1, loads)


def test_another_dtype_is_another_key(cache_dir):
    _explain(models.hf_bert())
    traces, loads = _counts()
    _explain(models.hf_bert().double())
    assert _counts() == (traces + 1, loads)


def test_another_library_version_is_another_key(cache_dir, monkeypatch):
    _explain(models.hf_bert())
    versions = disk_cache._versions()
    monkeypatch.setattr(disk_cache, "_versions", lambda: {**versions, "torch": versions["torch"] + ".other"})
    traces, loads = _counts()
    _explain(models.hf_bert())
    assert _counts() == (traces + 1, loads)


class _Head(torch.nn.Module):
    def __init__(self, classes):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 8), torch.nn.Linear(8, classes)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def test_another_parameter_shape_is_another_key(cache_dir):
    x = torch.rand(2, 4)
    relprop.explain(_Head(3), x, target=0, method="lrp")
    traces, loads = _counts()
    relprop.explain(_Head(5), x, target=0, method="lrp")
    assert _counts() == (traces + 1, loads)
    relprop.explain(_Head(5), x, target=0, method="lrp")  # the same structure, other weights: read from disk
    assert _counts() == (traces + 1, loads + 1)


def _scaled():
    m = models.hf_bert()
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(1.5)
    return m


def test_other_weights_share_the_graph_and_give_their_own_numbers(cache_dir):
    _explain(models.hf_bert())
    traces, loads = _counts()
    loaded = _explain(_scaled())  # a fine-tuned copy: the same structure, other weights
    assert _counts() == (traces, loads + 1)
    relprop.set_cache_dir(None)
    fresh = _explain(_scaled())  # exported afresh
    assert _counts() == (traces + 1, loads + 1)
    assert torch.equal(loaded.scores, fresh.scores)


@pytest.mark.parametrize("damage", ["garbage", "truncated", "empty"])
def test_a_corrupt_file_is_rebuilt_not_trusted(cache_dir, damage):
    _explain(models.hf_bert())
    (path,) = disk_cache.files()
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write({"garbage": os.urandom(len(data)), "truncated": data[: len(data) // 2], "empty": b""}[damage])
    traces, loads = _counts()
    exp = _explain(models.hf_bert())
    assert _counts() == (traces + 1, loads)  # exported again
    assert disk_cache.files() == [path] and open(path, "rb").read() != b""
    relprop.clear_cache()
    again = _explain(models.hf_bert())
    assert _counts() == (traces + 1, loads + 1)  # the rebuilt file is read
    assert torch.equal(exp.scores, again.scores)


def test_off_writes_nothing(tmp_path):
    previous = relprop.set_cache_dir(None)
    try:
        _explain(models.hf_bert())
        assert disk_cache.files() == []
        assert not any(tmp_path.iterdir())
    finally:
        relprop.set_cache_dir(previous)


def test_a_model_with_hooks_is_not_cached_on_disk(cache_dir):
    model = models.hf_bert()
    handle = model.bert.encoder.layer[0].register_forward_hook(lambda m, i, o: None)
    try:
        _explain(model)
    finally:
        handle.remove()
    assert disk_cache.files() == []


@pytest.mark.slow
def test_a_new_process_reads_the_graph(tmp_path):
    """Two processes: the first exports and writes, the second reads (no export) and explains alike."""
    script = textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        import models, relprop
        from relprop.graph.capture import CACHE
        relprop.set_cache_dir({str(tmp_path)!r})
        exp = relprop.explain(models.hf_bert(), models.text_batch(lengths=(9, 7)), target=0)
        torch.save(exp.scores, sys.argv[1])
        print(CACHE.traces, CACHE.loads)
    """)
    outs = []
    for i in range(2):
        path = tmp_path / f"scores{i}.pt"
        r = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True, check=True,
                           env={**os.environ, "RELPROP_CACHE_DIR": str(tmp_path)})
        outs.append((r.stdout.split()[-2:], torch.load(path)))
    assert outs[0][0] == ["1", "0"] and outs[1][0] == ["0", "1"]
    assert torch.equal(outs[0][1], outs[1][1])


class _Named(torch.nn.Module):
    """A model whose input is called ``input``: fx renames a node of that name (a Python builtin)
    when a graph is copied or rebuilt, which neither the specialization nor the reader may lose."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(6, 8), torch.nn.Linear(8, 3)

    def forward(self, input):
        return self.b(torch.relu(self.a(input)))


def test_an_input_named_like_a_builtin_survives_specialization_and_disk(cache_dir):
    model = _Named().eval()
    relprop.clear_cache(model)
    x = torch.randn(2, 6)
    kwargs = dict(target=1, method="input_x_gradient")
    exported = relprop.explain(model, x, **kwargs)
    relprop.clear_cache(model)
    traces, loads = _counts()
    loaded = relprop.explain(model, x, **kwargs)
    assert _counts() == (traces, loads + 1)
    assert torch.equal(exported.scores, loaded.scores)
    x.requires_grad_(True)
    (model(x)[:, 1].sum()).backward()
    torch.testing.assert_close(loaded.scores, (x.grad * x).detach(), rtol=1e-5, atol=1e-6)
