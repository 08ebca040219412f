"""Goal 1 of issue 27: how should rollout-style methods treat each query row's identity share when the
model pools over tokens? The three choices of ``identity=`` (relprop.methods.identity) on the
faithfulness benchmark's data, with mean-pooled models added:

* text: the demo checkpoint (the real pretrained all-MiniLM-L6-v2) fine-tuned with mean pooling over the
  attention mask and a linear head (the sentence-transformers reading) on the synthetic topic sentences;
* images: a 4-block timm ViT without a class token, global average pooling (``global_pool="avg"``),
  trained from scratch on the synthetic shapes;
* and, as the control, the same ViT recipe with a class token ([CLS] pooling): there the three choices
  must give the same maps (the identity share lands on [CLS], which the map leaves out).

For each model, method (transformer_attribution, gradient_rollout, rollout) and
choice, relprop.evaluation.evaluate's metrics (text: AOPC, log-odds, perturbation AUCs, token-F1@3 and
P@1 against the keyword rationales; images: perturbation AUCs, pixel accuracy, mIoU, mAP), and two
measures of what the picture shows, over the positions shown:

* ``flat``: the share of samples whose map is uniform to float32 resolution (relprop's flat-map warning);
* ``contrast``: the median over samples of (max − min) / max |score|: the share of the colour scale the
  map uses (1 = from 0 to the top; 0.001 = one colour);
* ``ties``: the share of shown positions whose score equals another's (float32 equality: ranks lost).

    python benchmarks/faithfulness/pooling.py --out benchmarks/faithfulness/out_pooling   # ~40 min, 2 busy cores
    python benchmarks/faithfulness/pooling.py --out /tmp/pool --size medium   # ~20 min: the figures of docs/methods.md
    python benchmarks/faithfulness/pooling.py --out /tmp/pool --quick                            # a smoke run

Writes OUT/pooling.md (the tables of docs/methods.md) and OUT/pooling.json; models under OUT/models.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from typing import Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # the repository root: relprop

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import relprop  # noqa: E402
import relprop.evaluation as E  # noqa: E402
from relprop.explanation.flatness import flat_samples  # noqa: E402

import models  # noqa: E402
import synth  # noqa: E402

METHODS = ["transformer_attribution", "gradient_rollout", "rollout"]
IDENTITIES = ["keep", "exclude", "exclude_self"]
#: sized for a shared 2-core machine (the synthetic tasks are learnt in a few dozen steps)
CONFIGS = {
    "full": dict(text_train=1000, text_steps=40, text_test=32, vision_steps=400, vision_test=48, batch=16),
    "medium": dict(text_train=600, text_steps=20, text_test=16, vision_steps=250, vision_test=24, batch=8),
    "quick": dict(text_train=300, text_steps=10, text_test=8, vision_steps=40, vision_test=8, batch=8),
}
#: the removed fractions of the perturbation tests (the paper's 10 %, 30 %, …, 90 %)
STEPS = (0.1, 0.3, 0.5, 0.7, 0.9)


# ----------------------------------------------------------------------------------------------- models
class MeanPooledClassifier(torch.nn.Module):
    """``logits = head(mean over the attention mask of encoder(text))``: an unmodified HF encoder read by
    mean pooling (sentence-transformers) and a linear head. ``config`` is a copy of the encoder's with the
    labels, so relprop finds the special tokens."""

    def __init__(self, encoder, labels: List[str]):
        super().__init__()
        import copy
        self.encoder = encoder
        self.head = torch.nn.Linear(encoder.config.hidden_size, len(labels))
        cfg = copy.deepcopy(encoder.config)
        cfg.id2label = dict(enumerate(labels))
        cfg.label2id = {c: i for i, c in enumerate(labels)}
        self.config = cfg

    def forward(self, input_ids, attention_mask, token_type_ids=None):
        kw = {} if token_type_ids is None else {"token_type_ids": token_type_ids}
        h = self.encoder(input_ids=input_ids, attention_mask=attention_mask, **kw).last_hidden_state
        m = attention_mask[..., None].to(h.dtype)
        return self.head((h * m).sum(1) / m.sum(1).clamp_min(1e-9))


def train_text(train, steps: int, out_dir: str, seed: int, log, batch_size: int = 32, lr: float = 1e-4):
    from transformers import AutoModel, AutoTokenizer
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    tok = AutoTokenizer.from_pretrained(models.minilm_dir(), local_files_only=True)
    model = MeanPooledClassifier(AutoModel.from_pretrained(models.minilm_dir(), local_files_only=True),
                                 synth.TEXT_CLASSES).train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    t0, losses = time.time(), []
    for step in range(steps):
        idx = rng.choice(len(train), batch_size, replace=False)
        enc = tok([train[i]["text"] for i in idx], padding=True, return_tensors="pt")
        loss = F.cross_entropy(model(enc["input_ids"], enc["attention_mask"]),
                               torch.tensor([train[i]["label"] for i in idx]))
        for g in opt.param_groups:
            g["lr"] = models._cosine_lr(step, steps, max(1, steps // 10), lr)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if (step + 1) % 50 == 0 or step == steps - 1:
            log(f"  text step {step + 1}/{steps}: loss {np.mean(losses[-50:]):.4f} ({time.time() - t0:.0f}s)")
    model.eval()
    os.makedirs(out_dir, exist_ok=True)
    torch.save(model.state_dict(), os.path.join(out_dir, "model.pt"))
    tok.save_pretrained(out_dir)
    return model, tok, time.time() - t0


def make_vit(pooling: str):
    import timm
    kw = models.vit_kwargs(depth=4, embed_dim=128, num_heads=4)
    if pooling == "mean":
        kw.update(global_pool="avg", class_token=False)
    return timm.create_model(models.VIT_NAME, pretrained=False, **kw)


def train_vit(pooling: str, steps: int, seed: int, log, batch_size: int = 48, lr: float = 5e-4):
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    model = make_vit(pooling).train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05)
    t0, losses = time.time(), []
    for step in range(steps):
        b = synth.image_batch(g, batch_size, 1)
        for grp in opt.param_groups:
            grp["lr"] = models._cosine_lr(step, steps, max(1, steps // 20), lr)
        loss = F.cross_entropy(model(synth.normalize(b["images"])), b["classes"][:, 0])
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if (step + 1) % 200 == 0 or step == steps - 1:
            log(f"  vit ({pooling}) step {step + 1}/{steps}: loss {np.mean(losses[-100:]):.4f} "
                f"({time.time() - t0:.0f}s)")
    return model.eval(), time.time() - t0


# ------------------------------------------------------------------------------------------- measures
def picture(model, batches, method: str, identity: str, target=None) -> Dict[str, float]:
    """flat / contrast / ties of the maps of ``method`` under ``identity`` over ``batches`` (see the docstring)."""
    flat, contrast, ties, n = 0, [], [], 0
    for x in batches:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            exp = relprop.explain(model, x, method=method, identity=identity)
        flat += len(flat_samples(exp.scores, exp.mask))
        for b in range(exp.scores.shape[0]):
            s = exp.scores[b] if exp.mask is None else exp.scores[b][exp.mask[b]]
            top = float(s.abs().max())
            contrast.append(float(s.max() - s.min()) / top if top > 0 else 0.0)
            ties.append(1.0 - torch.unique(s).numel() / s.numel())
            n += 1
    return {"flat": flat / n, "contrast": float(np.median(contrast)), "ties": float(np.mean(ties))}


def evaluate(model, data, method: str, identity: str, batch: int, **kw) -> Dict[str, float]:
    res = E.evaluate(model, data, [method], batch_size=batch, explain_options={"identity": identity},
                     progress=False, conservation=False, steps=STEPS, **kw)
    return dict(res.table()[0])


TEXT_KEYS = [("aopc", "AOPC ↑"), ("log_odds", "log-odds ↓"), ("positive_auc", "pos. AUC ↓"),
             ("negative_auc", "neg. AUC ↑"), ("token_f1@3", "token-F1@3 ↑"), ("precision@1", "P@1 ↑")]
VISION_KEYS = [("positive_auc", "pos. AUC ↓"), ("negative_auc", "neg. AUC ↑"), ("pixel_accuracy", "pixel acc. ↑"),
               ("miou", "mIoU ↑"), ("map", "mAP ↑")]
PICTURE_KEYS = [("flat", "flat maps"), ("contrast", "contrast"), ("ties", "tied positions")]


def table(title: str, rows: Dict[str, Dict], keys) -> List[str]:
    cols = keys + PICTURE_KEYS
    lines = [f"### {title}", "", "| method | identity | " + " | ".join(c[1] for c in cols) + " |",
             "|---|---|" + "---:|" * len(cols)]
    for (method, identity), r in rows.items():
        cells = []
        for key, _ in cols:
            v = r.get(key)
            cells.append("–" if v is None or (isinstance(v, float) and np.isnan(v)) else f"{v:.3f}")
        lines.append(f"| {method} | {identity} | " + " | ".join(cells) + " |")
    return lines + [""]


# ----------------------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(HERE, "out_pooling"))
    p.add_argument("--quick", action="store_true", help="the same as --size quick")
    p.add_argument("--size", choices=list(CONFIGS), default=None, help="data and training steps (default: full)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip", nargs="*", default=[], choices=["text", "vit_mean", "vit_cls"])
    args = p.parse_args(argv)
    size = args.size or ("quick" if args.quick else "full")
    cfg = CONFIGS[size]
    os.makedirs(args.out, exist_ok=True)
    t_all = time.time()
    logf = open(os.path.join(args.out, "run.log"), "a")

    def log(msg):
        line = f"[{time.time() - t_all:7.1f}s] {msg}"
        print(line, flush=True)
        logf.write(line + "\n")
        logf.flush()

    log(f"pooling benchmark ({size}), seed {args.seed}, threads {torch.get_num_threads()}")
    summary: Dict[str, Dict] = {"config": cfg, "models": {}}
    md = [f"## The identity share on pooled models ({size} run)", ""]

    if "text" not in args.skip:
        train = synth.text_dataset(cfg["text_train"], args.seed + 1)
        test = synth.text_dataset(cfg["text_test"], args.seed + 2)
        path = os.path.join(args.out, "data", "test.jsonl")
        synth.write_jsonl(test, path)
        model, tok, secs = train_text(train, cfg["text_steps"], os.path.join(args.out, "models", "text_mean"),
                                      args.seed, log)
        data = E.RationaleJSONL(path, tok)
        with torch.no_grad():
            enc = tok([r["text"] for r in test], padding=True, return_tensors="pt")
            acc = float((model(enc["input_ids"], enc["attention_mask"]).argmax(-1)
                         == torch.tensor([r["label"] for r in test])).float().mean())
        log(f"text model (mean pooling): {secs:.0f}s of training, held-out accuracy {acc:.3f}")
        batches = [{k: v[i:i + cfg["batch"]] for k, v in enc.items()} for i in range(0, len(test), cfg["batch"])]
        rows = {}
        for method in METHODS:
            for identity in IDENTITIES:
                t = time.time()
                r = evaluate(model, data, method, identity, cfg["batch"], target="predicted", rationale_k=(1, 3),
                             kendall=False)
                r.update(picture(model, batches, method, identity))
                rows[(method, identity)] = r
                log(f"text {method} identity={identity}: {time.time() - t:.0f}s")
        summary["models"]["text_mean"] = {"accuracy": acc, "train_s": secs,
                                          "rows": {f"{m}|{i}": r for (m, i), r in rows.items()}}
        md += table(f"Text: all-MiniLM-L6-v2 fine-tuned with mean pooling ({len(test)} test sentences, held-out "
                    f"accuracy {acc:.3f})", rows, TEXT_KEYS)

    g = torch.Generator().manual_seed(args.seed + 3)
    one = synth.image_batch(g, cfg["vision_test"], 1)
    folder = os.path.join(args.out, "data", "vision")
    synth.write_image_folder(one, folder)
    images = E.ImageMaskFolder(folder, normalization=(synth.MEAN, synth.STD))
    x = synth.normalize(one["images"])
    for pooling in ("mean", "cls"):
        key = f"vit_{pooling}"
        if key in args.skip:
            continue
        model, secs = train_vit(pooling, cfg["vision_steps"], args.seed, log)
        with torch.no_grad():
            acc = float((model(x).argmax(-1) == one["classes"][:, 0]).float().mean())
        log(f"ViT ({pooling} pooling): {secs:.0f}s of training, held-out accuracy {acc:.3f}")
        batches = [x[i:i + cfg["batch"]] for i in range(0, x.shape[0], cfg["batch"])]
        rows = {}
        for method in METHODS:
            for identity in IDENTITIES:
                t = time.time()
                r = evaluate(model, images, method, identity, cfg["batch"], target="predicted",
                             perturbation_batch_size=128)
                r.update(picture(model, batches, method, identity))
                rows[(method, identity)] = r
                log(f"{key} {method} identity={identity}: {time.time() - t:.0f}s")
        summary["models"][key] = {"accuracy": acc, "train_s": secs,
                                  "rows": {f"{m}|{i}": r for (m, i), r in rows.items()}}
        what = "no class token, global average pooling" if pooling == "mean" else "class token ([CLS] pooling): control"
        md += table(f"Images: 4-block ViT, {what} ({x.shape[0]} test images, held-out accuracy {acc:.3f})", rows,
                    VISION_KEYS)
    md.append(f"Total {time.time() - t_all:.0f} s on {torch.get_num_threads()} threads.")
    with open(os.path.join(args.out, "pooling.json"), "w") as f:
        json.dump(summary, f, indent=1, default=float)
    with open(os.path.join(args.out, "pooling.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    log(f"wrote {os.path.join(args.out, 'pooling.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
