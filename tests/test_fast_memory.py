"""``lrp`` under AttnLRP/CP-LRP with ``memory`` not given: the one-backward fast path runs whole while its
attention maps fit ``records_budget`` and segment by segment with row-chunked attention cores beyond it
(relprop.engine.schedule.segment_choice), with a note, and the same relevance as the whole fast path.

The reference for the numbers is the whole fast path (``memory="high"``: never segmented), which
tests/test_fast_path.py checks against the rule-by-rule walk; the estimate is checked against blocks ×
batch × heads × queries × keys × 4 bytes × MAPS_PER_BLOCK counted by hand from the attention maps of a
full-record run."""
import pytest
import torch

import models
import relprop
from chunking import rows
from relprop.engine import schedule
from budget_checks import budget_notes, relative
from snapshot import assert_same, snapshot

CASES = {
    "hf_llama_eager": lambda: (models.hf_llama("eager"), models.decoder_batch(lengths=(7, 5, 9)), "next_token"),
    "hf_gpt2_lm": lambda: (models.hf_gpt2_lm("sdpa"), models.decoder_batch(lengths=(7, 5, 9)), "next_token"),
    "hf_bert_eager": lambda: (models.hf_bert("eager"), models.text_batch(lengths=(7, 5, 9)), 1),
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("preset", ["attnlrp", "cp_lrp"])
def test_over_budget_segments_with_a_note_and_the_same_relevance(name, preset):
    model, batch, target = CASES[name]()
    three = rows(3)  # cores of 5-9 query rows: really chunked
    before = snapshot(model)
    whole = relprop.explain(model, batch, target=target, method="lrp", preset=preset, memory="high",
                            records_budget=0, tuning=three)
    auto = relprop.explain(model, batch, target=target, method="lrp", preset=preset, records_budget=0, tuning=three)
    low = relprop.explain(model, batch, target=target, method="lrp", preset=preset, memory="low", tuning=three)
    assert not budget_notes(whole) and not budget_notes(low)
    (note,) = budget_notes(auto)
    assert "segment by segment" in note and "raise records_budget" in note
    assert torch.equal(auto.input_relevance, low.input_relevance)  # the segmented path, nothing else
    assert relative(auto.input_relevance, whole.input_relevance) <= 1e-5
    assert torch.equal(auto.scores, low.scores)
    assert_same(before, snapshot(model))


def test_within_budget_runs_whole_without_a_note():
    model, batch, target = CASES["hf_llama_eager"]()
    default = relprop.explain(model, batch, target=target, method="lrp", preset="attnlrp")  # tiny: far under
    whole = relprop.explain(model, batch, target=target, method="lrp", preset="attnlrp", memory="high")
    assert not budget_notes(default)
    assert torch.equal(default.input_relevance, whole.input_relevance)


def test_the_estimate_counts_every_blocks_attention_maps():
    model, batch, target = CASES["hf_llama_eager"]()
    exp = relprop.explain(model, batch, target=target, method="transformer_attribution", keep_blocks=True)
    by_hand = sum(b.attention.numel() for b in exp.blocks) * 4 * schedule.MAPS_PER_BLOCK
    blocks = relprop.api.prepare(model, batch, None).captured.analysis.blocks
    assert schedule.maps_bytes(blocks, batch["input_ids"].shape[0]) == by_hand
    need = schedule.maps_bytes(blocks, batch["input_ids"].shape[0])
    at = relprop.explain(model, batch, target=target, method="lrp", preset="attnlrp", records_budget=need)
    over = relprop.explain(model, batch, target=target, method="lrp", preset="attnlrp", records_budget=need - 1)
    assert not budget_notes(at) and len(budget_notes(over)) == 1


def test_choice_follows_memory_and_budget():
    class Block:  # the shape the estimate reads: the attention node's value [batch, heads, queries, keys]
        def __init__(self, t):
            self.attention = type("Node", (), {"meta": {"val": torch.empty(1, 2, t, t)}})()
            self.folded_heads = None
            self.queries = self.keys = t

    blocks = [Block(8), Block(8)]
    size = schedule.maps_bytes(blocks, 3)
    assert size == 2 * 3 * 2 * 8 * 8 * 4 * schedule.MAPS_PER_BLOCK
    cpu = torch.device("cpu")
    assert schedule.segment_choice("default", blocks, 3, cpu, size) == (False, None)
    segmented, note = schedule.segment_choice("default", blocks, 3, cpu, size - 1)
    assert segmented and "records_budget" in note
    assert schedule.segment_choice("low", blocks, 3, cpu, 1e18) == (True, None)
    assert schedule.segment_choice("high", blocks, 3, cpu, 0) == (False, None)
    assert schedule.segment_choice("default", [], 3, cpu, 0) == (False, None)
