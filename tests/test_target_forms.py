"""Every form of ``target=`` means the same thing for every kind of head (relprop.targets.target_forms): the string,
the callable and the integer forms resolve through one path per head — classification, language model,
encoder–decoder, question answering, token classification — with the mask of the output's own positions.

The property test draws a head × a target form × source / decoder lengths × the padding side and checks
that the string form and the callable form explain identical scores, and that both read the position the
head's logits say (the last real decoder position of an encoder–decoder, never the source's; an answer
span inside the real tokens).
"""
from __future__ import annotations

import pytest
import torch
import transformers as tf
from hypothesis import HealthCheck, given, settings, strategies as st

import relprop
from relprop.targets import head_kind
from relprop.targets import best_span, question_answering, token_classification
from relprop.targets import next_token

V = 40


def _bert_cfg(**kw):
    return tf.BertConfig(vocab_size=V, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=32, max_position_embeddings=32, attn_implementation="eager", **kw)


def _build(kind):
    torch.manual_seed(0)
    if kind == "classification":
        return tf.BertForSequenceClassification(_bert_cfg(num_labels=3, id2label={0: "a", 1: "b", 2: "c"},
                                                          label2id={"a": 0, "b": 1, "c": 2})).eval()
    if kind == "question_answering":
        return tf.BertForQuestionAnswering(_bert_cfg()).eval()
    if kind == "token_classification":
        return tf.BertForTokenClassification(_bert_cfg(num_labels=3)).eval()
    if kind == "language_model":
        return tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=V, n_embd=16, n_layer=2, n_head=2, n_positions=32,
                                                attn_implementation="eager")).eval()
    return tf.T5ForConditionalGeneration(tf.T5Config(vocab_size=V, d_model=16, d_kv=8, d_ff=32, num_layers=2,
                                                     num_decoder_layers=2, num_heads=2, decoder_start_token_id=0,
                                                     pad_token_id=0)).eval()


_MODELS = {}


def model_of(kind):
    if kind not in _MODELS:
        _MODELS[kind] = _build(kind)
    return _MODELS[kind]


def _ids_mask(lengths, n, left, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(len(lengths), n, dtype=torch.long)
    mask = torch.zeros(len(lengths), n, dtype=torch.long)
    for i, L in enumerate(lengths):
        sl = slice(n - L, n) if left else slice(0, L)
        ids[i, sl] = torch.randint(3, V, (L,), generator=g)
        mask[i, sl] = 1
    return ids, mask


def inputs_of(kind, src, dec, left, seed=0):
    ids, mask = _ids_mask(src, max(src), left, seed)
    if kind != "encoder_decoder":
        return {"input_ids": ids, "attention_mask": mask}
    dids, dmask = _ids_mask(dec, max(dec), left, seed + 1)
    return {"input_ids": ids, "attention_mask": mask, "decoder_input_ids": dids, "decoder_attention_mask": dmask}


def forms(kind):
    """(string or int form, the same target as a callable) pairs of the head."""
    if kind == "classification":
        return [("b", 1), (2, lambda o: o.logits[:, 2])]
    if kind in ("language_model", "encoder_decoder"):
        return [("next_token", next_token()), (None, next_token()), (7, next_token(token=7))]
    if kind == "question_answering":
        return [("span", question_answering("span")), (None, question_answering()),
                ("start", question_answering("start")), ("end", question_answering("end"))]
    return []


def last_real(mask):
    idx = torch.arange(mask.shape[1])
    return torch.where(mask.bool(), idx, -1).amax(1)


def expected_scores(kind, model, x, form):
    """What the target reads, computed from the logits by hand."""
    with torch.no_grad():
        out = model(**x)
    if kind in ("language_model", "encoder_decoder"):
        mask = x["decoder_attention_mask"] if kind == "encoder_decoder" else x["attention_mask"]
        rows = out.logits[torch.arange(mask.shape[0]), last_real(mask)]
        return rows.max(-1).values if form in (None, "next_token") else rows[:, form]
    if kind == "question_answering":
        real = x["attention_mask"].bool()
        best = []
        for b in range(real.shape[0]):
            pos = real[b].nonzero().flatten().tolist()
            pairs = [(out.start_logits[b, i] + out.end_logits[b, j], i, j) for i in pos for j in pos if i <= j < i + 30]
            _, i, j = max(pairs)
            best.append((i, j))
        st_, en = torch.tensor([p[0] for p in best]), torch.tensor([p[1] for p in best])
        rows = torch.arange(len(best))
        part = form or "span"
        return {"start": out.start_logits[rows, st_], "end": out.end_logits[rows, en],
                "span": out.start_logits[rows, st_] + out.end_logits[rows, en]}[part]
    return out.logits[:, 1 if form == "b" else form]


def check_forms(kind, x):
    model = model_of(kind)
    for form, call in forms(kind):
        a = relprop.explain(model, x, target=form, method="input_x_gradient")
        b = relprop.explain(model, x, target=call, method="input_x_gradient")
        assert torch.equal(a.target_scores, b.target_scores), (kind, form)
        assert torch.equal(a.scores, b.scores), (kind, form)
        want = expected_scores(kind, model, x, form)
        assert torch.allclose(a.target_scores, want, atol=1e-5), (kind, form, a.target_scores, want)


def test_head_kinds():
    assert [head_kind(model_of(k)) for k in ("classification", "language_model", "encoder_decoder",
                                              "question_answering", "token_classification")] == \
        ["classification", "language_model", "encoder_decoder", "question_answering", "token_classification"]


@pytest.mark.parametrize("src, dec", [((5, 3), (7, 4)), ((7, 6), (3, 2))])
def test_encoder_decoder_next_token_reads_the_decoders_last_real_position(src, dec):
    """T5 with a source of 5 and a decoder of 7 tokens: the string and the callable read the same, the
    decoder's last real position (the string used to index the decoder's logits with the source's mask);
    a source longer than the decoder no longer fails (IndexError: index 6 is out of bounds)."""
    check_forms("encoder_decoder", inputs_of("encoder_decoder", src, dec, left=False))


@pytest.mark.parametrize("kind", ["classification", "language_model", "question_answering"])
def test_string_and_callable_forms_agree(kind):
    check_forms(kind, inputs_of(kind, (6, 4), (1,), left=False))


@pytest.mark.slow
@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(kind=st.sampled_from(["classification", "language_model", "encoder_decoder", "question_answering"]),
       src=st.lists(st.integers(2, 7), min_size=1, max_size=3), dec=st.lists(st.integers(1, 7), min_size=1, max_size=3),
       left=st.booleans(), seed=st.integers(0, 100))
def test_forms_agree_for_every_head_length_and_padding_side(kind, src, dec, left, seed):
    if kind == "encoder_decoder":
        dec = (dec * len(src))[:len(src)]
    check_forms(kind, inputs_of(kind, tuple(src), tuple(dec), left, seed))


def test_token_classification_needs_a_position_and_refuses_padding():
    model = model_of("token_classification")
    x = inputs_of("token_classification", (6, 4), (1,), left=False)
    for bad in (None, 1, "b"):
        with pytest.raises(relprop.TargetError, match="token_classification\\(position, label\\)"):
            relprop.explain(model, x, target=bad, method="input_x_gradient")
    with pytest.raises(relprop.TargetError, match="padding"):
        relprop.explain(model, x, target=token_classification(position=5), method="input_x_gradient")
    exp = relprop.explain(model, x, target=token_classification(position=3, label=2), method="input_x_gradient")
    with torch.no_grad():
        assert torch.allclose(exp.target_scores, model(**x).logits[:, 3, 2], atol=1e-5)


def test_best_span_never_in_padding():
    """Attention mask [1]*6 + [0]*6: the span was (7, 9), inside the padding."""
    start = torch.zeros(1, 12)
    end = torch.zeros(1, 12)
    start[0, 7], end[0, 9], start[0, 2], end[0, 4] = 5.0, 5.0, 1.0, 1.0
    assert [int(v) for v in best_span(start, end)] == [7, 9]
    mask = torch.tensor([[1] * 6 + [0] * 6])
    assert [int(v) for v in best_span(start, end, mask=mask)] == [2, 4]
    with pytest.raises(relprop.TargetError, match="shape"):
        best_span(start, end, mask=torch.ones(1, 5))


def test_next_token_given_a_token_where_the_mask_goes():
    with pytest.raises(relprop.TargetError, match=r"next_token\(token=5\)"):
        next_token(5)
    with pytest.raises(relprop.TargetError, match="attention mask"):
        next_token(torch.ones(3))
    assert next_token(token=5).token == 5
