"""The engine's plan and executor (relprop.engine.schedule, relprop.engine.execute): every way the engine
runs today is a Schedule, and every schedule gives the numbers of the whole walk (float64, so that what is
compared is the route, not float32 rounding); the one chooser turns explain()'s options into the schedule
the docs describe; a schedule that cannot run says so."""
import dataclasses
import types

import pytest
import torch

import models
import relprop
from relprop.engine import WHOLE_WALK, Asked, Request, RowChunks, Schedule, choose, execute
from relprop.engine.trace import NotKept
from relprop.graph.capture import CACHE
from relprop.graph.inputs import bind_inputs
from relprop.methods import get_method
from relprop.methods.fold_maps import RowFold
from relprop.targets import next_token, resolve

CASES = {
    "hf_llama": lambda: (models.hf_llama("sdpa").double(), models.decoder_batch(lengths=(7, 5, 9)), "next"),
    "hf_bert": lambda: (models.hf_bert("eager").double(), models.text_batch(lengths=(7, 5, 9)), 1),
}
_BUILT = {}  # one model per case for the module: one capture each


def _case(name):
    if name not in _BUILT:
        _BUILT[name] = CASES[name]()
    return _BUILT[name]
THREE = RowChunks(rows=3)  # cores of 5-9 query rows: really chunked


def _request(name, preset="chefer2021", folds=()):
    model, batch, target = _case(name)
    kw = bind_inputs(model, batch)
    if "use_cache" in model.forward.__code__.co_varnames:
        kw["use_cache"] = False
    captured = CACHE.get(model, kw)
    b = kw[captured.primary].shape[0]
    tgt = resolve(next_token(kw["attention_mask"]) if target == "next" else target, b, captured.primary)
    return Request(captured, model, kw, tgt, preset=preset, folds=folds)


def _close(a, b, what, tol=1e-10):
    assert a is not None and b is not None, what
    scale = b.abs().max().clamp_min(1e-300)
    assert float((a - b).abs().max() / scale) <= tol, what


WALKS = {  # every schedule with the walk's relevance and the block records kept
    "whole": WHOLE_WALK,
    "segmented": Schedule(segmented=True),
    "segmented, two passes": Schedule(segmented=True, fused_segment=False),
}
DROPPED = {  # the walk without records: only the input relevance
    "cores whole": Schedule(segmented=True, records="dropped"),
    "cores in 3 rows": Schedule(segmented=True, records="dropped", cores=THREE),
    "cores in 3 rows, two passes": Schedule(segmented=True, records="dropped", cores=THREE, fused_segment=False),
    "cores in 1 row, fused forward": Schedule(segmented=True, records="dropped", cores=RowChunks(rows=1),
                                              fused_forward=True),
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("schedule", sorted(WALKS))
def test_every_walk_schedule_gives_the_whole_walks_records(name, schedule):
    ref = execute(_request(name))
    got = execute(_request(name), WALKS[schedule])
    _close(got.input_relevance, ref.input_relevance, f"{name} {schedule} input relevance")
    assert len(got.blocks) == len(ref.blocks) > 0
    for g, r in zip(got.blocks, ref.blocks):
        for field in ("attention", "gradient", "relevance", "hidden_relevance"):
            _close(getattr(g, field), getattr(r, field), f"{name} {schedule} block {r.index} {field}")
    _close(got.conservation.absorbed, ref.conservation.absorbed, f"{name} {schedule} absorbed")


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("schedule", sorted(DROPPED))
def test_every_schedule_without_records_gives_the_whole_walks_input_relevance(name, schedule):
    ref = execute(_request(name))
    got = execute(_request(name), DROPPED[schedule])
    assert got.blocks == [] and got.folded == []
    _close(got.input_relevance, ref.input_relevance, f"{name} {schedule}")
    _close(got.conservation.input, ref.conservation.input, f"{name} {schedule} ledger")


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("cores", [None, THREE])
def test_the_folded_schedule_gives_the_rollout_of_the_kept_records(name, cores):
    info = get_method("transformer_attribution")
    whole = execute(_request(name))
    kept = info.fn(whole)["tokens"]
    a = whole.session.captured.analysis
    mask = whole.session.kwargs.get("attention_mask")
    fold = RowFold(info, {}, len(a.blocks), mask, "chefer2021", a.token_mixing)
    got = execute(_request(name, folds=(fold,)), Schedule(segmented=True, records="folded", cores=cores))
    assert got.folded and isinstance(got.blocks, NotKept)
    _close(got.folded[0]["tokens"], kept, f"{name} folded, cores {cores}", 1e-9)


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("segmented", [False, True])
def test_the_gradient_schedule_gives_the_walks_attnlrp_relevance(name, segmented):
    """Two independent routes to one relevance (the gradient forms fold ε differently: 7e-8 apart)."""
    walk = execute(_request(name, "attnlrp"))
    fast = execute(_request(name, "attnlrp"), Schedule(relevance="gradient", records="dropped", segmented=segmented,
                                                       cores=THREE if segmented else None))
    assert fast.conservation is None and fast.blocks == []
    _close(fast.input_relevance, walk.input_relevance, f"{name} gradient, segmented={segmented}", 1e-6)


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_gradients_only_schedule_keeps_the_walks_gradients(name):
    ref = execute(_request(name))
    for schedule in (Schedule(relevance="none"), Schedule(relevance="none", segmented=True)):
        got = execute(_request(name), schedule)
        assert got.input_relevance is None and got.conservation is None
        for g, r in zip(got.blocks, ref.blocks):
            assert g.relevance is None
            _close(g.gradient, r.gradient, f"{name} {schedule.describe()} gradient")


def test_a_schedule_that_cannot_run_is_refused():
    with pytest.raises(ValueError, match="segmented"):
        Schedule(records="dropped")
    with pytest.raises(ValueError, match="records='dropped'"):
        Schedule(relevance="gradient")
    with pytest.raises(ValueError, match="keep"):
        Schedule(segmented=True, cores=THREE)
    with pytest.raises(ValueError, match="choices"):
        Schedule(relevance="fast")
    with pytest.raises(ValueError):
        RowChunks(rows=0)
    with pytest.raises(relprop.RelpropError, match="folds"):
        execute(_request("hf_bert"), Schedule(segmented=True, records="folded"))


# ------------------------------------------------------------------ the chooser

def _analysis(blocks=2, tokens=5, windows=None, streams=("input_ids",)):
    val = torch.empty(2, 3, tokens, tokens)
    blk = types.SimpleNamespace(attention=types.SimpleNamespace(meta={"val": val}), queries=tokens, keys=tokens,
                                folded_heads=None)
    return types.SimpleNamespace(blocks=[blk] * blocks, windows=windows, streams=list(streams), unmapped=False,
                                 sources=[], primary="input_ids")


def _choose(asked, preset=None, analysis=None, batch=2):
    captured = types.SimpleNamespace(analysis=analysis or _analysis(), plans={})
    return choose(captured, preset, 1e-9, asked, batch, torch.device("cpu"))


BIG, SMALL = float(1 << 40), 0.0


def test_the_chooser_keeps_or_folds_the_records_by_budget_and_keep_blocks():
    rollout = Asked(blocks=True, fold=None)
    assert _choose(dataclasses.replace(rollout, records_budget=BIG)) == Schedule(relevance="none")
    folded = _choose(dataclasses.replace(rollout, records_budget=SMALL))
    assert (folded.relevance, folded.segmented, folded.records, folded.cores) == ("none", True, "folded", RowChunks())
    assert "records_budget" in folded.notes[0]
    assert _choose(dataclasses.replace(rollout, keep_blocks=True, records_budget=SMALL)).records == "kept"
    forced = _choose(dataclasses.replace(rollout, keep_blocks=False, records_budget=BIG))
    assert forced.records == "folded" and "keep_blocks=False" in forced.notes[0]
    refused = _choose(dataclasses.replace(rollout, fold="no reason", keep_blocks=False))
    assert refused.records == "kept" and "no reason" in refused.notes[0]


def test_the_chooser_picks_gradient_forms_or_the_walk_for_input_relevance():
    """On a real graph: ``lrp`` under "attnlrp" takes the gradient forms, whole or segmented by budget and
    memory=; under "lrp" (no gradient forms) the walk, which drops its records past the budget."""
    captured = _request("hf_llama").captured
    cpu = torch.device("cpu")
    lrp = Asked(input_only=True, blocks=False)

    def pick(preset, **changes):
        return choose(captured, relprop.get_preset(preset), 1e-9, dataclasses.replace(lrp, **changes), 3, cpu)
    within, over = pick("attnlrp", records_budget=BIG), pick("attnlrp", records_budget=SMALL)
    assert (within.relevance, within.segmented, within.records, within.notes) == ("gradient", False, "dropped", ())
    assert (over.relevance, over.segmented, over.cores) == ("gradient", True, RowChunks())
    assert "segment by segment" in over.notes[0]
    assert pick("attnlrp", memory="high", records_budget=SMALL).segmented is False
    assert pick("attnlrp", fast_path=False).relevance == "walk"
    walk, dropped, low = pick("lrp", records_budget=BIG), pick("lrp", records_budget=SMALL), pick("lrp", memory="low")
    assert (walk.relevance, walk.segmented, walk.records) == ("walk", False, "kept")
    assert "fast path was not taken" in walk.notes[0] and not walk.warnings
    assert (dropped.segmented, dropped.records, dropped.cores) == (True, "dropped", RowChunks())
    assert "the rule-by-rule walk would hold" in dropped.notes[-1]
    assert (low.segmented, low.records) == (True, "dropped")
    assert pick("lrp", fast_path=True).warnings == (walk.notes[0],)


def test_the_chooser_copies_the_tuning_and_keeps_window_attention_whole():
    tuning = relprop.Tuning(chunks=RowChunks(rows=7), fused_segment=False, fused_forward=True)
    s = _choose(Asked(blocks=True, fold=None, keep_blocks=False, tuning=tuning))
    assert (s.cores, s.fused_segment, s.fused_forward) == (RowChunks(rows=7), False, True)
    windowed = _choose(Asked(memory="low"), analysis=_analysis(windows={"w": 1}))
    assert windowed.segmented is False and "window attention" in windowed.warnings[0]
