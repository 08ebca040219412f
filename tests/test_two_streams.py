"""Two-stream models (encoder–decoder, co-attention): blocks labelled with their streams, the
bi-modal relevancy rules of Chefer, Gur & Wolf (ICCV 2021, Eq. 1–11) against a loop reference
written from the paper, AttnLRP conservation through cross-attention, batch ≡ per sample with
padded source and target, the model untouched."""
import copy

import pytest
import torch
import transformers as tf

import relprop
from relprop.methods.bimodal import normalized_self

from snapshot import assert_same, snapshot
import two_stream_models as M

SRC, TGT = "input_ids", "decoder_input_ids"


def test_blocks_say_which_stream_each_side_reads():
    model = M.bart()
    exp = relprop.explain(model, M.text_inputs(), target=M.last_token_target, method="gradient_rollout")
    got = [(b.name.split(".")[1] + "." + b.name.split(".")[-1], b.query_stream, b.key_stream) for b in exp.blocks]
    assert got == [("encoder.self_attn", SRC, SRC)] * 2 + [("decoder.self_attn", TGT, TGT),
                                                          ("decoder.encoder_attn", TGT, SRC)] * 2
    assert exp.output_stream == TGT
    assert set(exp.streams) == {SRC, TGT} and exp.streams[SRC].shape == (2, 7) and exp.streams[TGT].shape == (2, 5)
    assert torch.equal(exp.scores, exp.streams[SRC])
    assert exp.matrix.shape == (2, 5, 7)  # target tokens x source tokens


def test_cross_attention_over_as_many_source_tokens_as_channels_per_head_is_attention():
    """BART's heads have 16 / 2 = 8 channels: a source of 8 tokens gives cross-attention maps of 8 keys,
    the shape a map over the channels of each head (XCiT) has; they are still attention between tokens."""
    exp = relprop.explain(M.bart(), M.text_inputs(src=8), target=M.last_token_target, method="gradient_rollout")
    assert [(b.query_stream, b.key_stream) for b in exp.blocks] == [(SRC, SRC)] * 2 + [(TGT, TGT), (TGT, SRC)] * 2
    assert exp.matrix.shape == (2, 5, 8)


def test_one_stream_model_is_unchanged_and_still_refuses_nonsquare_rollouts():
    torch.manual_seed(0)
    cfg = tf.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=16)
    model = tf.BertForSequenceClassification(cfg).eval()
    exp = relprop.explain(model, {"input_ids": torch.randint(5, 50, (1, 6))}, target=0, method="gradient_rollout")
    assert exp.streams is None and all(b.query_stream is None for b in exp.blocks)


# ---------------------------------------------------------------- the paper's rules, by loops

def _mm(a, b):
    n, k, m = len(a), len(b), len(b[0])
    return [[sum(a[i][t] * b[t][j] for t in range(k)) for j in range(m)] for i in range(n)]


def _add(a, b):
    return [[x + y for x, y in zip(ra, rb)] for ra, rb in zip(a, b)]


def _eye(n):
    return [[1.0 if i == j else 0.0 for j in range(n)] for i in range(n)]


def _transpose(a):
    return [list(r) for r in zip(*a)]


def _bar(cam, grad):
    """Ā = E_h[(∇A ⊙ A)⁺] (Eq. 5) for one sample: [heads, q, k] → q x k lists."""
    h, q, k = cam.shape
    return [[sum(max(float(grad[x, i, j]) * float(cam[x, i, j]), 0.0) for x in range(h)) / h for j in range(k)]
            for i in range(q)]


def _normalize(r):
    """Eq. 8–9: R̂ = R − I, each row divided by its sum (zero rows kept), + I."""
    n = len(r)
    out = []
    for i in range(n):
        row = [r[i][j] - (1.0 if i == j else 0.0) for j in range(n)]
        s = sum(row)
        row = [v / s if s != 0 else 0.0 for v in row]
        out.append([v + (1.0 if i == j else 0.0) for j, v in enumerate(row)])
    return out


def _reference(model, inputs, score, normalize=True):
    """Encoder self-attention, decoder self-attention, cross-attention of a one-layer encoder–decoder:
    the relevancy maps of Chefer et al. (ICCV 2021) from HuggingFace's own attention outputs
    (``normalize=False``: the paper's ablation without Eq. 8–9)."""
    norm = _normalize if normalize else (lambda r: r)
    model = copy.deepcopy(model)
    out = model(**inputs, output_attentions=True, use_cache=False)
    atts = [out.encoder_attentions[0], out.decoder_attentions[0], out.cross_attentions[0]]
    for a in atts:
        a.retain_grad()
    score(out).sum().backward()
    rows = []
    for b in range(inputs[SRC].shape[0]):
        enc, dec, cross = (_bar(a[b].detach(), a.grad[b]) for a in atts)
        ns, nt = len(enc), len(dec)
        r_ss, r_tt = _eye(ns), _eye(nt)  # Eq. 1
        r_st, r_ts = [[0.0] * nt for _ in range(ns)], [[0.0] * ns for _ in range(nt)]  # Eq. 2
        r_ss, r_st = _add(r_ss, _mm(enc, r_ss)), _add(r_st, _mm(enc, r_st))  # Eq. 6-7, encoder
        r_tt, r_ts = _add(r_tt, _mm(dec, r_tt)), _add(r_ts, _mm(dec, r_ts))  # Eq. 6-7, decoder
        new_ts = _add(r_ts, _mm(_transpose(norm(r_tt)), _mm(cross, norm(r_ss))))  # Eq. 10
        new_tt = _add(r_tt, _mm(cross, r_st))  # Eq. 11
        rows.append((new_ts[-1], new_tt[-1]))  # the last target position is what the score reads
    return rows


@pytest.mark.slow
@pytest.mark.parametrize("normalize_self", [True, False])
def test_gradient_rollout_equals_the_papers_rules_on_a_two_block_encoder_decoder(normalize_self):
    torch.manual_seed(0)
    cfg = tf.BartConfig(vocab_size=40, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
                        max_position_embeddings=16, attn_implementation="eager")
    model = tf.BartForConditionalGeneration(cfg).eval()
    for p in model.parameters():  # larger weights than the default init, so that the maps are not ~I
        p.data.normal_(0, 0.3)
    inputs = {SRC: torch.randint(4, 40, (2, 6)), TGT: torch.randint(4, 40, (2, 4))}
    exp = relprop.explain(model, inputs, target=M.last_token_target, method="gradient_rollout",
                          normalize_self=normalize_self)
    ref = _reference(model, inputs, M.last_token_target, normalize_self)
    for b, (src_row, tgt_row) in enumerate(ref):
        torch.testing.assert_close(exp.streams[SRC][b], torch.tensor(src_row), rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(exp.streams[TGT][b], torch.tensor(tgt_row), rtol=1e-4, atol=1e-6)
    assert float(exp.streams[SRC].abs().sum()) > 1e-3  # the source gets relevance through cross-attention


def test_normalize_self_is_checked_before_any_work():
    model, inputs = M.bart(), M.text_inputs()
    for method in ("gradient_rollout", "transformer_attribution"):
        with pytest.raises(relprop.OptionError, match=r"normalize_self='no' is not a choice. Choices: \[True, False\]"):
            relprop.explain(model, inputs, target=M.last_token_target, method=method, normalize_self="no")


@pytest.mark.slow
def test_normalize_self_false_is_the_ablation_without_eq_8_9():
    model, inputs = M.bart(), M.text_inputs()
    for method in ("gradient_rollout", "transformer_attribution"):
        on = relprop.explain(model, inputs, target=M.last_token_target, method=method)
        off = relprop.explain(model, inputs, target=M.last_token_target, method=method, normalize_self=False)
        # Eq. 8-9 act on the cross-attention update of R^{ts} only: the source row changes, the target's
        # self map (Eq. 6 and 11 use R^{st}, which no cross-attention of this model updates) does not
        assert not torch.allclose(on.streams[SRC], off.streams[SRC])
        torch.testing.assert_close(on.streams[TGT], off.streams[TGT])
    one = tf.BertForSequenceClassification(tf.BertConfig(vocab_size=30, hidden_size=8, num_hidden_layers=1,
                                                         num_attention_heads=2, intermediate_size=16)).eval()
    with pytest.raises(relprop.MethodError, match="two token streams"):
        relprop.explain(one, {"input_ids": torch.randint(0, 30, (1, 5))}, target=0, method="gradient_rollout",
                        normalize_self=False)


def test_normalized_self_map():
    r = torch.tensor([[[2.0, 1.0, 0.0], [0.0, 1.0, 0.0], [0.5, 0.5, 2.0]]])
    want = torch.tensor([[[1.5, 0.5, 0.0], [0.0, 1.0, 0.0], [0.25, 0.25, 1.5]]])
    torch.testing.assert_close(normalized_self(r), want)


# ---------------------------------------------------------------- every model family

FAMILIES = list(M.BUILDERS)
DEFAULT_RUN = {"bart"}  # the others run with the slow tests


def _family(name):
    marks = [] if name in DEFAULT_RUN else [pytest.mark.slow]
    return pytest.param(name, marks=marks)


@pytest.mark.parametrize("name", [_family(n) for n in FAMILIES])
def test_attnlrp_conserves_relevance_through_cross_attention(name):
    model = M.BUILDERS[name]()
    inputs = M.inputs_for(name)
    before = snapshot(model)
    walked = relprop.explain(model, inputs, target=M.last_token_target, method="lrp", preset="attnlrp",
                             fast_path=False)
    fast = relprop.explain(model, inputs, target=M.last_token_target, method="lrp", preset="attnlrp")
    assert_same(before, snapshot(model))
    c = walked.conservation
    assert float(c.error.max()) < 1e-4
    # both streams receive relevance, and what reached them is what the ledger counts as reaching the input
    assert len(walked.streams) == 2 and all(float(walked.streams[k].abs().sum()) > 0 for k in walked.streams)
    reached = sum(walked.streams[k].flatten(1).sum(1) for k in walked.streams)
    if name != "vision_encoder_decoder":  # (the image's entry is summed per patch: the pixels' sum is the same)
        torch.testing.assert_close(reached, c.input.to(reached.dtype), rtol=1e-4, atol=1e-6)
    for k in walked.streams:
        torch.testing.assert_close(fast.streams[k], walked.streams[k], rtol=1e-4, atol=1e-6)
    for method in ("gradient_rollout", "transformer_attribution"):
        exp = relprop.explain(model, inputs, target=M.last_token_target, method=method)
        assert len(exp.streams) == 2 and all(torch.isfinite(v).all() for v in exp.streams.values())
        assert exp.output_stream == ("input_ids" if name == "lxmert" else TGT)
    assert_same(before, snapshot(model))


def _last_real(dmask):
    def target(outputs):
        logits = outputs.logits if hasattr(outputs, "logits") else outputs.question_answering_score
        if logits.dim() == 2:
            return logits.max(-1).values
        last = dmask.sum(1) - 1
        return logits[torch.arange(logits.shape[0]), last].max(-1).values
    return target


def _padded(name):
    """Two samples: the second with a shorter source (text models) and a shorter target, padded on
    the right; and the masks of each stream."""
    inputs = M.inputs_for(name)
    if name == "lxmert":
        inputs["attention_mask"] = torch.tensor([[1] * 6, [1] * 4 + [0] * 2])
        return inputs, {"input_ids": inputs["attention_mask"]}
    inputs["decoder_attention_mask"] = torch.tensor([[1] * 5, [1] * 3 + [0] * 2])
    masks = {TGT: inputs["decoder_attention_mask"]}
    if "input_ids" in inputs:
        inputs["attention_mask"] = torch.tensor([[1] * 7, [1] * 5 + [0] * 2])
        masks["input_ids"] = inputs["attention_mask"]
    return inputs, masks


def _sample(inputs, masks, b):
    """Sample b alone, its padding cut off."""
    out = {}
    lengths = {"input_ids": ("input_ids", "attention_mask"), TGT: (TGT, "decoder_attention_mask")}
    for k, v in inputs.items():
        v = v[b:b + 1]
        for stream, names in lengths.items():
            if k in names and stream in masks:
                v = v[:, :int(masks[stream][b].sum())]
        out[k] = v
    return out


@pytest.mark.parametrize("name", [_family(n) for n in FAMILIES])
def test_batch_equals_each_sample_with_padded_source_and_target(name):
    model = M.BUILDERS[name]()
    inputs, masks = _padded(name)
    dmask = masks.get(TGT, torch.ones(2, 1, dtype=torch.long))
    for method, preset in (("gradient_rollout", None), ("lrp", "attnlrp")):
        batch = relprop.explain(model, inputs, target=_last_real(dmask), method=method, preset=preset)
        for b in range(2):
            one_in = _sample(inputs, masks, b)
            one_mask = torch.ones(1, one_in[TGT].shape[1], dtype=torch.long) if TGT in one_in else dmask[b:b + 1]
            one = relprop.explain(model, one_in, target=_last_real(one_mask), method=method, preset=preset)
            for k, v in one.streams.items():
                got = batch.streams[k][b]
                if v.dim() == 2:
                    got = got[:v.shape[1]]
                torch.testing.assert_close(got, v[0], rtol=2e-4, atol=1e-6, msg=f"{name} {method} {k} sample {b}")


def test_methods_of_one_stream_are_refused_and_gradient_methods_explain_the_source():
    model = M.bart()
    with pytest.raises(relprop.MethodError, match="two"):
        relprop.explain(model, M.text_inputs(), target=M.last_token_target, method="raw_attention")
    exp = relprop.explain(model, M.text_inputs(), target=M.last_token_target, method="input_x_gradient")
    assert exp.scores.shape == (2, 7) and float(exp.scores.abs().sum()) > 0


def test_low_memory_gives_the_same_streams():
    model = M.bart()
    for method, preset in (("transformer_attribution", None), ("lrp", "attnlrp")):
        a = relprop.explain(model, M.text_inputs(), target=M.last_token_target, method=method, preset=preset,
                            fast_path=False)
        b = relprop.explain(model, M.text_inputs(), target=M.last_token_target, method=method, preset=preset,
                            fast_path=False, memory="low")
        for k in a.streams:
            torch.testing.assert_close(a.streams[k], b.streams[k], rtol=1e-5, atol=1e-9)
