"""explain() returns the numbers recorded in ``tests/golden/explain_outputs.pkl.gz``: every method
(and the preset/memory variants) on every model of the tiny zoo.

The comparison is bit for bit when this environment is the one that recorded the file (torch,
transformers and timm versions, CPU capability, thread count), else to float32 rounding of the
tensors' float64 summaries (``tests/golden/generate.py``). A few cases run by default; the whole
zoo is marked ``slow``.
"""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "golden"))
import generate  # noqa: E402

GOLDEN = generate.load()
EXACT = GOLDEN["environment"] == generate.environment()
CASES = {c[0]: c for c in generate.cases()}
FAST = ("timm_vit_tiny", "hf_bert_eager", "hf_swin", "hf_gpt2_lm", "hf_clip_text")


def _params():
    for name in CASES:
        marks = () if name in FAST else (pytest.mark.slow,)
        yield pytest.param(name, id=name, marks=marks)


@pytest.mark.parametrize("name", list(_params()))
def test_explain_matches_golden(name):
    """Where the environment differs and a field differs by more than 1e-3 of its scale, the case is
    recorded again in float64 here: the field may differ by up to 16 times as much as float32 rounding
    moves it on this machine (generate.float32_rounding, generate.ROUNDING_FACTOR)."""
    got = generate.record(CASES[name], progress=lambda s: None)
    problems = generate.compare(GOLDEN["cases"][name], got, True) if EXACT else \
        generate.compare_elsewhere(GOLDEN["cases"][name], got, CASES[name])
    how = "bit-identical" if EXACT else "float32 rounding"
    assert not problems, (f"{len(problems)} difference(s) from the golden file ({how} comparison):\n"
                          + "\n".join(problems[:30]))
