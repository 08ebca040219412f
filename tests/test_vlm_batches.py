"""A batch of prompts for the vision-language families relprop explains one sample per call (Qwen2-VL,
Qwen2.5-VL, LLaVA-NeXT, LLaVA-OneVision; relprop/api/vlm_batches.py), tiny random configs (tests/vlm_models.py):

* batch invariance: a batch of two prompts of different lengths (padded on the left or the right)
  explains each sample exactly as that sample's own processor output explained alone: scores, maps,
  masks, streams, targets, conservation and notes, the per-token fields laid on the batch's padded
  positions with 0 (mask False) at the padding; pixels (``lrp``) and the language model's tokens
  (``rollout``);
* refusals before any work (Qwen2-VL, LLaVA-NeXT): images of different grids (per-pixel maps that cannot
  be stacked), a callable target, a mask that is not one run of ones; and a cut sample whose logits are
  not its row of the batch's (checked before explaining);
* the model untouched.
"""
from __future__ import annotations

import pytest
import torch

import relprop
import vlm_models as V
from relprop.models import vlm_batches
from relprop.explanation import joined
from relprop.targets import next_token
from snapshot import assert_same, snapshot


def _padded(samples, side: str, image_keys):
    """The batch of ``samples`` (each the processor's output for one prompt), prompts padded with 0 on ``side``."""
    length = max(s["input_ids"].shape[1] for s in samples)
    out = {}
    for k in ("input_ids", "attention_mask", "mm_token_type_ids"):
        if k not in samples[0]:
            continue
        rows = []
        for s in samples:
            pad = torch.zeros(1, length - s[k].shape[1], dtype=s[k].dtype)
            rows.append(torch.cat([s[k], pad] if side == "right" else [pad, s[k]], 1))
        out[k] = torch.cat(rows)
    for k in image_keys:
        out[k] = torch.cat([s[k] for s in samples])
    return out


def _qwen_samples():
    return [V.qwen_inputs(V.qwen_image(0), before=3, after=3, seed=0),
            V.qwen_inputs(V.qwen_image(1), before=1, after=1, seed=1)]


def _next_samples():
    """Two images of different sizes (32x64 and 16x64: the same 1x2 crop grid, different unpadding and token
    counts) with prompts of different lengths."""
    return [V.anyres_batch(32, seed=0, before=3, after=3), V.anyres_batch(16, seed=1, before=1, after=2)]


QWEN_KEYS, ANYRES_KEYS = ("pixel_values", "image_grid_thw"), ("pixel_values", "image_sizes")
CASES = {"qwen2_vl": (V.qwen2_vl, _qwen_samples, QWEN_KEYS), "llava_next": (V.llava_next, _next_samples, ANYRES_KEYS),
         "qwen2_5_vl": (V.qwen2_5_vl, _qwen_samples, QWEN_KEYS),
         "llava_onevision": (V.ONEVISION_FAMILIES["onevision"], _next_samples, ANYRES_KEYS)}
#: the families of the refusal tests (before any work: one of each kind)
REFUSING = ["qwen2_vl", "llava_next"]


@pytest.fixture(scope="module")
def models():
    """``models(family)``, built once and called once on its first sample (transformers' first-call hooks,
    tests/vlm_models.model_cache), so that the snapshots below see only what explain() changes."""
    return V.model_cache({k: c[0] for k, c in CASES.items()}, lambda k: CASES[k][1]()[0])


def _same_on_positions(batch_value, alone, keep, token_axes):
    """``batch_value`` (one sample, batch axis 1) equals ``alone`` at ``keep`` of each token axis and is 0 elsewhere."""
    if alone is None:
        assert batch_value is None
        return
    x = batch_value
    for d in token_axes:
        rest = torch.ones(x.shape[d], dtype=torch.bool)
        rest[keep] = False
        assert not bool(x.index_select(d, torch.nonzero(rest).reshape(-1)).any()), "padding must be 0"
        x = x.index_select(d, keep)
    assert torch.equal(x, alone)


def _check_sample(e, i, one, keep, tokens_mode):
    """Sample i of the batch's Explanation ``e`` against ``one``, its sample explained alone."""
    both = e[i]
    for name in ("scores", "mask", "input_relevance", "matrix", "query"):
        a, b = getattr(both, name), getattr(one, name)
        if a is None:
            assert b is None
            continue
        _same_on_positions(a, b, keep, [d for d in range(1, a.dim()) if tokens_mode])
    for name in ("map", "target", "target_scores"):
        a, b = getattr(both, name), getattr(one, name)
        assert (a is None and b is None) or torch.equal(a, b)
    assert both.streams.keys() == one.streams.keys()
    for k, v in one.streams.items():
        _same_on_positions(both.streams[k], v, keep, [1] if k == "input_ids" else [])
    _same_on_positions(both.image_tokens, one.image_tokens, keep, [1])
    for name in ("prompt_tokens", "tokens"):  # token strings: on the batch's positions, "" at the padding
        a, b = getattr(both, name), getattr(one, name)
        if b is None:
            assert a is None
            continue
        assert [a[0][j] for j in keep.tolist()] == b[0]
        assert all(s == "" for j, s in enumerate(a[0]) if j not in set(keep.tolist()))
    if one.conservation is not None:
        for f in ("injected", "input", "absorbed"):
            assert torch.equal(getattr(both.conservation, f), getattr(one.conservation, f))
    assert both.grid == one.grid and both.modality == one.modality
    assert len(e.blocks) == len(one.blocks)
    assert set(one.notes) <= set(e.notes)
    assert any("explained sample by sample" in n for n in e.notes)


def _check_blocks(e, ones, keeps, length):
    """Each block record of the batch: a field with one row per sample holds sample i's at row i (its token
    axes laid on the batch's positions, 0 at the padding); a field with several rows per sample (LLaVA-NeXT's
    vision tower: a row per tile) holds the samples' rows one after the other."""
    padded = any(len(k) != length for k in keeps)
    for j, block in enumerate(e.blocks):
        for name in ("attention", "gradient", "relevance", "hidden", "value"):
            got, alone = getattr(block, name), [getattr(o.blocks[j], name) for o in ones]
            if alone[0] is None:
                assert got is None
            elif alone[0].shape[0] != 1:
                assert torch.equal(got, torch.cat(alone))
            else:
                for i, (a, keep) in enumerate(zip(alone, keeps)):
                    axes = [d for d in range(1, a.dim()) if padded and a.shape[d] == len(keep)
                            and got.shape[d] == length]
                    _same_on_positions(got[i:i + 1], a, keep, axes)


@pytest.mark.slow
@pytest.mark.parametrize("family", list(CASES))
@pytest.mark.parametrize("side", ["right", "left"])
def test_a_batch_explains_each_sample_as_alone(models, family, side):
    model = models(family)
    samples = CASES[family][1]()
    batch = _padded(samples, side, CASES[family][2])
    assert batch["input_ids"].shape[1] > min(s["input_ids"].shape[1] for s in samples)  # padding in the batch
    before = snapshot(model)
    for method, tokens_mode in (("lrp", False), ("rollout", True)):
        e = relprop.explain(model, batch, target="next_token", method=method)
        assert len(e) == 2 and e.scores.shape[0] == 2
        if tokens_mode:
            assert e.scores.shape[1] == batch["input_ids"].shape[1]
            assert torch.equal(e.mask[batch["attention_mask"] == 0], torch.zeros_like(e.mask[batch["attention_mask"]
                                                                                                == 0]))
        ones, keeps = [], []
        for i, sample in enumerate(samples):
            ones.append(relprop.explain(model, sample, target="next_token", method=method))
            keeps.append(torch.nonzero(batch["attention_mask"][i]).reshape(-1))
            _check_sample(e, i, ones[-1], keeps[-1], tokens_mode)
        _check_blocks(e, ones, keeps, batch["input_ids"].shape[1])
    assert_same(before, snapshot(model))


@pytest.mark.slow
def test_per_sample_targets_and_a_list_of_methods(models):
    """target= (a next token, a contrast) and special_tokens_mask= one per sample are cut per sample; a list of
    methods gives one batch Explanation per method."""
    model = models("qwen2_vl")
    samples = _qwen_samples()
    batch = _padded(samples, "right", CASES["qwen2_vl"][2])
    exps = relprop.explain(model, batch, target=next_token(token=[5, 7]), method=["lrp", "input_x_gradient"])
    assert [x.method for x in exps] == ["lrp", "input_x_gradient"]
    special = torch.zeros_like(batch["input_ids"], dtype=torch.bool)
    special[:, 0] = True  # BOS; cut per sample like input_ids
    versus = relprop.contrast(next_token(token=[5, 7]), next_token(token=9))
    contrasted = relprop.explain(model, batch, target=versus, method="lrp", special_tokens_mask=special)
    for i, (sample, token) in enumerate(zip(samples, (5, 7))):
        one = relprop.explain(model, sample, target=next_token(token=token), method=["lrp", "input_x_gradient"])[0]
        assert torch.equal(exps[0].scores[i], one.scores[0])  # the same call, alone
        assert torch.equal(exps[0].target_scores[i:i + 1], one.target_scores)
        versus = relprop.contrast(next_token(token=token), next_token(token=9))
        one = relprop.explain(model, sample, target=versus, method="lrp",
                              special_tokens_mask=special[i:i + 1, :sample["input_ids"].shape[1]])
        assert torch.equal(contrasted.target_scores[i:i + 1], one.target_scores)
        keep = torch.arange(sample["input_ids"].shape[1])
        _same_on_positions(contrasted.streams["input_ids"][i:i + 1], one.streams["input_ids"], keep, [1])


def _watched(model):
    calls = []
    handle = model.register_forward_pre_hook(lambda m, a: calls.append(1))
    return calls, handle


@pytest.mark.parametrize("family", REFUSING)
def test_images_of_different_grids_are_refused_before_any_work(models, family):
    model = models(family)
    samples = CASES[family][1]()
    if family == "qwen2_vl":  # a 32x32 image: a 4x4 grid against the other's 4x6
        samples[1] = V.qwen_inputs(V.qwen_image(1)[:, :, :32], before=1, after=1, seed=1)
        says = r"Qwen2-VL.*different grids.*\[\[1, 4, 6\], \[1, 4, 4\]\].*its own relprop.explain call"
    else:  # a 64x32 image is cut into 2x1 crops, the other into 1x2
        samples[1]["image_sizes"] = torch.tensor([[64, 32]])
        says = r"LLaVA-NeXT.*different crop grids.*its own relprop.explain call"
    batch = _padded(samples, "right", CASES[family][2])
    before = snapshot(model)
    calls, handle = _watched(model)
    try:
        with pytest.raises(relprop.MethodError, match=says):
            relprop.explain(model, batch, target="next_token", method="lrp")
    finally:
        handle.remove()
    assert calls == []
    assert_same(before, snapshot(model))


def test_what_cannot_be_cut_per_sample_is_refused(models):
    model = models("qwen2_vl")
    batch = _padded(_qwen_samples(), "right", CASES["qwen2_vl"][2])
    with pytest.raises(relprop.MethodError, match=r"callable target= reads the batch's outputs"):
        relprop.explain(model, batch, target=lambda out: out.logits[:, -1, 5], method="lrp")
    holed = dict(batch, attention_mask=batch["attention_mask"].clone())
    holed["attention_mask"][0, 2] = 0
    with pytest.raises(relprop.MethodError, match=r"attention_mask of sample 0 is not one run of ones"):
        relprop.explain(model, holed, target="next_token", method="lrp")
    with pytest.raises(relprop.MethodError, match=r"not \['position_ids'\]"):
        relprop.explain(model, dict(batch, position_ids=torch.zeros(3, 2, 15, dtype=torch.long)), method="lrp")


def test_a_cut_that_the_batch_does_not_compute_is_refused():
    """The check before explaining: a sample whose inputs are not its row of the batch (here one id changed)
    computes other logits than the batch's row, and relprop refuses; the model is left as it was (a model never
    called before: transformers' first-call hooks taken off again)."""
    model = V.qwen2_vl()
    batch = _padded(_qwen_samples(), "right", CASES["qwen2_vl"][2])
    samples, length = vlm_batches.split(model, batch, None, None)
    assert length == batch["input_ids"].shape[1] and [len(s.keep) for s in samples] == [15, 11]
    before = snapshot(model)
    deltas = model.model.rope_deltas
    wrong = samples[1].inputs["input_ids"].clone()
    wrong[0, 1] = 5 if int(wrong[0, 1]) != 5 else 6
    samples[1].inputs["input_ids"] = wrong
    with pytest.raises(relprop.MethodError, match=r"sample 1 cut out of the batch does not compute what the batch"):
        vlm_batches.check_rows(model, batch, samples)
    assert_same(before, snapshot(model))
    assert model.model.rope_deltas is deltas  # the forward's cache of Qwen's rope deltas put back
    assert not hasattr(model, "_output_capturing_hooks_installed")  # transformers' first-call hooks taken off


# ------------------------------------------------------------------ the join itself (no model: fast)

def _exp(t: int, modality: str = "text", image=(4, 4), seed: int = 0):
    """A one-sample Explanation over ``t`` tokens (text), or over an image of ``image`` pixels (vision),
    with a streams entry of the prompt's tokens and token strings."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(1, t if modality == "text" else image[0] * image[1], generator=g)
    return relprop.Explanation(
        method="lrp", scores=scores, map=None if modality == "text" else torch.randn(1, *image, generator=g),
        mask=torch.ones_like(scores, dtype=torch.bool), matrix=None, blocks=[], target=torch.tensor([seed]),
        target_scores=torch.randn(1, generator=g), conservation=None, input_relevance=None,
        logits=torch.randn(1, t, 5, generator=g), preset="lrp", modality=modality,
        streams={"input_ids": torch.randn(1, t, generator=g)}, tokens=[[f"w{seed}{j}" for j in range(t)]],
        notes=[f"sample {seed}"])


def test_join_lays_token_fields_on_the_padded_positions():
    """joined.join (the inverse of exp[i]): 2 samples of 3 and 5 tokens on a batch of 6 positions, the
    first left-padded, the second right-padded; token fields at their positions, 0 / False / "" elsewhere."""
    ones, keeps = [_exp(3, seed=0), _exp(5, seed=1)], [torch.tensor([3, 4, 5]), torch.arange(5)]
    e = joined.join(ones, keeps, 6, "joined")
    assert e.scores.shape == (2, 6) and e.logits.shape == (2, 6, 5) and e.notes == ["sample 0", "sample 1", "joined"]
    for i, (one, keep) in enumerate(zip(ones, keeps)):
        for name in ("scores", "mask", "logits"):
            _same_on_positions(getattr(e, name)[i:i + 1], getattr(one, name), keep, [1])
        _same_on_positions(e.streams["input_ids"][i:i + 1], one.streams["input_ids"], keep, [1])
        assert [e.tokens[i][j] for j in keep.tolist()] == one.tokens[0]
        assert e[i].target.tolist() == [i]
    assert e.tokens[0][:3] == ["", "", ""] and e.tokens[1][5] == ""


def test_join_stacks_images_and_refuses_images_of_different_shapes():
    ones, keeps = [_exp(3, "vision", seed=0), _exp(5, "vision", seed=1)], [torch.arange(3), torch.arange(5)]
    e = joined.join(ones, keeps, 5, "joined")
    assert torch.equal(e.map, torch.cat([o.map for o in ones])) and torch.equal(e.scores, torch.cat([o.scores
                                                                                                     for o in ones]))
    _same_on_positions(e.streams["input_ids"][:1], ones[0].streams["input_ids"], keeps[0], [1])
    with pytest.raises(relprop.MethodError, match=r"scores: the samples give shapes \[\(1, 16\), \(1, 24\)\]"):
        joined.join([_exp(3, "vision", seed=0), _exp(3, "vision", (4, 6), seed=1)], [torch.arange(3)] * 2, 3, "")
