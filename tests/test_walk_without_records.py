"""``lrp`` under a preset without a one-backward fast path (``"lrp"``, ``"chefer2021"``) walks the graph rule
by rule; with ``memory="low"``, or where that walk's attention maps would exceed ``records_budget``, it runs
segment by segment with row-chunked attention cores and keeps no block records (a schedule with records dropped),
with a note, and the same input relevance as the whole walk.

The reference is the whole rule-by-rule walk (``records_budget`` far above the tiny models' maps), which
tests/test_rules_* and tests/test_fast_path.py check rule by rule; here only the run's shape changes. In float64,
so that what is compared is the route: the "lrp" preset amplifies float32 rounding (on GPT-2 the two routes
differ by 1.6e-4 of the max in float32, 8e-14 in float64)."""
import re

import pytest
import torch
from torch.utils._pytree import tree_map

import models
import relprop
import zoo
from relprop.api import prepare
from chunking import rows
from relprop.errors import RelpropError
from budget_checks import budget_notes, relative
from snapshot import assert_same, snapshot

CASES = {
    "hf_llama_eager": lambda: (models.hf_llama("eager"), models.decoder_batch(lengths=(7, 5, 9)), "next_token"),
    "hf_gpt2_lm": lambda: (models.hf_gpt2_lm("sdpa"), models.decoder_batch(lengths=(7, 5, 9)), "next_token"),
    "hf_bert_eager": lambda: (models.hf_bert("eager"), models.text_batch(lengths=(7, 5, 9)), 1),
}
BIG = 2.0 ** 40  # bytes: every tiny model's maps fit


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("preset", ["lrp", "chefer2021"])
def test_over_budget_walks_segments_without_records_and_the_same_relevance(name, preset):
    model, batch, target = CASES[name]()
    model = model.to(torch.float64)
    three = rows(3)  # cores of 5-9 query rows: really chunked
    before = snapshot(model)
    whole = relprop.explain(model, batch, target=target, method="lrp", preset=preset, records_budget=BIG,
                            tuning=three)
    auto = relprop.explain(model, batch, target=target, method="lrp", preset=preset, records_budget=0, tuning=three)
    low = relprop.explain(model, batch, target=target, method="lrp", preset=preset, memory="low",
                          records_budget=BIG, tuning=three)
    assert not budget_notes(whole) and not budget_notes(low)
    (note,) = budget_notes(auto)
    assert note.startswith("the rule-by-rule walk would hold") and "segment by segment" in note
    assert len(whole.blocks) > 0 and list(auto.blocks) == [] and list(low.blocks) == []  # as on the fast path
    assert torch.equal(auto.input_relevance, low.input_relevance)  # the segmented walk, nothing else
    # (LLaMA's norms and softmax stay float32 in a float64 copy: the chunked cores round them differently)
    llama = name == "hf_llama_eager"
    tol = models.LLAMA_FLOAT64_AGREEMENT if llama else 1e-10
    assert relative(auto.input_relevance, whole.input_relevance) <= tol
    assert torch.equal(auto.scores, low.scores)
    assert relative(auto.scores, whole.scores) <= tol
    assert relative(auto.target_scores, whole.target_scores) <= (tol if llama else 1e-12)  # (chunked cores: rounding)
    assert_same(before, snapshot(model))


def test_segmented_walk_of_attnlrp_equals_its_fast_path():
    """The rule-by-rule walk of AttnLRP, segmented without records (``fast_path=False``), against the
    whole one-backward fast path: two independent routes to one relevance."""
    model, batch, target = CASES["hf_llama_eager"]()
    fast = relprop.explain(model, batch, target=target, method="lrp", preset="attnlrp", memory="high")
    walked = relprop.explain(model, batch, target=target, method="lrp", preset="attnlrp", fast_path=False,
                             records_budget=0, tuning=rows(4))
    assert len(budget_notes(walked)) == 1 and list(walked.blocks) == []
    assert relative(walked.input_relevance, fast.input_relevance) <= 1e-5


def test_within_budget_walks_whole_and_keeps_the_records():
    model, batch, target = CASES["hf_llama_eager"]()
    exp = relprop.explain(model, batch, target=target, method="lrp", preset="lrp")  # tiny: far under the budget
    assert not budget_notes(exp)
    assert len(exp.blocks) == len(prepare(model, batch, None).captured.analysis.blocks)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("name", sorted(zoo.ZOO))
def test_every_zoo_model_walks_without_records_like_the_whole_walk(name):
    """``lrp`` as called (its ``"lrp"`` preset) on every model of the zoo, float64, 3-row chunks: over the
    budget it is the segmented walk without records (a note says so) with the whole walk's input relevance
    to 1e-9; window attention (Swin) and two token streams keep the whole walk; the zoo's refusals stand."""
    entry = zoo.ZOO[name]
    torch.manual_seed(0)
    model = entry.build().eval().double()
    inputs = tree_map(lambda t: t.double() if torch.is_tensor(t) and t.is_floating_point() else t,
                      entry.inputs(model, 2, 0))
    kw = dict(target=entry.target, method="lrp", preset="lrp", tuning=rows(3),
              **({"wrt": entry.wrt} if entry.wrt else {}))
    refused = [msg for methods, msg in entry.refusals if re.fullmatch(methods, "lrp")]
    if refused:
        with pytest.raises(RelpropError) as refusal:
            relprop.explain(model, inputs, records_budget=0, **kw)
        assert re.search(refused[0], str(refusal.value), re.S), name
        return
    whole = relprop.explain(model, inputs, records_budget=BIG, **kw)
    auto = relprop.explain(model, inputs, records_budget=0, **kw)
    a = prepare(model, inputs, None).captured.analysis
    segmented = bool(a.blocks) and not a.windows and len(a.streams) <= 1
    assert bool(budget_notes(auto)) == segmented, name
    assert (list(auto.blocks) == []) == (segmented or not a.blocks), name
    # 1e-9: plain LRP's z-rule magnifies float64 rounding where a sum nearly cancels, and the two walks sum in
    # other orders (PVTv2's spatial-reduction attention: 1.27e-10 measured on a 2-core machine, 2026-12-02)
    assert relative(auto.input_relevance, whole.input_relevance) <= 1e-9, name
