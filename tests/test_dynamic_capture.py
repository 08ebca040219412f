"""One capture per model for every input size (relprop.graph.export, .program, .specialize).

* A dynamic capture explains exactly as the capture of the previous release did (the batch axis
  dynamic, every other axis fixed to the input's sizes): every method and variant of the golden
  cases, bit for bit (a few cases by default, the whole zoo in the slow suite).
* One model explained at 10 lengths and 3 batch sizes is exported once; every length gets its own
  specialization (a graph copy with concrete shapes and its analysis).
* A program takes only inputs that fit it: a fixed axis of another size, a symbol bound to two
  sizes, a size outside its range, another dtype or input name is refused (a new capture).
* A model whose sequence axis torch.export fixes says so in ``exp.notes``.
"""
import os
import sys

import pytest
import torch

import models
import relprop
from relprop.graph import export
from relprop.graph.capture import CACHE, CaptureCache
from relprop.graph.capture_notes import capture_notes

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "golden"))
import generate  # noqa: E402

CASES = {c[0]: c for c in generate.cases()}
FAST = ("timm_vit_tiny", "hf_bert_eager", "hf_gpt2_lm", "hf_clip_text")


def _params():
    for name in CASES:
        yield pytest.param(name, id=name, marks=() if name in FAST else (pytest.mark.slow,))


@pytest.mark.parametrize("name", list(_params()))
def test_dynamic_capture_explains_like_the_per_size_capture(name):
    """Every method and variant of a golden case, captured with dynamic sizes and with the sizes fixed:
    the same tensors bit for bit (same arithmetic; only the sizes are computed at run time)."""
    dynamic = generate.record(CASES[name], progress=lambda s: None)
    CACHE.attempts = export.ATTEMPTS[1:]
    try:
        fixed = generate.record(CASES[name], progress=lambda s: None)
    finally:
        CACHE.attempts = export.ATTEMPTS
    problems = generate.compare(fixed, dynamic, exact=True)
    assert not problems, "\n".join(problems[:30])


def test_one_capture_for_every_length_and_batch_size():
    """The first call is captured at its sizes (the fastest export); the first call of another size exports
    the program of every size, which every later length and batch size shares."""
    model = models.hf_bert()
    relprop.clear_cache(model)
    exports, specs = CACHE.traces, CACHE.specializations
    lengths = (4, 5, 6, 7, 9, 11, 14, 17, 23, 30)
    results = {}
    for n in lengths:
        for b in (1, 2, 3):
            batch = models.text_batch(lengths=tuple(range(n, n - b, -1)))
            results[n, b] = relprop.explain(model, batch, target=0)
    assert CACHE.traces - exports == 2
    # the first call's own program, then one specialization per length of the program of every size
    assert CACHE.specializations - specs == 1 + len(lengths)
    assert [p.exported_as for p in CACHE.programs(model)] == [export.FIRST_CALL_SIZES[0], "dynamic sizes"]
    # the first sample of a batch explains as it does alone (batch invariance across the shared graph)
    for n in lengths:
        alone = results[n, 1].scores[0]
        for b in (2, 3):
            torch.testing.assert_close(results[n, b].scores[0], alone, rtol=1e-5, atol=1e-7)


def test_a_program_takes_only_inputs_that_fit_it():
    model = models.hf_bert()
    cache = CaptureCache(disk=False, first_export="dynamic")
    batch = models.text_batch(lengths=(9, 7))
    cache.get(model, batch)
    (program,) = cache.programs(model)
    state = program.state
    ids, mask = batch["input_ids"], batch["attention_mask"]
    assert program.match({"input_ids": ids[:, :5], "attention_mask": mask[:, :5]}, "input_ids", state) is not None
    # the mask must have the ids' length (one symbol for both)
    assert program.match({"input_ids": ids[:, :5], "attention_mask": mask[:, :6]}, "input_ids", state) is None
    # beyond the position embeddings (64 in the tiny config): out of the exported range
    long = torch.ones(2, 65, dtype=torch.long)
    assert program.match({"input_ids": long, "attention_mask": long}, "input_ids", state) is None
    assert program.match({"input_ids": ids.int(), "attention_mask": mask}, "input_ids", state) is None
    assert program.match({"input_ids": ids}, "input_ids", state) is None
    assert program.match(batch, "attention_mask", state) is None
    assert program.match(batch, "input_ids", state + (("torch.float64", "cpu"),)) is None


def test_a_fixed_sequence_axis_is_said_in_the_notes():
    """Exported with every axis fixed (as a model whose code needs one length would be), a text model
    says in exp.notes that each new length is captured again; explained at another length, it is. (The
    first call, captured at its own sizes, claims nothing about lengths: that its code fixes them is known
    once another length was tried.)"""
    model = models.hf_bert()
    relprop.clear_cache(model)
    CACHE.attempts = export.ATTEMPTS[1:]
    try:
        exports = CACHE.traces
        first = relprop.explain(model, models.text_batch(lengths=(9, 7)), target=0)
        again = relprop.explain(model, models.text_batch(lengths=(9, 7), seed=3), target=0)
        other = relprop.explain(model, models.text_batch(lengths=(6, 5)), target=0)
    finally:
        CACHE.attempts = export.ATTEMPTS
    assert CACHE.traces - exports == 2
    assert not any("sequence length" in n for n in first.notes)
    assert not any("sequence length" in n for n in again.notes)  # the same length: cached, nothing to say
    assert any("fixed BertForSequenceClassification's sequence length to 6 tokens" in n for n in other.notes)


def test_the_dynamic_capture_says_its_stages_and_nothing_about_sizes():
    """The first call's note gives each stage's seconds; the first call of another size says that the program
    of every size was exported; a new size of that program says nothing."""
    model = models.hf_bert()
    relprop.clear_cache(model)
    exp = relprop.explain(model, models.text_batch(lengths=(9, 7)), target=0)
    assert not any("captured" in n or "sequence length" in n for n in exp.notes)
    (stages,) = [n for n in exp.notes if n.startswith("first call on inputs like these")]
    for stage in ("torch.export", "decomposition node by node", "relprop's analysis of the graph", "first run"):
        assert stage in stages, stages
    second = relprop.explain(model, models.text_batch(lengths=(5, 4)), target=0)
    assert any("exported again, for every input size" in n for n in second.notes), second.notes
    other = relprop.explain(model, models.text_batch(lengths=(6, 3)), target=0)
    assert not any("export" in n or "first call" in n for n in other.notes), other.notes


def test_a_static_first_capture_takes_only_its_sizes_then_exports_for_every_size():
    """CaptureCache(first_export="static"): the first program is the call's sizes only; the first call
    of other sizes exports the dynamic one (and says why in exp.notes through capture_notes)."""
    model = models.hf_bert()
    cache = CaptureCache(disk=False, first_export="static")
    batch = models.text_batch(lengths=(9, 7))
    cache.get(model, batch)
    (program,) = cache.programs(model)
    assert program.exported_as == export.FIRST_CALL_SIZES[0]
    assert program.match(batch, "input_ids", program.state) == {}
    ids, mask = batch["input_ids"], batch["attention_mask"]
    assert program.match({"input_ids": ids[:, :5], "attention_mask": mask[:, :5]}, "input_ids", program.state) is None
    assert program.same_structure({"input_ids": ids[:1, :3], "attention_mask": mask[:1, :3]}, "input_ids",
                                  program.state)
    events = []
    captured = cache.get(model, {"input_ids": ids[:1], "attention_mask": mask[:1]}, "input_ids", events)
    assert [p.exported_as for p in cache.programs(model)] == [export.FIRST_CALL_SIZES[0], "dynamic sizes"]
    notes = capture_notes(events[0], captured, "BERT")
    assert any("exported again, for every input size" in n for n in notes), notes
    cache.get(model, models.text_batch(lengths=(4, 3)))
    assert cache.traces == 2


def test_image_sizes_share_a_capture_when_the_model_takes_several():
    """timm's dynamic_img_size=True: one export for the first size (32x32) and one for every other (48x64,
    64x64); each size's map has its own patch grid."""
    import timm
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=5, depth=2, img_size=64,
                              dynamic_img_size=True).eval()
    exports = CACHE.traces
    grids = []
    for h, w in ((32, 32), (48, 64), (64, 64)):
        exp = relprop.explain(model, torch.randn(2, 3, h, w), target=0)
        grids.append(tuple(exp.map.shape[-2:]))
        assert exp.scores.shape == (2, (h // 16) * (w // 16))
    assert CACHE.traces - exports == 2
    assert grids == [(32, 32), (48, 64), (64, 64)]
