"""The examples of the user's first pages run as written: every ```python block of docs/getting-started.md and
docs/inputs-and-targets.md, in page order in one scope (as a reader follows the page), offline. What cannot
be had offline is stood in for, and only that: the hub loaders return tiny random models of the same kind
(``tests/test_readme.py: offline_hub``, plus the image processor and image classifier here), the tokenizer is
the shipped checkpoint's, and the page's images are files written here; the names a page's fragments use
from its prose (``model``, ``tok``, ``lm``, ...) are given per page. Each block is then checked for what it
promises (the shapes its comments state, the files it writes)."""
import copy
import os
import re
import textwrap
import types

import numpy as np
import pytest
import timm
import torch
import transformers
from PIL import Image

import relprop
from test_readme import offline_hub  # noqa: F401 - the fixture, used by the tests below

REAL_CREATE = timm.create_model  # before any fixture replaces it
DOCS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs")


def blocks(page: str) -> list:
    text = open(os.path.join(DOCS, page), encoding="utf-8").read()
    return [textwrap.dedent(b) for b in re.findall(r"```python\n(.*?)```", text, flags=re.S)]  # list items indent


@pytest.fixture
def hub_images(offline_hub, monkeypatch):  # noqa: F811 - pytest's fixture by name
    """offline_hub, and the image side of the hub: a ViT image processor and a tiny ViT classifier; a dog."""
    def image_model(name, **kw):
        torch.manual_seed(0)
        cfg = transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                     image_size=224, patch_size=16, num_labels=3,
                                     id2label={0: "tabby cat", 1: "tiger cat", 2: "dog"})
        return transformers.ViTForImageClassification(cfg)

    # timm's stand-in with ImageNet's 1000 classes (offline_hub's has 7): the page explains class 243
    def create_model(name, pretrained=False, **kw):
        torch.manual_seed(0)
        return REAL_CREATE("vit_tiny_patch16_224", pretrained=False, depth=kw.pop("depth", 2),
                           num_classes=kw.pop("num_classes", 1000), **kw)

    monkeypatch.setattr(timm, "create_model", create_model)
    monkeypatch.setattr(transformers.AutoImageProcessor, "from_pretrained",
                        lambda *a, **k: transformers.ViTImageProcessor())
    monkeypatch.setattr(transformers.AutoModelForImageClassification, "from_pretrained", image_model)
    Image.fromarray(np.random.default_rng(1).integers(0, 255, (200, 260, 3), dtype=np.uint8)).save("dog.jpg")
    return offline_hub


def run_page(page: str, scope: dict) -> dict:
    for i, code in enumerate(blocks(page)):
        exec(compile(code, f"docs/{page} (block {i + 1})", "exec"), scope)
    return scope


@pytest.mark.slow  # captures eight tiny models (about 40 s)
def test_getting_started_runs_as_written(hub_images):
    assert len(blocks("getting-started.md")) == 5  # a new block gets its checks here
    scope = run_page("getting-started.md", {})
    exp = scope["exp"]  # the last block's: the demo's explanation
    assert exp.method == "lrp" and (hub_images / "scores.json").stat().st_size > 100
    back = relprop.Explanation.load_npz("scores.npz")
    assert torch.equal(torch.as_tensor(back.scores), exp.scores.cpu())
    for name in ("both.png", "cat.png", "cat_methods.png", "reviews.html", "blocks.png"):
        assert (hub_images / name).stat().st_size > 1000, name
    assert tuple(scope["dog"].scores.shape) == (1, 196) and int(scope["dog"].target[0]) == 243
    assert "lifeless" in (hub_images / "reviews.html").read_text()


@pytest.mark.slow  # captures eight tiny models (about 20 s)
def test_inputs_and_targets_runs_as_written(hub_images):
    tok = transformers.AutoTokenizer.from_pretrained("any")
    model = transformers.AutoModelForSequenceClassification.from_pretrained("any")
    vit = transformers.AutoModelForImageClassification.from_pretrained("any")
    timm_model = timm.create_model("vit_tiny_patch16_224", depth=12)
    lm = transformers.AutoModelForCausalLM.from_pretrained("any")
    proc = transformers.AutoImageProcessor.from_pretrained("any")
    scope = {"relprop": relprop, "Image": Image, "model": model, "tok": tok, "vit": vit, "proc": proc,
             "timm_model": timm_model, "hf_vit": vit, "bert": model, "lm": lm,
             "batch": tok(["a fine film", "a dull film"], padding=True, return_tensors="pt"),
             "pipe_or_timm_model": timm_model}
    pages = blocks("inputs-and-targets.md")
    assert len(pages) == 5
    for i, code in enumerate(pages):
        if i == 1:  # the zero-shot pipelines': an NLI classifier and a CLIP-like dual encoder with its processor
            scope.update(nli_model=_nli(tok.vocab_size), clip=_clip(tok.vocab_size),
                         proc=transformers.CLIPImageProcessor())
        if i == 2:
            scope["proc"] = proc
        if i == 4:  # the layer= example names a timm ViT's blocks (blocks.10): its vit and x are timm's
            scope.update(vit=timm_model, x=torch.randn(2, 3, 224, 224))
        exec(compile(code, f"docs/inputs-and-targets.md (block {i + 1})", "exec"), scope)
    assert scope["exp"].target_label is not None
    assert (hub_images / "reviews.html").stat().st_size > 500 and (hub_images / "cat.png").stat().st_size > 1000


def _nli(vocab: int):
    torch.manual_seed(0)
    cfg = transformers.DistilBertConfig(vocab_size=vocab, dim=32, n_layers=2, n_heads=4, hidden_dim=64, pad_token_id=0,
                                        id2label={0: "contradiction", 1: "neutral", 2: "entailment"},
                                        label2id={"contradiction": 0, "neutral": 1, "entailment": 2})
    return transformers.DistilBertForSequenceClassification(cfg).eval()


def _clip(vocab: int):
    torch.manual_seed(0)
    cfg = transformers.CLIPConfig(
        text_config=dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=64),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           image_size=224, patch_size=32), projection_dim=16)
    return transformers.CLIPModel(cfg).eval()


@pytest.mark.slow  # captures five tiny models (about 30 s)
def test_presets_evaluation_and_models_pages_run_as_written(hub_images):
    """docs/presets.md, docs/evaluation.md, docs/activation-maximization.md and the blocks of docs/models.md
    whose models can be stood in for offline (Swin, CLIP, GPT-2, coverage) run as written, with the names
    their prose gives; models.md's vision-language blocks (3-5) need the processors of real VLM checkpoints
    and are run against tiny VLMs in tests/test_vlm*.py instead."""
    tok = transformers.AutoTokenizer.from_pretrained("any")
    bert = transformers.AutoModelForSequenceClassification.from_pretrained("any").eval()
    batch = tok(["a fine film", "a dull film"], padding=True, return_tensors="pt")
    scope = {"relprop": relprop, "torch": torch, "model": bert, "inputs": batch}
    run_page("presets.md", scope)
    assert scope["exp"].preset == "attnlrp" and scope["exp"].scores.shape[0] == 2

    vit = timm.create_model("vit_tiny_patch16_224").eval()  # the page's ImageNet classifier
    g = torch.Generator().manual_seed(0)
    scope = {"relprop": relprop, "model": vit, "images": torch.randn(2, 3, 224, 224, generator=g), "t": [243, 1],
             "masks": torch.rand(2, 224, 224, generator=g) > 0.5, "bert": bert, "batch": dict(batch),
             "rationale": batch["attention_mask"].bool() & (torch.arange(batch["input_ids"].shape[1]) == 2)}
    run_page("evaluation.md", scope)
    assert scope["exp"].map.shape == (2, 224, 224) and scope["words"].scores.shape == batch["input_ids"].shape

    scope = {"relprop": relprop, "model": vit}
    code = blocks("activation-maximization.md")[0].replace("steps=200", "steps=3")  # (the page's 200, shortened)
    exec(compile(code, "docs/activation-maximization.md (block 1)", "exec"), scope)
    assert len(scope["vis"].values) == 3 + 1 and (hub_images / "class_207.png").stat().st_size > 1000

    page = blocks("models.md")
    assert len(page) == 7  # a new block gets its checks here

    def swin_create(name, pretrained=False, **kw):  # the page's Swin-T, tiny and random
        torch.manual_seed(0)
        return REAL_CREATE("swin_tiny_patch4_window7_224", pretrained=False, depths=(1, 1, 1, 1), embed_dim=24,
                           num_heads=(1, 1, 2, 2), num_classes=1000)

    clip = _clip(tok.vocab_size)
    image_proc = transformers.CLIPImageProcessor()

    def processor(text=None, images=None, **kw):  # CLIPProcessor's call: the tokenizer and the image processor
        return {**tok(text, **kw), **image_proc(images=images, return_tensors="pt")}

    llama_cfg = transformers.LlamaConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=64)
    torch.manual_seed(0)
    scope = {"relprop": relprop, "timm": types.SimpleNamespace(create_model=swin_create),
             "images": torch.randn(2, 3, 224, 224, generator=g), "clip": clip, "processor": processor,
             "AutoTokenizer": types.SimpleNamespace(from_pretrained=lambda *a, **k: _gpt2_like(tok)),
             "AutoModelForCausalLM": transformers.AutoModelForCausalLM,
             "gpt2_classifier": _gpt2_classifier(tok.vocab_size),
             "llama": transformers.LlamaForCausalLM(llama_cfg).eval(), "batch": dict(batch)}
    exec(compile(page[0], "docs/models.md (block 1)", "exec"), scope)
    assert tuple(scope["exp"].scores.shape) == (2, 56 * 56)  # as the comment says
    scope["images"] = [Image.open("cat.jpg"), Image.open("dog.jpg")]
    exec(compile(page[1], "docs/models.md (block 2)", "exec"), scope)
    assert scope["img"].map.shape[0] == 2 and scope["txt"].scores.shape[0] == 2 and scope["pair"].map.shape[0] == 2
    exec(compile(page[5], "docs/models.md (block 6)", "exec"), scope)
    assert scope["exp"].scores.shape[0] == 2
    scope["batch"] = dict(batch)
    exec(compile(page[6], "docs/models.md (block 7)", "exec"), scope)
    assert scope["report"].complete and scope["report"].missing == []  # the page's "True, []" for a LLaMA


def _gpt2_like(tok):
    """The shipped tokenizer as the page's GPT-2 one: a copy (the page sets its pad token) with an end-of-text
    token, which GPT-2's tokenizer has and a BERT tokenizer lacks."""
    other = copy.deepcopy(tok)
    other.eos_token = other.sep_token
    return other


def _gpt2_classifier(vocab: int):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=vocab, n_positions=64, n_embd=32, n_layer=2, n_head=4, n_inner=64,
                                  num_labels=2, pad_token_id=0)
    return transformers.GPT2ForSequenceClassification(cfg).eval()
