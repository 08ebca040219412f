"""The README's Python snippets run as written and give what their comments say.

Each ```python block of the README is executed with the hub loaders replaced by tiny random models of
the same kind (timm's ``create_model`` → a 2-block ViT at 224 pixels; ``from_pretrained`` → tiny BERT /
GPT-2 models with the demo checkpoint's tokenizer), so the snippets are checked offline; the demo
snippet runs on the real demo model and must give the same words as ``relprop demo``.
"""
from __future__ import annotations

import os
import re

import numpy as np
import pytest
import timm
import torch
import transformers
from PIL import Image

import relprop
from relprop import demo
from relprop.cli.loading import load_demo, run_methods
from relprop.viz import text as vtext

README = os.path.join(os.path.dirname(__file__), "..", "README.md")


def snippets():
    text = open(README, encoding="utf-8").read()
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def block(word):
    found = [s for s in snippets() if word in s]
    assert len(found) == 1, f"one README snippet with {word!r}, found {len(found)}"
    return found[0]


@pytest.fixture
def offline_hub(monkeypatch, tmp_path):
    """Hub loaders → tiny random models; the tokenizer → the demo checkpoint's (offline)."""
    tok = transformers.AutoTokenizer.from_pretrained(demo.checkpoint_dir(), local_files_only=True)
    vocab = tok.vocab_size
    real_create = timm.create_model

    def create_model(name, pretrained=False, **kw):
        torch.manual_seed(0)
        return real_create("vit_tiny_patch16_224", pretrained=False, depth=2, num_classes=7, **kw)

    def seq_cls(name, **kw):
        torch.manual_seed(0)
        cfg = transformers.DistilBertConfig(vocab_size=vocab, dim=32, n_layers=2, n_heads=4, hidden_dim=64,
                                            id2label={0: "NEGATIVE", 1: "POSITIVE"}, pad_token_id=0)
        return transformers.DistilBertForSequenceClassification(cfg)

    def causal_lm(name, **kw):
        torch.manual_seed(0)
        cfg = transformers.GPT2Config(vocab_size=vocab, n_positions=64, n_embd=32, n_layer=2, n_head=4, n_inner=64)
        return transformers.GPT2LMHeadModel(cfg)

    monkeypatch.setattr(timm, "create_model", create_model)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: tok)
    monkeypatch.setattr(transformers.AutoModelForSequenceClassification, "from_pretrained", seq_cls)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", causal_lm)
    monkeypatch.chdir(tmp_path)
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (240, 320, 3), dtype=np.uint8)).save("cat.jpg")
    return tmp_path


def run(code):
    scope = {}
    exec(compile(code, "README.md", "exec"), scope)
    return scope


def test_readme_is_a_landing_page():
    text = open(README, encoding="utf-8").read()
    assert len(text.encode()) <= 10_500
    top = text.split("\n## ")[0]
    for command in ('pip install -e ".[test,demo]"', "python -m pytest -q", "relprop demo",
                    "--index-url https://download.pytorch.org/whl/cpu"):
        assert command in top
    # timm needs torchvision, which pins one torch release: the CPU-only line takes both from the CPU index
    assert "pip install torch torchvision --index-url https://download.pytorch.org/whl/cpu" in top
    ci = open(os.path.join(os.path.dirname(README), ".ci", "run")).read()
    assert "\npython -m pytest -q\n" in ci  # the README's test command is what CI runs
    assert '-m venv "$VENV"' in ci and 'pip install' in ci and '-e ".[test,demo' in ci  # in a fresh environment


def test_the_performance_guide_stays_a_guide():
    """docs/performance.md says what a call costs and what to set; history and superseded figures belong in
    benchmarks/RESULTS.md, so the guide fails this test once it grows past 300 lines."""
    root = os.path.dirname(README)
    guide = open(os.path.join(root, "docs", "performance.md"), encoding="utf-8").read()
    assert len(guide.splitlines()) <= 300, "move history and raw tables to benchmarks/RESULTS.md"
    assert "benchmarks/RESULTS.md" in guide  # where the history went is named


def test_readme_opens_with_a_picture_and_the_call():
    text = open(README, encoding="utf-8").read()
    title, picture, call = text.split("\n\n")[:3]
    assert title == "# relprop" and picture.startswith("![") and picture.endswith(".png)")
    assert call.startswith("```python\nexp = relprop.explain(") and "exp.show()" in call
    assert snippets()[0] == block("exp.show()")


def test_the_one_line_call_shows_the_words(capsys):
    model, tok = demo.load()
    inputs = tok([demo.DEFAULT_TEXTS[0]], return_tensors="pt")
    scope = {"relprop": relprop, "model": model, "inputs": inputs, "tok": tok}
    exec(compile(block("exp.show()"), "README.md", "exec"), scope)
    exp = scope["exp"]
    assert exp.target_label == ["sports"] and model.config.id2label[int(exp.target[0])] == "sports"
    shown = capsys.readouterr().out
    assert "explained: sports" in shown and "striker" in shown


def test_readme_links_exist():
    root = os.path.dirname(README)
    text = open(README, encoding="utf-8").read()
    links = re.findall(r"\]\(([^)#]+)\)", text)
    assert links
    for link in links:
        assert os.path.exists(os.path.join(root, link)), link


def test_timm_quickstart(offline_hub):
    scope = run(block("timm.create_model"))
    exp = scope["exp"]
    assert tuple(exp.scores.shape) == (1, 196)
    assert tuple(exp.map.shape) == (1, 224, 224)
    assert exp.method == "transformer_attribution"
    assert int(exp.target[0]) == int(scope["model"](scope["x"]).argmax())
    assert os.path.getsize(offline_hub / "cat.png") > 1000


def test_text_classifier_quickstart(offline_hub):
    scope = run(block("AutoModelForSequenceClassification"))
    exp, batch = scope["exp"], scope["batch"]
    assert exp.scores.shape == batch["input_ids"].shape
    assert exp.target.tolist() == [1, 1]
    special = (batch["input_ids"] == 101) | (batch["input_ids"] == 102) | (batch["attention_mask"] == 0)
    assert (exp.scores[special] == 0).all() and (exp.scores[~special] != 0).any()
    html = (offline_hub / "reviews.html").read_text()
    assert "lifeless" in html and "POSITIVE" in html


def test_language_model_quickstart(offline_hub):
    scope = run(block("AutoModelForCausalLM"))
    exp, lm, batch = scope["exp"], scope["lm"], scope["batch"]
    assert exp.scores.shape == batch["input_ids"].shape
    with torch.no_grad():
        predicted = int(lm(**batch).logits[0, -1].argmax())
    given = relprop.explain(lm, batch, target=relprop.targets.next_token(batch["attention_mask"], predicted))
    assert torch.equal(exp.scores, given.scores) and exp.scores.abs().sum() > 0


def demo_words(exp, tok, batch):
    rows = vtext.token_strings(tok, batch["input_ids"])
    return [(t.text, round(float(t.score), 5)) for t in vtext.tokens_of(exp, 0, rows[0], merge_words=True)]


def test_demo_snippet_gives_the_words_of_the_cli(monkeypatch):
    code = block("demo.load()").replace("exp.show(", "(lambda *a, **k: None)(")
    scope = run(code)
    exp, tok, batch = scope["exp"], scope["tok"], scope["batch"]
    loaded = load_demo()  # what `relprop demo` explains with
    assert tok.decode(batch["input_ids"][0], skip_special_tokens=True) == demo.DEFAULT_TEXTS[0].lower()
    inputs = dict(tok([demo.DEFAULT_TEXTS[0]], padding=True, truncation=True, return_tensors="pt"))
    cli = run_methods(loaded, inputs, None, [loaded.default_method])[0]
    assert demo_words(exp, tok, batch) == demo_words(cli, tok, inputs)
