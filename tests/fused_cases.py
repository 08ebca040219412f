"""Tiny models, batches and comparisons shared by the tests of the fused attention core
(tests/test_fused_attention.py) and of the fused segment walk (tests/test_fused_segment.py), and the
forced counting path shared with tests/test_chunked_walk.py."""
import functools

import torch

import models
from relprop.engine import deferred_shares
from relprop.engine.chunked_walk import plan_cores
from relprop.graph.capture import CACHE
from relprop.graph.inputs import bind_inputs

aten = torch.ops.aten
F64_MIN = torch.finfo(torch.float64).min

BUILDERS = {f"{name}_{attn}": functools.partial(build, attn) for name, build in
            (("llama", models.hf_llama), ("gpt2", models.hf_gpt2_lm), ("bert", models.hf_bert))
            for attn in ("sdpa", "eager")}


@functools.lru_cache(maxsize=None)
def model(name, double=True):
    """A tiny model of BUILDERS (built once), in float64 unless ``double`` is False."""
    built = BUILDERS[name]()
    return built.double() if double else built


def batch(name, lengths=(7, 5, 9), seed=0):
    """A padded batch of texts of ``lengths`` for model ``name``."""
    return (models.text_batch if name.startswith("bert") else models.decoder_batch)(lengths=lengths, seed=seed)


def cores(name, double=True):
    """The row-local attention cores of model ``name`` as captured on :func:`batch`."""
    m = model(name, double)
    kwargs = bind_inputs(m, batch(name))
    if "use_cache" in m.forward.__code__.co_varnames:
        kwargs["use_cache"] = False
    return [c for c, _ in plan_cores(CACHE.get(m, kwargs).analysis).values()]


def close(a, b, what, tol):
    """``a`` equals ``b`` to ``tol`` of ``b``'s largest magnitude (both None, or both tensors)."""
    if a is None or b is None:
        assert a is None and b is None, what
        return
    err = float((a - b).abs().max() / b.abs().max().clamp_min(1e-300)) if b.numel() else 0.0
    assert err <= tol, f"{what}: {err}"


def same(got, ref, what, tol=1e-12):
    """Scores, head rows, input relevance and every figure of the ledger agree to ``tol``."""
    for field in ("scores", "heads", "input_relevance"):
        close(getattr(got, field), getattr(ref, field), f"{what} {field}", tol)
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
            close(getattr(b, field), getattr(wb, field), f"{what} block {b.name} {field}", tol)


def refuse_deferral(monkeypatch) -> None:
    """Make every core's walk refuse to defer its normalization once the first chunk's rules ran (the
    normalizing rule was seen), so that the counting path runs."""
    done = deferred_shares.Deferral.chunk_done

    def refuse(self):
        done(self)
        if self.node is not None:
            self.cannot("refused by the test")

    monkeypatch.setattr(deferred_shares.Deferral, "chunk_done", refuse)
