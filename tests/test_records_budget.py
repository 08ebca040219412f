"""``explain(..., keep_blocks=None)`` (the default): every block's records are kept while they fit
``records_budget``; beyond it the rollout-style methods fold the blocks into the query row
(:func:`relprop.engine.schedule.fold_choice`), with the same result as the kept-records path and a note.

The reference is the full-record path (``keep_blocks=True``), which every other test checks against
the papers; the estimate is checked against blocks × batch × heads × queries × keys × 4 bytes × 3
counted by hand from the attention maps the run records.
"""
import functools
import types

import pytest
import torch

import relprop
from relprop.engine import budget
from relprop.engine.schedule import Asked, fold_choice

import models
from fold_checks import assert_folded_like_kept

FOLDED = ("transformer_attribution", "rollout", "gradient_rollout")
slow = pytest.mark.slow


@functools.lru_cache(maxsize=None)
def _model(make):
    return make()


CASES = {
    "hf_bert_eager_padded": (models.TEXT["hf_bert_eager"], models.text_batch, {"target": 1}),
    "hf_llama_causal": (models.DECODERS["hf_llama"], models.decoder_batch, {"target": "next_token"}),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("method", FOLDED)
@slow
def test_over_budget_folds_and_equals_the_kept_records(case, method):
    make, batch, kw = CASES[case]
    model = _model(make)
    x = batch()
    kept = relprop.explain(model, x, method=method, keep_blocks=True, records_budget=0, **kw)
    folded = relprop.explain(model, x, method=method, records_budget=0, **kw)  # keep_blocks not given
    assert kept.kept_blocks and not folded.kept_blocks
    assert_folded_like_kept(kept, folded)
    note = [n for n in folded.notes if "records_budget" in n]
    assert len(note) == 1 and "folded" in note[0] and "keep_blocks=True" in note[0], folded.notes
    assert not any("records_budget" in n for n in kept.notes)
    with pytest.raises(relprop.MethodError, match="keep_blocks=True"):
        len(folded.blocks)


@slow
def test_within_budget_keeps_the_records_without_a_note():
    model = _model(models.TEXT["hf_bert_eager"])
    x = models.text_batch()
    exp = relprop.explain(model, x, target=1)  # tiny: far under the default budget
    assert exp.kept_blocks and len(exp.blocks) == 2
    assert not any("records_budget" in n or "folded" in n for n in exp.notes)
    need = budget.records_bytes(_blocks(model, x), 4, 4, 1)
    exact = relprop.explain(model, x, target=1, records_budget=need)  # exactly at the budget: kept
    assert exact.kept_blocks
    over = relprop.explain(model, x, target=1, records_budget=need - 1)
    assert not over.kept_blocks


def _blocks(model, x):
    return relprop.api.prepare(model, x, None).captured.analysis.blocks


@slow
def test_estimate_is_the_recorded_attention_maps_counted_by_hand():
    model = _model(models.TEXT["hf_bert_eager"])
    x = models.text_batch()
    exp = relprop.explain(model, x, target=1, keep_blocks=True)
    by_hand = sum(b.attention.numel() + b.gradient.numel() + b.relevance.numel() for b in exp.blocks) * 4
    assert all(b.attention.dtype == torch.float32 for b in exp.blocks)
    assert budget.records_bytes(_blocks(model, x), x["input_ids"].shape[0], 4, 1) == by_hand
    # without relevance (rollout alone) A and dA; two presets, two traces
    assert budget.records_bytes(_blocks(model, x), 4, 4, 0) == by_hand * 2 // 3
    assert budget.records_bytes(_blocks(model, x), 4, 4, 2) == by_hand * 2


@slow
def test_explicit_choices_win_and_unfoldable_methods_keep_with_a_note():
    model = _model(models.TEXT["hf_bert_eager"])
    x = models.text_batch(lengths=(4, 6))
    assert relprop.explain(model, x, target=1, keep_blocks=True, records_budget=0).kept_blocks
    assert not relprop.explain(model, x, target=1, keep_blocks=False, records_budget=1 << 40).kept_blocks
    for method in ("attcat", ["transformer_attribution", "lrp"]):
        got = relprop.explain(model, x, target=1, method=method, records_budget=0)
        for e in got if isinstance(got, list) else [got]:
            assert e.kept_blocks
            assert any("records_budget" in n and "folding does not apply" in n for n in e.notes), e.notes
    # a method that keeps no records (the one-backward fast path) has nothing to fold: over the budget its
    # attention maps are segmented instead (tests/test_fast_memory.py)
    e = relprop.explain(model, x, target=1, method="lrp", preset="attnlrp", records_budget=0)
    notes = [n for n in e.notes if "records_budget" in n]
    assert len(notes) == 1 and "segment by segment" in notes[0] and "folded" not in notes[0], e.notes


@pytest.mark.parametrize("bad", [-1, "1GB", True, float("nan"), float("inf")])
def test_records_budget_is_checked_before_any_work(bad):
    with pytest.raises(relprop.OptionError, match="records_budget"):
        relprop.explain(torch.nn.Linear(2, 2), torch.zeros(1, 2), records_budget=bad)


def test_default_budget_is_a_fixed_gib_at_most_a_quarter_of_what_is_free(monkeypatch):
    cpu = torch.device("cpu")
    assert 0 < budget.default_budget(cpu) <= budget.DEFAULT_RECORDS_BUDGET
    monkeypatch.setattr(budget, "available_bytes", lambda device: 2 << 30)
    assert budget.default_budget(cpu) == (2 << 30) // 4
    monkeypatch.setattr(budget, "available_bytes", lambda device: None)
    assert budget.default_budget(cpu) == budget.DEFAULT_RECORDS_BUDGET


def test_choice_without_a_model():
    """The decision on a made-up graph analysis: 2 blocks of 3 heads × 5 × 5, batch 2."""
    val = torch.empty(2, 3, 5, 5)
    blk = types.SimpleNamespace(attention=types.SimpleNamespace(meta={"val": val}), queries=5, keys=5,
                                folded_heads=None)
    analysis = types.SimpleNamespace(blocks=[blk, blk], windows=None, streams=["input_ids"], unmapped=False)
    info = relprop.methods.get_method("transformer_attribution")
    size = 2 * 2 * 3 * 5 * 5 * 4 * 3
    captured = types.SimpleNamespace(analysis=analysis)
    why = relprop.methods.fold_maps.why_not(info, {}, analysis)
    cpu = torch.device("cpu")

    def asked(keep_blocks, budget_):
        return Asked(keep_blocks=keep_blocks, records_budget=budget_, blocks=info.needs_blocks, fold=why, runs=1)
    assert why is None
    assert budget.records_bytes(analysis.blocks, 2, 4, 1) == size
    assert fold_choice(captured, asked(None, size), 2, cpu) == (False, None)
    fold, note = fold_choice(captured, asked(None, size - 1), 2, cpu)
    assert fold and "records_budget" in note
    assert fold_choice(captured, asked(True, 0), 2, cpu) == (False, None)
    assert fold_choice(captured, asked(False, 1 << 40), 2, cpu) == (True, None)
