"""No silent wrong answer: every model of the zoo (``tests/zoo.py``: text encoders, causal decoders,
timm and HF vision transformers, hierarchical and hybrid models, CLIP and SigLIP towers; tiny random
configs) with each of ``transformer_attribution``, ``lrp`` under ``preset="attnlrp"``, ``rollout`` and
``gradient_rollout`` gives EITHER a correct explanation OR a ``relprop.RelpropError`` that says why.

Correct is checked against computations independent of relprop's engine (``tests/zoo_checks.py``):
finite values; one score per input position; every self-attention block in the rollout; the
query = the token states the head reads (gradients through a deep copy of the model); a batch equal
to its samples alone; scores in the input's own patch order under ViTMAE's shuffles; conservation
under AttnLRP; the model untouched, also when explain() raises.

``zoo.FAST`` runs by default; the rest of the zoo is marked slow. ``python benchmarks/zoo_report.py``
prints the same outcomes as a table.
"""
import pytest

import zoo
from zoo_checks import run_cell

CELLS = [pytest.param(name, method, id=f"{name}-{method}",
                      marks=() if name in zoo.FAST else (pytest.mark.slow,))
         for name in zoo.ZOO for method in zoo.METHODS]


def test_zoo_is_large_and_covers_the_families():
    """At least 30 architectures, with the families the zoo promises."""
    assert len(zoo.ZOO) >= 30
    tags = {t for e in zoo.ZOO.values() for t in e.tags}
    assert {"text", "encoder", "decoder", "vision", "timm", "hf", "hierarchical", "hybrid", "multimodal",
            "mean-pool", "class-attention", "shuffle", "attention-pool"} <= tags
    assert set(zoo.FAST) <= set(zoo.ZOO)


@pytest.mark.parametrize("name, method", CELLS)
def test_correct_or_refused(name, method):
    """explain() on the model either returns an explanation that passes every check, or raises a
    RelpropError with a message; never another exception, a NaN or a wrong map."""
    outcome = run_cell(name, method)
    if not outcome.passed:
        pytest.fail(outcome.message(), pytrace=False)


# ------------------------------------------------------------------ the checks themselves catch wrong answers
# explain() wrapped to answer wrongly in one way each, on a model relprop explains correctly today
# (timm ViT with a class token): the checks must say which one failed, and pass a refusal with a reason.

import dataclasses  # noqa: E402

import torch  # noqa: E402

import relprop  # noqa: E402

_explain = relprop.explain


def _patched(monkeypatch, change):
    def wrong_explain(model, inputs, **kw):
        return change(_explain(model, inputs, **kw), model, inputs)
    monkeypatch.setattr(relprop, "explain", wrong_explain)


def _row(exp, r):
    return dataclasses.replace(exp, scores=exp.matrix[:, r, exp.prefix_tokens:].clone())


@pytest.mark.parametrize("change, check", [
    (lambda e, m, x: _row(e, 1), "query"),                                                   # a patch's row
    (lambda e, m, x: dataclasses.replace(e, scores=e.scores + 0.1 * e.scores.shape[0]), "batch"),
    (lambda e, m, x: dataclasses.replace(e, scores=e.scores * float("nan")), "finite"),
    (lambda e, m, x: dataclasses.replace(e, scores=e.scores[:, 1:]), "layout"),
    (lambda e, m, x: dataclasses.replace(e, blocks=e.blocks[1:]), "blocks"),
])
def test_checks_catch_a_wrong_map(monkeypatch, change, check):
    _patched(monkeypatch, change)
    outcome = run_cell("timm_vit", "rollout")
    assert outcome.status == "wrong" and any(f.startswith(check + ":") for f in outcome.failures), outcome.failures


def test_checks_catch_a_changed_model(monkeypatch):
    def touch(e, model, x):
        with torch.no_grad():
            model.head.bias.add_(0.0)
        model.head.bias.requires_grad_(False)
        return e
    _patched(monkeypatch, touch)
    try:
        outcome = run_cell("timm_vit", "gradient_rollout")
    finally:
        from zoo_checks import get_model
        get_model("timm_vit").head.bias.requires_grad_(True)
    assert any(f.startswith("untouched:") for f in outcome.failures), outcome.failures


def test_checks_catch_an_unconserved_lrp(monkeypatch):
    def leak(e, m, x):
        if e.conservation is None:
            return e
        c = dataclasses.replace(e.conservation, input=e.conservation.input * 0.9)
        return dataclasses.replace(e, conservation=c)
    _patched(monkeypatch, leak)
    outcome = run_cell("timm_vit", "lrp(attnlrp)")
    assert any(f.startswith("conservation:") for f in outcome.failures), outcome.failures


@pytest.mark.parametrize("name, error, passed, status", [
    ("timm_vit", RuntimeError("The size of tensor a (2) must match the size of tensor b (8)"), False, "crash"),
    # mamba declares its rollout refusal (no attention blocks): a refusal that says so passes
    ("mamba", relprop.MethodError("rollout needs attention blocks: no attention blocks found"), True, "refused"),
    # timm_vit declares none: the same refusal there is a regression
    ("timm_vit", relprop.MethodError("rollout needs attention blocks: no attention blocks found"), False, "wrong"),
    ("mamba", relprop.RelpropError(""), False, "wrong"),
])
def test_outcome_of_an_exception(monkeypatch, name, error, passed, status):
    def fail(model, inputs, **kw):
        raise error
    monkeypatch.setattr(relprop, "explain", fail)
    outcome = run_cell(name, "rollout")
    assert (outcome.passed, outcome.status) == (passed, status), outcome.message()
    assert outcome.cell().split(":")[0] in {"crash": "CRASH", "refused": "refused", "wrong": "WRONG"}[status]
    if name == "timm_vit" and status == "wrong":
        assert any(f.startswith("undeclared refusal") for f in outcome.failures), outcome.failures
