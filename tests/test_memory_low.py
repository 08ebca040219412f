"""``explain(..., memory="low")``: block-by-block recomputation gives the default's results.

The reference is the default path. Every method that reads the per-block records or the relevance
walk is compared on tiny random models of each segmentable family (timm ViT, HF ViT, HF BERT with
padding, GPT-2 and LLaMA decoders), with the block records themselves and the conservation
bookkeeping; the model must be untouched; a bad value is an error that lists the choices; window
attention (Swin) falls back to the default path with a warning; CLIP's two towers segment as well.
"""
import warnings

import pytest
import torch

import models
import relprop
from relprop.errors import OptionError
from relprop.methods import get_method
from relprop.engine import forward as engine_forward
from relprop.engine import memory
from relprop.graph.capture import capture
from snapshot import assert_same, snapshot

#: every method that uses the trace of the interpreter (records and/or relevance walk)
TRACE_METHODS = ["transformer_attribution", "ta_without_gradient", "ta_last_block", "ta_second_block", "rollout",
                 "raw_attention", "lrp", "partial_lrp", "attention_gradcam", "gradient_rollout", "cat", "attcat",
                 "grads", "attgrads", "attention_norm", "gradcam"]
DECODER_METHODS = ["transformer_attribution", "rollout", "lrp", "partial_lrp", "gradient_rollout", "attcat",
                   "attgrads"]


def _cases():
    return {
        "timm_vit_tiny": (models.timm_vit_tiny, lambda m: models.image_batch(m), None, TRACE_METHODS),
        "hf_vit": (models.hf_vit, lambda m: models.image_batch(m), None, TRACE_METHODS),
        "hf_bert_padded": (lambda: models.hf_bert("eager"), lambda m: models.text_batch(), None, TRACE_METHODS),
        "hf_gpt2_cls": (models.hf_gpt2_cls, lambda m: models.decoder_batch(), None, DECODER_METHODS),
        "hf_llama": (models.hf_llama, lambda m: models.decoder_batch(), "next_token", DECODER_METHODS),
    }


def _close(a, b):
    if a is None or b is None:
        assert a is None and b is None
        return
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), (a - b).abs().max().item()


@pytest.mark.parametrize("name", list(_cases()))
def test_low_equals_default(name):
    build, data, target, methods = _cases()[name]
    model = build()
    inputs = data(model)
    ref = relprop.explain(model, inputs, target=target, method=methods, fast_path=False)
    before = snapshot(model)
    forwards = engine_forward.STATS["forward"]
    low = relprop.explain(model, inputs, target=target, method=methods, fast_path=False, memory="low")
    # one pass per preset (chefer2021; attnlrp for lrp; lrp for partial_lrp), each one full forward pass:
    # the segments are recomputed from the values it kept, not by running the graph again
    assert engine_forward.STATS["forward"] - forwards == len({
        get_method(m).preset or relprop.api.DEFAULT_PRESET for m in methods})
    assert_same(before, snapshot(model))
    captured = relprop.graph.capture.CACHE.captured(model)[0]
    assert len(memory.segments(captured)) == len(captured.analysis.blocks)  # one segment per block
    for r, lo in zip(ref, low):
        assert r.method == lo.method
        _close(r.scores, lo.scores)
        _close(r.map, lo.map)
        _close(r.input_relevance, lo.input_relevance)
        _close(r.target_scores, lo.target_scores)
    for rb, lb in zip(ref[0].blocks, low[0].blocks):  # the records of transformer_attribution's pass
        for field in ("attention", "gradient", "relevance", "hidden", "hidden_gradient", "hidden_relevance", "value",
                      "features", "features_gradient"):
            _close(getattr(rb, field), getattr(lb, field))
    rc, lc = ref[0].conservation, low[0].conservation
    for field in ("injected", "input", "absorbed"):
        _close(getattr(rc, field), getattr(lc, field))
    assert rc.absorbed_by.keys() == lc.absorbed_by.keys()
    for rbc, lbc in zip(rc.blocks, lc.blocks):
        _close(rbc.relevance_in, lbc.relevance_in)
        _close(rbc.relevance_out, lbc.relevance_out)
        _close(rbc.absorbed, lbc.absorbed)


def test_hidden_states_the_program_also_returns():
    """HF ViT with ``output_hidden_states=True`` returns residual sums that are also blocks' hidden
    states: memory="low" records their gradient (the total one, as the default path does), and no
    path writes into a value the explanation returns (the rules may compute into a dead output)."""
    model = models.hf_vit()
    x = models.image_batch(model, batch=1)
    inputs = {"pixel_values": x, "output_hidden_states": True}
    with torch.no_grad():
        own = model(**inputs).hidden_states
    ref = relprop.explain(model, inputs, target=1, method="transformer_attribution", fast_path=False)
    for kw in ({}, {"memory": "low"}, {"keep_blocks": False}):
        exp = relprop.explain(model, inputs, target=1, method="transformer_attribution", fast_path=False, **kw)
        for mine, theirs in zip(exp.outputs.hidden_states, own):
            assert torch.allclose(mine, theirs, atol=1e-5), kw
        _close(exp.scores, ref.scores)
        _close(exp.input_relevance, ref.input_relevance)
        if kw.get("keep_blocks", True):
            for rb, lb in zip(ref.blocks, exp.blocks):
                _close(rb.hidden_gradient, lb.hidden_gradient)
                _close(rb.gradient, lb.gradient)


def test_low_conserves_on_bias_free_model():
    model = models.zero_biases(models.hf_bert("eager"))
    exp = relprop.explain(model, models.text_batch(), memory="low")
    assert float(exp.conservation.error.max()) < 1e-4


def test_bad_memory_value():
    model = models.timm_vit_tiny()
    with pytest.raises(OptionError) as err:
        relprop.explain(model, models.image_batch(model), memory="lowest")
    assert "'default'" in str(err.value) and "'low'" in str(err.value) and "'high'" in str(err.value)
    assert isinstance(err.value, ValueError)


def _abs_entries(memo):
    return sum(k[0] == "abs" for k in memo)


def test_weight_memo_only_under_high_and_once_per_model():
    """memory="default" keeps no split weights between calls; memory="high" keeps one W⁺/W⁻ split per
    linear weight of the model, shared by every input shape, and gives the same numbers."""
    model = models.hf_bert("eager")
    relprop.clear_cache(model)
    short, long = models.text_batch(lengths=(5, 3)), models.text_batch(lengths=(9, 7))
    ref = relprop.explain(model, short)
    memo = relprop.graph.capture.CACHE.captured(model)[0].weight_cache
    assert memo == {}
    high = relprop.explain(model, short, memory="high")
    _close(ref.scores, high.scores)
    n_linear = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert 0 < _abs_entries(memo) <= n_linear
    relprop.explain(model, long, memory="high")  # another length: another specialization, the same memo
    captures = relprop.graph.capture.CACHE.captured(model)
    assert len(captures) == 2 and all(c.weight_cache is memo for c in captures)
    assert _abs_entries(memo) <= n_linear
    with torch.no_grad():  # an in-place update of a weight is seen at once
        model.classifier.weight.mul_(-1)
    again = relprop.explain(model, short, memory="high")
    _close(relprop.explain(model, short).scores, again.scores)


def test_weight_memo_sees_a_replaced_parameter():
    """A parameter the user replaces (``p.data = ...``, ``module.weight = Parameter(...)``) is a new tensor,
    possibly at the old one's address with the same version counter: the memo's entry holds the old weight's
    storage, so that address cannot be reused while the entry lives, the new weight's |W| is computed, and
    the node's old entry is dropped (no replaced weight is kept alive twice)."""
    model = models.hf_bert("eager")
    relprop.clear_cache(model)
    short = models.text_batch(lengths=(5, 3))
    relprop.explain(model, short, memory="high")
    memo = relprop.graph.capture.CACHE.captured(model)[0].weight_cache
    for key, entry in memo.items():
        if key[0] == "abs":
            assert entry[2].data_ptr() == key[1]  # the entry keeps the weight's memory
    before = _abs_entries(memo)
    torch.manual_seed(1)
    q = model.bert.encoder.layer[0].attention.self.query
    with torch.no_grad():
        q.weight.data = torch.randn_like(q.weight)  # the old storage is freed but for the memo
        model.classifier.weight = torch.nn.Parameter(torch.randn_like(model.classifier.weight))
    again = relprop.explain(model, short, memory="high")
    _close(relprop.explain(model, short).scores, again.scores)
    assert _abs_entries(memo) == before  # the two replaced weights' entries were replaced, not added


def test_swin_falls_back_with_warning():
    model = models.timm_swin()
    images = models.swin_images(model)
    ref = relprop.explain(model, images)
    with pytest.warns(UserWarning, match="memory='low' does not segment window attention"):
        low = relprop.explain(model, images, memory="low")
    _close(ref.scores, low.scores)


def test_default_path_frees_attention_intermediates():
    """The default forward frees the attention scores (the softmax's input), keeps A itself."""
    model = models.hf_bert("eager")
    batch = relprop.graph.inputs.bind_inputs(model, models.text_batch())
    captured = relprop.graph.capture.CACHE.get(model, batch)
    remat = memory.rematerializable(captured)
    scores = {b.softmax.args[0] for b in captured.analysis.blocks}
    assert scores <= remat
    assert not {b.attention for b in captured.analysis.blocks} & remat
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.no_grad():
            env, _ = engine_forward.forward(captured, model, batch, discard=remat)
    assert not scores & env.keys()
    assert {b.attention for b in captured.analysis.blocks} <= env.keys()


def test_clip_two_towers(wrt="input_ids"):
    """CLIP: the other tower's layers are constants of the explanation; they fall in the segments
    like any other node and the results are the default's (checked by hand for the image tower too)."""
    model, batch = models.hf_clip(), models.clip_batch()
    methods = ["transformer_attribution", "attcat"]
    ref = relprop.explain(model, batch, wrt=wrt, method=methods)
    low = relprop.explain(model, batch, wrt=wrt, method=methods, memory="low")
    for r, lo in zip(ref, low):
        _close(r.scores, lo.scores)
    _close(ref[0].conservation.input, low[0].conservation.input)


def test_reruns_keep_only_sources_and_outputs():
    """A re-run (SmoothGrad, IG, ViT-CX, target scores) frees every other value after its last use
    (memory.transient): the env ends with the sources and the returned nodes, and the outputs and
    the source gradient are the same bit for bit as with every value kept."""
    model = models.timm_vit_tiny()
    x = models.image_batch(model, batch=2)
    cap = capture(model, {"x": x}, "x")
    keep = memory.transient(cap)
    assert keep and not (keep & set(cap.analysis.sources))
    results = []
    for discard in (None, keep):
        with torch.enable_grad():
            env, out = engine_forward.forward(cap, model, {"x": x}, discard=discard)
            src = [env[s] for s in cap.analysis.sources]
            g = torch.autograd.grad(out[:, 1].sum(), src)
        live = {n for n in env if n.op == "call_function"}
        results.append((out.detach(), g, live))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1][0], results[1][1][0])
    assert len(results[1][2]) < len(results[0][2]) // 10
    assert not (results[1][2] & keep)
