"""``explain(..., compile=True)`` (relprop.engine.compiled_walk): the relevance walk of a whole run traced
into one aten graph per input size and compiled by torch.compile. The first call at a size says in its
notes how long that took, later calls reuse the program (and say nothing), and every call gives the eager
walk's numbers to float32 rounding (the compiler fuses and reassociates), on other inputs of the same size
too. Compiling takes a minute or more on a CPU: slow tests."""
import pytest
import torch

import models
import relprop

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore")]
END = relprop.Tuning(host_reads="end")


def _close(a, b, what, tol=1e-5):
    scale = b.abs().max().clamp_min(1e-30)
    assert float((a - b).abs().max() / scale) <= tol, what


def test_the_compiled_walk_gives_the_eager_walks_numbers_and_is_reused():
    model = models.hf_bert("eager")
    x = models.text_batch(lengths=(7, 5))
    other = models.text_batch(lengths=(7, 3), seed=4)
    first = relprop.explain(model, x, target=1, compile=True)
    (note,) = [n for n in first.notes if n.startswith("compile=True")]
    assert "traced and compiled for this input size in" in note, note
    again = relprop.explain(model, other, target=0, compile=True)
    assert not [n for n in again.notes if n.startswith("compile=True")]
    for exp, inputs, target in ((first, x, 1), (again, other, 0)):
        ref = relprop.explain(model, inputs, target=target, tuning=END)
        _close(exp.scores, ref.scores, "scores")
        _close(exp.input_relevance, ref.input_relevance, "input relevance")
        _close(exp.conservation.absorbed, ref.conservation.absorbed, "ledger")
        for g, r in zip(exp.blocks, ref.blocks):
            _close(g.relevance, r.relevance, f"block {r.index} R_A")


def test_runs_that_are_not_a_whole_walk_run_eagerly_and_say_nothing_wrong():
    """compile=True applies to the walk of a whole run: the fast path and a segmented run are unchanged."""
    model = models.hf_llama("sdpa")
    x = models.decoder_batch(lengths=(7, 5))
    fast = relprop.explain(model, x, method="lrp", preset="attnlrp", compile=True)
    ref = relprop.explain(model, x, method="lrp", preset="attnlrp", tuning=END)
    assert torch.equal(fast.input_relevance, ref.input_relevance)
    assert any("ran eagerly" in n and "gradient" in n for n in fast.notes)
    low = relprop.explain(model, x, memory="low", compile=True)
    assert any("ran eagerly" in n and "segmented" in n for n in low.notes)
    with pytest.raises(relprop.OptionError, match="compile"):
        relprop.explain(model, x, compile="yes")
