"""A captured graph is the model's code at capture time: a model whose code changed since (a patched
module-level function, a replaced instance ``forward``, LXT's monkey patch) is captured again, in
memory and on disk, with a note, and the explained score is the patched model's own
(:mod:`relprop.graph.code_identity`)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import types
import warnings

import pytest
import torch

import relprop
from relprop.graph.capture import CACHE
from relprop.graph import disk_cache
from relprop.graph.code_identity import changed, code_identity, fingerprint

HERE = os.path.dirname(os.path.abspath(__file__))


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    return LlamaForCausalLM(cfg).eval()


class _Counts:
    """The process cache's exports and disk loads since it was made (one per test)."""

    def __init__(self):
        self.t0, self.l0 = CACHE.traces, CACHE.loads

    @property
    def traces(self):
        return CACHE.traces - self.t0

    @property
    def loads(self):
        return CACHE.loads - self.l0


def _explain(model, ids, counts=None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return relprop.explain(model, {"input_ids": ids}, method="lrp", preset="attnlrp", target=5)


def _own_logit(model, ids) -> float:
    with torch.no_grad():
        return float(model(input_ids=ids).logits[0, -1, 5])


def test_patched_module_function_is_captured_again(monkeypatch):
    import transformers.models.llama.modeling_llama as modeling
    model, ids = _llama(), torch.randint(4, 64, (1, 8), generator=torch.Generator().manual_seed(1))
    cache = _Counts()
    first = _explain(model, ids)
    assert float(first.target_scores[0]) == pytest.approx(_own_logit(model, ids), abs=1e-5)
    original = modeling.apply_rotary_pos_emb

    def scaled_rotary(q, k, cos, sin, *args, **kwargs):
        q2, k2 = original(q, k, cos, sin, *args, **kwargs)
        return q2 * 1.5, k2

    monkeypatch.setattr(modeling, "apply_rotary_pos_emb", scaled_rotary)
    patched = _explain(model, ids)
    assert cache.traces == 2
    assert float(patched.target_scores[0]) == pytest.approx(_own_logit(model, ids), abs=1e-5)
    assert float(patched.target_scores[0]) != pytest.approx(float(first.target_scores[0]), abs=1e-5)
    note = [n for n in patched.notes if "code changed" in n]
    assert note and "scaled_rotary" in note[0], patched.notes
    monkeypatch.setattr(modeling, "apply_rotary_pos_emb", original)
    again = _explain(model, ids)  # the first program fits again: nothing exported
    assert cache.traces == 2
    assert torch.equal(again.scores, first.scores)


def test_replaced_instance_forward_is_captured_again():
    model, ids = _llama(), torch.randint(4, 64, (1, 8), generator=torch.Generator().manual_seed(2))
    cache = _Counts()
    first = _explain(model, ids)
    mlp = model.model.layers[0].mlp
    forward = type(mlp).forward
    mlp.forward = types.MethodType(lambda self, x: forward(self, x) * 2.0, mlp)
    patched = _explain(model, ids)
    assert cache.traces == 2
    assert float(patched.target_scores[0]) == pytest.approx(_own_logit(model, ids), abs=1e-5)
    assert any("instance forward of LlamaMLP" in n for n in patched.notes), patched.notes
    del mlp.forward
    restored = _explain(model, ids)
    assert cache.traces == 2 and torch.equal(restored.scores, first.scores)


def test_disk_cache_is_keyed_on_the_code(tmp_path, monkeypatch):
    import transformers.models.llama.modeling_llama as modeling
    model, ids = _llama(), torch.randint(4, 64, (1, 8), generator=torch.Generator().manual_seed(3))
    previous = disk_cache.set_cache_dir(str(tmp_path))
    try:
        first = _explain(model, ids)
        original = modeling.repeat_kv
        monkeypatch.setattr(modeling, "repeat_kv", lambda h, n: original(h, n) * 0.5)
        CACHE.clear(model)  # as a new process: nothing in memory
        cache = _Counts()
        patched = _explain(model, ids)
        assert (cache.loads, cache.traces) == (0, 1)  # the stored program is of the old code
        assert float(patched.target_scores[0]) == pytest.approx(_own_logit(model, ids), abs=1e-5)
        monkeypatch.setattr(modeling, "repeat_kv", original)
        CACHE.clear(model)
        cache = _Counts()
        restored = _explain(model, ids)
        assert (cache.loads, cache.traces) == (1, 0)
        assert torch.equal(restored.scores, first.scores)
    finally:
        disk_cache.set_cache_dir(previous)


def _make(scale):
    def f(x):
        return x * scale
    return f


def test_identity_reads_content_not_objects():
    """A function made again from the same code is the same; a different closure value or body is not;
    the digest is the same in another process."""
    class M(torch.nn.Module):
        def forward(self, x):
            return x + 1

    a, b = M(), M()
    assert fingerprint(code_identity(a)) == fingerprint(code_identity(b))
    b.forward = types.MethodType(_make(2.0), b)
    c = M()
    c.forward = types.MethodType(_make(3.0), c)
    fb, fc = code_identity(b), code_identity(c)
    assert fingerprint(fb) != fingerprint(fc) != fingerprint(code_identity(a))
    assert changed(fb, fc)
    assert not changed(fb, code_identity(b))
    model = _llama()
    here = fingerprint(code_identity(model))
    out = subprocess.run(
        [sys.executable, "-c", "import sys, json; sys.path.insert(0, sys.argv[1]); import test_code_identity as t; "
         "from relprop.graph.code_identity import code_identity, fingerprint; "
         "print(json.dumps(fingerprint(code_identity(t._llama()))))", HERE],
        capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == here


@pytest.mark.slow
def test_lxt_monkey_patch_is_seen():
    """LXT patches transformers' LLaMA module in place (its README's ``monkey_patch``): relprop captures
    the model again and explains the patched model's own logit."""
    pytest.importorskip("lxt")
    script = (
        "import sys, json, warnings; sys.path.insert(0, sys.argv[1]); warnings.simplefilter('ignore'); "
        "import torch, relprop, lxt_reference, llm_models; "
        "from relprop.graph.capture import CACHE; "
        "m = llm_models.build('llama'); x = llm_models.batch(1); "
        "e1 = relprop.explain(m, x, method='lrp', preset='attnlrp', target=5); "
        "lxt_reference._patch('llama'); "
        "e2 = relprop.explain(m, x, method='lrp', preset='attnlrp', target=5); "
        "own = float(m(**x).logits[0, -1, 5]); "
        "noted = any('code changed' in n for n in e2.notes); "
        "print(json.dumps([CACHE.traces, float(e2.target_scores[0]), own, noted]))")
    env = {**os.environ, "RELPROP_CACHE_DIR": "off"}
    out = subprocess.run([sys.executable, "-c", script, HERE], capture_output=True, text=True, check=True, env=env)
    traces, explained, own, noted = json.loads(out.stdout.strip().splitlines()[-1])
    assert traces == 2 and noted
    assert explained == pytest.approx(own, abs=1e-5)
