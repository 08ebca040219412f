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
