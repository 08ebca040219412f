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
from relprop import demo

import models


@pytest.fixture(scope="module")
def tok():
    return transformers.AutoTokenizer.from_pretrained(demo.checkpoint_dir(), local_files_only=True)


@pytest.fixture(scope="module")
def classifier(tok):
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=4, intermediate_size=64, max_position_embeddings=64,
                                  id2label={0: "NEGATIVE", 1: "POSITIVE"}, label2id={"NEGATIVE": 0, "POSITIVE": 1})
    return transformers.BertForSequenceClassification(cfg).eval()


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
    x = relprop.raw_inputs.pixels(model, [str(picture)])
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
