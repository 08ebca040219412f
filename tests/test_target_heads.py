"""Targets of extractive QA and token-classification heads; Precision@K for QA (AttCAT §5.3)."""
import pytest
import torch
import transformers as tf

import relprop
from relprop.evaluation import answer_mask, qa_precision_at_k
from relprop.targets import best_span, question_answering, token_classification


def _cfg(labels=2):
    return tf.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=32, max_position_embeddings=16, num_labels=labels)


def test_question_answering_targets_read_the_start_end_and_span_scores():
    torch.manual_seed(0)
    model = tf.BertForQuestionAnswering(_cfg()).eval()
    ids = torch.randint(5, 50, (2, 8))
    with torch.no_grad():
        out = model(input_ids=ids)
    s, e = best_span(out.start_logits, out.end_logits)
    # the best span by brute force
    for b in range(2):
        pairs = [(out.start_logits[b, i] + out.end_logits[b, j], i, j) for i in range(8) for j in range(i, 8)]
        _, i, j = max(pairs)
        assert (int(s[b]), int(e[b])) == (i, j)
    rows = torch.arange(2)
    torch.testing.assert_close(question_answering("start")(out), out.start_logits[rows, s])
    torch.testing.assert_close(question_answering("end", end=[3, 4])(out), out.end_logits[rows, torch.tensor([3, 4])])
    torch.testing.assert_close(question_answering("span", start=1, end=2)(out),
                               out.start_logits[:, 1] + out.end_logits[:, 2])
    exp = relprop.explain(model, {"input_ids": ids}, target=question_answering("span"), method="lrp",
                          preset="attnlrp", fast_path=False)
    torch.testing.assert_close(exp.target_scores, out.start_logits[rows, s] + out.end_logits[rows, e])
    assert float(exp.conservation.error.max()) < 1e-4
    with pytest.raises(relprop.TargetError, match="Choices"):
        question_answering("middle")


def test_token_classification_target():
    torch.manual_seed(0)
    model = tf.BertForTokenClassification(_cfg(3)).eval()
    ids = torch.randint(5, 50, (2, 6))
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    t = token_classification(position=[2, 4], label=1)
    torch.testing.assert_close(t(model(input_ids=ids)), logits[torch.arange(2), torch.tensor([2, 4]), 1],
                               rtol=1e-5, atol=1e-6)
    pred = token_classification(position=3)
    torch.testing.assert_close(pred(model(input_ids=ids)), logits[:, 3].max(-1).values, rtol=1e-5, atol=1e-6)
    exp = relprop.explain(model, {"input_ids": ids}, target=t, method="gradient_rollout")
    assert exp.scores.shape == (2, 6)
    with pytest.raises(relprop.TargetError, match="labels"):
        relprop.explain(model, {"input_ids": ids}, target=token_classification(1, label=7))


def test_qa_precision_at_k_counts_answer_tokens_in_the_top_k():
    scores = torch.tensor([[0.9, 0.1, 0.8, 0.7, 0.0, 0.2], [0.0, 0.1, 0.2, 0.3, 0.4, 0.5]])
    # answer 2..3: top-3 of sample 0 = {0, 2, 3} -> 2 answer tokens; sample 1: answer 0..1, top-3 {3,4,5} -> 0
    got = qa_precision_at_k(scores, start=[2, 0], end=[3, 1], k=3)
    assert got.tolist() == [2.0, 0.0]
    # by loops
    for b, (s, e) in enumerate([(2, 3), (0, 1)]):
        top = sorted(range(6), key=lambda i: -float(scores[b, i]))[:3]
        assert sum(s <= i <= e for i in top) == got[b]
    assert answer_mask([1], [2], 4).tolist() == [[False, True, True, False]]
    with pytest.raises(relprop.InputError):
        answer_mask([3], [1], 4)
