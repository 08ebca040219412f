"""Inputs users have: HuggingFace pipelines as the model with raw text or images, PIL images and image
files for timm and HF image models (the model's own preprocessing), raw text with a tokenizer.

Each is compared with the same explanation computed from tensors prepared by hand the documented way.
"""
from __future__ import annotations

import numpy as np
import pytest
import timm
import torch
import transformers
from PIL import Image

import relprop

import models


@pytest.fixture
def picture(tmp_path):
    rng = np.random.default_rng(0)
    path = tmp_path / "picture.png"
    Image.fromarray(rng.integers(0, 255, (50, 70, 3), dtype=np.uint8)).save(path)
    return path


def test_text_pipeline_with_raw_text(classifier, tok):
    pipe = transformers.pipeline("text-classification", model=classifier, tokenizer=tok)
    texts = ["a fine film", "a dull, lifeless film"]
    exp = relprop.explain(pipe, texts, target="POSITIVE")
    batch = tok(texts, padding=True, return_tensors="pt")
    ref = relprop.explain(classifier, batch, target=1, tokenizer=tok)
    assert torch.equal(exp.scores, ref.scores) and exp.target.tolist() == [1, 1]
    assert not exp.mask[:, 0].any()  # [CLS] left out: the pipeline's tokenizer marks special tokens
    one = relprop.explain(pipe, "a fine film")
    assert one.scores.shape == (1, 5)
    predicted = pipe("a fine film")[0]["label"]
    assert classifier.config.id2label[int(one.target[0])] == predicted  # the pipeline's own prediction


def test_raw_text_with_a_tokenizer(classifier, tok):
    exp = relprop.explain(classifier, "a fine film", tokenizer=tok)
    ref = relprop.explain(classifier, tok(["a fine film"], return_tensors="pt"), tokenizer=tok)
    assert torch.equal(exp.scores, ref.scores)
    with pytest.raises(relprop.InputError, match="tokenizer="):
        relprop.explain(classifier, "a fine film")


def hf_vit_and_processor():
    model = models.hf_vit()
    proc = transformers.ViTImageProcessor(size={"height": 32, "width": 32}, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    return model, proc


def test_image_pipeline_with_pil_and_paths(picture):
    model, proc = hf_vit_and_processor()
    pipe = transformers.pipeline("image-classification", model=model, image_processor=proc)
    im = Image.open(picture)
    ref = relprop.explain(model, proc(images=[im.convert("RGB")], return_tensors="pt")["pixel_values"])
    for given in (im, str(picture), [picture]):
        exp = relprop.explain(pipe, given)
        assert torch.equal(exp.scores, ref.scores)
    with_proc = relprop.explain(model, picture, image_processor=proc)
    assert torch.equal(with_proc.scores, ref.scores)
    with pytest.raises(relprop.InputError, match="image_processor="):
        relprop.explain(model, picture)


def test_timm_model_takes_its_own_preprocessing(picture):
    model = models.timm_vit_tiny()
    cfg = timm.data.resolve_data_config({"input_size": (3, 64, 64)}, model=model)  # created with img_size=64
    x = timm.data.create_transform(**cfg)(Image.open(picture).convert("RGB")).unsqueeze(0)
    assert x.shape[-1] == 64  # the model's input size, not the file's
    ref = relprop.explain(model, x)
    exp = relprop.explain(model, [str(picture), Image.open(picture)])
    # a batch of two against one image: equal to float32 rounding (the batch's matmuls round differently)
    for i in range(2):
        torch.testing.assert_close(exp.scores[i], ref.scores[0], rtol=1e-4, atol=1e-6 * float(ref.scores.abs().max()))


def test_bad_raw_inputs(tmp_path):
    model = models.timm_vit_tiny()
    with pytest.raises(relprop.InputError, match="does not exist"):
        relprop.explain(model, str(tmp_path / "missing.png"))
    bad = tmp_path / "bad.png"
    bad.write_text("not an image")
    with pytest.raises(relprop.InputError, match="cannot read image"):
        relprop.explain(model, str(bad))
    with pytest.raises(relprop.InputError, match="takes images"):
        relprop.explain(model, "a fine film")


def test_overlay_array_and_word_scores(classifier, tok, picture):
    """exp.overlay(): the uint8 picture save() draws, as an array; exp.words(): (word, score) pairs whose
    scores are the sums of the pieces' scores, special tokens and padding left out."""
    from relprop.viz import image as vimg
    model = models.timm_vit_tiny()
    exp = relprop.explain(model, [str(picture)])
    x = relprop.api.raw_inputs.pixels(model, [str(picture)])
    arr = exp.overlay(x)
    assert arr.dtype == np.uint8 and arr.shape == (64, 64, 3)
    values = vimg._resize(vimg.relevance_map(exp, 0), (64, 64))
    lo, hi = vimg.clip_limits(values, False)
    ref = vimg.blend(vimg.display_image(x), values, False, lo, hi)
    assert np.abs(arr.astype(float) - ref * 255).max() <= 0.5 + 1e-6
    assert relprop.viz.overlay(exp).shape == tuple(exp.map.shape[1:]) + (3,)  # the coloured map alone
    batch = tok(["an unbelievably fine film", "ok"], padding=True, return_tensors="pt")
    e = relprop.explain(classifier, batch, tokenizer=tok, method="input_x_gradient")
    words = e.words(tok, batch)
    assert [w for w, _ in words[0]] == ["an", "unbelievably", "fine", "film"] and [w for w, _ in words[1]] == ["ok"]
    pieces = tok.convert_ids_to_tokens(batch["input_ids"][0])
    split = tok.tokenize("unbelievably")
    assert len(split) > 1  # the word is several pieces
    start = pieces.index(split[0])
    assert abs(words[0][1][1] - float(e.scores[0, start:start + len(split)].sum())) < 1e-6
    assert e.words(tok, batch, index=1) == words[1]


# ---------------------------------------------------------------------------------------- zero-shot pipelines

@pytest.fixture(scope="module")
def nli(tok):
    torch.manual_seed(1)
    names = {0: "contradiction", 1: "neutral", 2: "entailment"}
    cfg = transformers.BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=4, intermediate_size=64, max_position_embeddings=64,
                                  id2label=names, label2id={v: k for k, v in names.items()})
    return transformers.BertForSequenceClassification(cfg).eval()


def test_zero_shot_text_pipeline_explains_the_entailment_of_the_labels_hypothesis(nli, tok):
    pipe = transformers.pipeline("zero-shot-classification", model=nli, tokenizer=tok)
    texts = ["the match ended two to one", "shares fell sharply"]
    exp = relprop.explain(pipe, texts, target=["sports", "business"])
    pairs = tok(texts, ["This example is sports.", "This example is business."], padding=True,
                truncation="only_first", return_tensors="pt")
    ref = relprop.explain(nli, pairs, target=2, tokenizer=tok)  # 2: the NLI model's entailment class
    assert torch.equal(exp.scores, ref.scores) and exp.target.tolist() == [2, 2]
    with torch.no_grad():
        entail = nli(**pairs).logits[:, 2]
    assert torch.allclose(exp.target_scores, entail, atol=1e-5)


@pytest.mark.slow
def test_zero_shot_text_pipeline_scores_and_template(nli, tok):
    """The pipeline's own score for a label is the softmax of the explained logits over the candidate
    labels; a template given to the pipeline is the one used."""
    pipe = transformers.pipeline("zero-shot-classification", model=nli, tokenizer=tok)
    texts = ["the match ended two to one"]
    one = relprop.explain(pipe, texts[0], target="sports")
    other = relprop.explain(pipe, texts[0], target="business")
    probs = torch.softmax(torch.cat([one.target_scores, other.target_scores]), 0)
    result = pipe(texts[0], candidate_labels=["sports", "business"])
    assert abs(dict(zip(result["labels"], result["scores"]))["sports"] - probs[0].item()) < 1e-4
    custom = transformers.pipeline("zero-shot-classification", model=nli, tokenizer=tok,
                                   hypothesis_template="It is about {}.")
    got = relprop.explain(custom, texts[0], target="sports")
    want = relprop.explain(nli, tok([texts[0]], ["It is about sports."], return_tensors="pt"), target=2, tokenizer=tok)
    assert torch.equal(got.scores, want.scores)


def test_zero_shot_pipelines_need_a_label_and_raw_inputs(nli, tok):
    pipe = transformers.pipeline("zero-shot-classification", model=nli, tokenizer=tok)
    with pytest.raises(relprop.TargetError, match="candidate label"):
        relprop.explain(pipe, "the match ended")
    with pytest.raises(relprop.TargetError, match="one per input"):
        relprop.explain(pipe, ["a", "b"], target=["sports"])
    with pytest.raises(relprop.InputError, match="raw"):
        relprop.explain(pipe, tok(["a"], return_tensors="pt"), target="sports")


@pytest.fixture(scope="module")
def clip(tok):
    torch.manual_seed(2)
    text = dict(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=64, bos_token_id=tok.cls_token_id,
                eos_token_id=tok.sep_token_id, pad_token_id=tok.pad_token_id)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=32,
                  patch_size=8)
    cfg = transformers.CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)
    return transformers.CLIPModel(cfg).eval()


def test_zero_shot_image_pipeline_explains_the_image_prompt_similarity(clip, tok, picture):
    processor = transformers.CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    pipe = transformers.pipeline("zero-shot-image-classification", model=clip, tokenizer=tok,
                                 image_processor=processor)
    exp = relprop.explain(pipe, [picture, picture], target=["cat", "dog"], method="gradient_rollout")
    pixels = processor(images=[Image.open(picture).convert("RGB")] * 2, return_tensors="pt")["pixel_values"]
    prompts = tok(["This is a photo of cat.", "This is a photo of dog."], padding=True, return_tensors="pt")
    batch = {"pixel_values": pixels, "input_ids": prompts["input_ids"], "attention_mask": prompts["attention_mask"]}
    ref = relprop.explain(clip, batch, wrt="pixel_values", method="gradient_rollout",
                          target=lambda out: out.logits_per_image.diagonal())
    assert torch.equal(exp.scores, ref.scores) and exp.scores.shape == (2, 16) and exp.map.shape == (2, 32, 32)
    with torch.no_grad():
        sims = clip(**batch).logits_per_image.diagonal()
    assert torch.allclose(exp.target_scores, sims, atol=1e-5)
    result = pipe(Image.open(picture).convert("RGB"), candidate_labels=["cat", "dog"])
    probs = torch.softmax(torch.stack([sims[0], sims[1]]), 0)  # the same image against both prompts
    assert abs(dict((r["label"], r["score"]) for r in result)["cat"] - probs[0].item()) < 1e-4
