"""An Explanation remembers what it needs to draw itself (issue 30, goal 1): the token strings, the label
names, the explained token of a language model and the image, after every input form explain() takes;
show()/save()/words()/overlay() then need no argument and give what the explicit arguments give, an
explicit argument still wins, exp[i] carries sample i's fields (equal to explaining sample i alone), and
nothing is stored on the model; a label name given as target= names the pictures."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from hypothesis import HealthCheck, given, settings, strategies as st
from PIL import Image

import models
import relprop
from relprop.viz import api as viz_api
from relprop.api.remembered import encoding_tokens
from relprop.viz.text import token_strings

TEXTS = ["a fine film", "a dull, lifeless film", "good", "the plot is thin but the cast is fine"]


@pytest.fixture(scope="module")
def lm(tok):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=tok.vocab_size, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                  bos_token_id=tok.cls_token_id, eos_token_id=tok.sep_token_id)
    return transformers.GPT2LMHeadModel(cfg).eval()


def _state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}, set(vars(model))


def _unchanged(model, before):
    params, attrs = before
    assert set(vars(model)) == attrs  # nothing stored on the model
    assert all(torch.equal(v, params[k]) for k, v in model.state_dict().items())


def test_raw_text_and_tensor_dict_remember_tokens_labels_and_target(classifier, tok, tmp_path):
    before = _state(classifier)
    batch = tok(TEXTS[:2], padding=True, return_tensors="pt")
    for exp in (relprop.explain(classifier, TEXTS[:2], tokenizer=tok, target="POSITIVE"),
                relprop.explain(classifier, batch, tokenizer=tok, target=1)):
        assert exp.tokens == token_strings(tok, batch["input_ids"])
        assert exp.labels == {0: "NEGATIVE", 1: "POSITIVE"} and exp.target_label == ["POSITIVE", "POSITIVE"]
        assert "target_label=['POSITIVE', 'POSITIVE']" in repr(exp)
        assert exp.words() == exp.words(tok, batch)  # no argument: the remembered tokens
        assert [w for w, _ in exp.words(index=1)] == ["a", "dull", ",", "lifeless", "film"]
        page = exp.show()
        assert page == exp.show(tokens=exp.tokens) and "POSITIVE" in page and "lifeless" in page
        path = exp.save(str(tmp_path / "e.html"))
        assert open(path, encoding="utf-8").read() == open(exp.save(str(tmp_path / "f.html"), tokenizer=tok,
                                                                         inputs=batch), encoding="utf-8").read()
        assert "POSITIVE" in exp._repr_html_() and "lifeless" in exp._repr_html_()
        d = exp.to_dict()
        assert d["samples"][1]["positions"][:3] == ["[CLS]", "a", "dull"] and d["samples"][1]["target_label"] == \
            "POSITIVE"
    # explicit arguments win over the remembered ones
    other = [["x"] * exp.scores.shape[1]] * 2
    assert exp.words(tokens=other, merge_words=False)[0][0][0] == "x"
    assert "good" in exp.show(labels={0: "bad", 1: "good"})
    _unchanged(classifier, before)


def test_text_pipeline_remembers_its_tokenizer_and_labels(classifier, tok, tmp_path):
    pipe = transformers.pipeline("text-classification", model=classifier, tokenizer=tok)
    exp = relprop.explain(pipe, "a dull, lifeless film")
    assert exp.tokens == [tok.convert_ids_to_tokens(tok("a dull, lifeless film")["input_ids"])]
    predicted = pipe("a dull, lifeless film")[0]["label"]
    assert exp.target_label == [predicted] and exp.labels[int(exp.target[0])] == predicted
    assert [w for w, _ in exp.words(index=0)] == ["a", "dull", ",", "lifeless", "film"]
    assert predicted in open(exp.save(str(tmp_path / "p.html")), encoding="utf-8").read()
    assert exp.save(str(tmp_path / "p.png")).endswith("p.png")


def test_a_label_name_given_as_target_names_the_pictures(tmp_path):
    cfg = transformers.ViTConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2,
                                 num_attention_heads=4, intermediate_size=64, num_labels=3,
                                 id2label={0: "cat", 1: "dog", 2: "bird"}, label2id={"cat": 0, "dog": 1, "bird": 2})
    torch.manual_seed(0)
    model = transformers.ViTForImageClassification(cfg).eval()
    x = torch.randn(2, 3, 32, 32)
    exp = relprop.explain(model, x, target="dog")
    assert exp.target.tolist() == [1, 1] and exp.target_label == ["dog", "dog"]
    assert "dog" in repr(exp) and "class 1" not in exp._repr_html_() and "dog (score" in exp._repr_html_()
    fig = viz_api._image_figure(exp, 0, None, None, None, None, 99.5)
    assert fig._suptitle.get_text().startswith("dog (score")
    assert exp.to_dict()["samples"][0]["target_label"] == "dog"
    assert exp.save(str(tmp_path / "d.png")).endswith("d.png")


def test_default_label_names_are_not_remembered(zoo):
    exp = relprop.explain(zoo("hf_bert_eager"), models.text_batch(lengths=(5, 4)), target=1)
    assert exp.labels is None and exp.target_label is None  # LABEL_0, LABEL_1: "class 1" says as much


def _processor():
    return transformers.ViTImageProcessor(size={"height": 32, "width": 32}, image_mean=[0.5, 0.4, 0.3],
                                          image_std=[0.2, 0.25, 0.3])


def test_image_pipeline_with_a_pil_image_remembers_the_pixels_and_normalisation(tmp_path):
    model, proc = models.hf_vit(), _processor()
    pipe = transformers.pipeline("image-classification", model=model, image_processor=proc)
    im = Image.fromarray(np.random.default_rng(0).integers(0, 255, (40, 50, 3), dtype=np.uint8))
    exp = relprop.explain(pipe, im)
    pixels = proc(images=[im], return_tensors="pt")["pixel_values"]
    assert torch.equal(exp.image, pixels)
    assert exp.image_mean == pytest.approx((0.5, 0.4, 0.3)) and exp.image_std == pytest.approx((0.2, 0.25, 0.3))
    plain = exp.overlay()
    assert np.array_equal(plain, exp.overlay(pixels[0], mean=[0.5, 0.4, 0.3], std=[0.2, 0.25, 0.3]))
    assert not np.array_equal(plain, exp.overlay(pixels[0]))  # the remembered normalisation was undone
    assert plain.shape == (32, 32, 3)
    assert "data:image/png;base64" in exp._repr_html_()
    assert exp.save(str(tmp_path / "o.png")).endswith("o.png")


def test_timm_model_with_pixels_remembers_them_and_its_normalisation():
    model = models.timm_vit_tiny()
    before = _state(model)
    x = models.image_batch(model)
    exp = relprop.explain(model, x)
    assert torch.equal(exp.image, x) and exp.image is not x  # a copy: later edits of x do not move it
    cfg = model.pretrained_cfg
    assert exp.image_mean == tuple(cfg["mean"]) and exp.image_std == tuple(cfg["std"])
    for i in range(2):
        assert np.array_equal(exp.overlay(index=i), exp.overlay(x[i], i, mean=cfg["mean"], std=cfg["std"]))
        assert np.array_equal(exp[i].overlay(), exp.overlay(index=i))
    given = torch.zeros_like(x[0])
    assert not np.array_equal(exp.overlay(given), exp.overlay())  # an explicit image wins
    _unchanged(model, before)


def test_timm_label_names_are_remembered():
    model = models.timm_vit_tiny()
    model.pretrained_cfg = {**model.pretrained_cfg, "label_names": [f"n{i}" for i in range(model.num_classes)]}
    exp = relprop.explain(model, models.image_batch(model), target=[2, 3])
    assert exp.labels[2] == "n2" and exp.target_label == ["n2", "n3"]


def test_language_model_explains_a_named_token(lm, tok, capsys):
    before = _state(lm)
    exp = relprop.explain(lm, "the capital of france is", tokenizer=tok)
    logits = lm(**tok("the capital of france is", return_tensors="pt")).logits  # token_type_ids too: GPT-2 embeds them
    expected = int(logits[0, -1].argmax())
    assert exp.target.tolist() == [expected]
    assert exp.target_label == [tok.decode([expected])]
    assert f"target_label={exp.target_label!r}" in repr(exp)
    exp.show()
    out = capsys.readouterr().out
    assert f"next token {exp.target_label[0]!r} (id {expected}), score" in out
    assert f"next token {exp.target_label[0]!r}" in exp._repr_html_().replace("&#x27;", "'")
    paris = tok.convert_tokens_to_ids("paris")
    named = relprop.explain(lm, "the capital of france is", tokenizer=tok, target="paris")
    assert named.target.tolist() == [paris] and named.target_label == ["paris"]
    torch.testing.assert_close(named.target_scores, logits[:, -1, paris])
    _unchanged(lm, before)


def test_language_model_batch_names_each_samples_token(lm, tok):
    texts = ["the capital of france is", "one two"]
    exp = relprop.explain(lm, texts, tokenizer=tok)
    batch = tok(texts, padding=True, return_tensors="pt")
    logits = lm(**batch).logits
    last = batch["attention_mask"].sum(1) - 1
    expected = logits[torch.arange(2), last].argmax(-1)
    assert exp.target.tolist() == expected.tolist()
    assert exp.target_label == [tok.decode([int(t)]) for t in expected]
    assert exp[1].target_label == exp.target_label[1:] and exp[1].tokens == exp.tokens[1:]


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(picked=st.lists(st.sampled_from(TEXTS), min_size=2, max_size=3), index=st.integers(0, 2))
def test_a_sample_remembers_what_explaining_it_alone_remembers(classifier, tok, picked, index):
    index %= len(picked)
    batch = relprop.explain(classifier, picked, tokenizer=tok)
    alone = relprop.explain(classifier, picked[index], tokenizer=tok)
    one = batch[index]
    assert one.labels == alone.labels and one.target_label == alone.target_label
    n = len(alone.tokens[0])  # the batch's row is padded on the right
    assert one.tokens[0][:n] == alone.tokens[0] and set(one.tokens[0][n:]) <= {"[PAD]"}
    assert [w for w, _ in one.words(index=0)] == [w for w, _ in alone.words(index=0)]


@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
@given(index=st.integers(0, 2))
def test_an_image_sample_remembers_its_own_pixels(index):
    model = models.timm_vit_tiny()
    x = models.image_batch(model, batch=3)
    exp, alone = relprop.explain(model, x), relprop.explain(model, x[index:index + 1])
    one = exp[index]
    assert torch.equal(one.image, alone.image) and one.image_mean == alone.image_mean
    assert one.target_label == alone.target_label and one.labels == alone.labels


def test_hf_model_with_bare_pixels_remembers_them_without_normalisation():
    # an HF image model given bare pixels: the image is remembered, its normalisation is not known
    model = models.hf_vit()
    x = models.image_batch(model)
    exp = relprop.explain(model, x)
    assert torch.equal(exp.image, x) and exp.image_mean is None and exp.image_std is None
    assert np.array_equal(exp.overlay(), exp.overlay(x[0]))


def test_zero_shot_text_pipeline_names_the_label_and_remembers_the_pair(tok):
    torch.manual_seed(1)
    names = {0: "contradiction", 1: "neutral", 2: "entailment"}
    cfg = transformers.BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=4, intermediate_size=64, max_position_embeddings=64,
                                  id2label=names, label2id={v: k for k, v in names.items()})
    nli = transformers.BertForSequenceClassification(cfg).eval()
    pipe = transformers.pipeline("zero-shot-classification", model=nli, tokenizer=tok)
    texts = ["the match ended two to one", "shares fell sharply"]
    exp = relprop.explain(pipe, texts, target=["sports", "business"])
    pairs = tok(texts, ["This example is sports.", "This example is business."], padding=True,
                truncation="only_first", return_tensors="pt")
    assert exp.target_label == ["sports", "business"]  # the label explained, not the NLI class "entailment"
    assert exp.tokens == token_strings(tok, pairs["input_ids"])
    assert "sports" in exp.show() and [w for w, _ in exp[1].words(index=0)][:2] == ["shares", "fell"]


def test_a_fast_tokenizers_output_alone_gives_the_tokens(classifier, tok):
    """A BatchEncoding of a fast tokenizer carries its token strings (``encodings[i].tokens``): without
    tokenizer=, show() and words() still work and name the same tokens as with it; a plain dict of the same
    tensors carries none, and words() then says what to pass."""
    assert tok.is_fast
    batch = tok(TEXTS[:2], padding=True, return_tensors="pt")
    pad = batch["attention_mask"] == 0
    alone = relprop.explain(classifier, batch, target=1, special_tokens_mask=pad)
    given = relprop.explain(classifier, batch, target=1, tokenizer=tok, special_tokens_mask=pad)
    assert alone.tokens == given.tokens == token_strings(tok, batch["input_ids"])
    assert torch.equal(alone.scores, given.scores)
    assert alone.words() == given.words() and "lifeless" in alone.show()
    plain = relprop.explain(classifier, dict(batch), target=1, special_tokens_mask=pad)
    assert plain.tokens is None
    with pytest.raises(relprop.RelpropError, match="tokenizer"):
        plain.words()


def test_encoding_tokens_refuses_a_shape_it_does_not_match():
    class Enc:
        def __init__(self, tokens):
            self.tokens = tokens
    ids = torch.zeros(2, 3, dtype=torch.long)
    assert encoding_tokens([Enc(["a", "b", "c"]), Enc(["d", "e", "f"])], ids) == [["a", "b", "c"], ["d", "e", "f"]]
    assert encoding_tokens([Enc(["a", "b"]), Enc(["d", "e", "f"])], ids) is None  # one token per position
    assert encoding_tokens([Enc(["a", "b", "c"])], ids) is None  # one encoding per sample
    assert encoding_tokens(None, ids) is None
