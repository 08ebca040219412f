"""Do batches pay off? Every method's time per sample at batch 8 against its time at batch 1.

In one process, for each model (a small timm ViT and a BERT-base-like encoder, random weights):
every method of ``relprop.methods()`` is timed on a batch of 1 and a batch of 8 (the same first
sample in both), interleaved with one forward+backward pass at each batch size (weight gradients,
the unit of the ratios), median of ``--repeats``. Printed per method:

* ``b1 ms`` and ``b8 ms / 8`` (time per sample at batch 8) and their ratio ``per-sample b8 / b1``
  (goal: ≤ 1 for every method that does not sample);
* for the sampling / perturbation methods, how many forward (+backward) passes of the model they
  make per sample (``passes``: n_steps / n_samples path points or noisy copies, masks, or the
  block re-runs of value zeroing expressed in whole-model forward passes) and their time per
  sample divided by (passes × the fwd+bwd time per sample at the same batch size): ``× per pass``.
  For a method that batches its samples this is at or below 1 (a batched pass costs less per row
  than a pass of batch 1).

    python benchmarks/bench_batches.py [--threads 1] [--repeats 3] [--models vit,bert,vitb16]
                                       [--methods a,b] [--skip a,b] [--device cpu|cuda]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import timm
import torch
import transformers

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import relprop  # noqa: E402
from relprop.methods import all_methods  # noqa: E402

#: options that keep the sampling methods' pass counts at the usual small settings
OPTIONS = {"integrated_gradients": {"n_steps": 8}, "smoothgrad": {"n_samples": 8}}
SAMPLING = {"smoothgrad", "integrated_gradients", "value_zeroing", "vit_cx"}


def sync(device):
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def fwd_bwd(model, inputs, target):
    out = model(**inputs) if isinstance(inputs, dict) else model(inputs)
    logits = out.logits if hasattr(out, "logits") else out
    logits[:, target].sum().backward()
    model.zero_grad(set_to_none=True)


def take(inputs, n):
    if isinstance(inputs, dict):
        return {k: v[:n] for k, v in inputs.items()}
    return inputs[:n]


def passes(name, tokens):
    """Forward(+backward) passes of the whole model per sample that ``name`` makes by definition."""
    if name == "integrated_gradients":
        return OPTIONS[name]["n_steps"]
    if name == "smoothgrad":
        return OPTIONS[name]["n_samples"]
    if name == "value_zeroing":  # one block re-run per (block, token) = tokens whole-model forwards
        return tokens
    return None


def timed(fn, device):
    sync(device)
    t = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - t, out


def bench(label, model, inputs, names, args):
    dev, target = args.device, 1
    b1, b8 = take(inputs, 1), inputs
    tokens = (b1["input_ids"].shape[1] if isinstance(b1, dict)
              else (model.patch_embed.num_patches + model.num_prefix_tokens))
    n_blocks = len(model.blocks) if hasattr(model, "blocks") else model.config.num_hidden_layers
    runs = {}
    for n in names:
        if n == "vit_cx" and isinstance(inputs, dict):
            continue
        kw = OPTIONS.get(n, {})
        for tag, x in (("b1", b1), ("b8", b8)):
            runs[(n, tag)] = (lambda x, n, kw: lambda: relprop.explain(model, x, target=target, method=n, **kw))(
                x, n, kw)
    for (n, tag), fn in runs.items():  # capture once per batch size, warm up
        t, _ = timed(fn, dev)
        print(f"warm-up {label} {n} {tag}: {t:.2f} s", file=sys.stderr, flush=True)
    times = {k: [] for k in runs}
    fb = {"b1": [], "b8": []}
    for _ in range(args.repeats):
        for (n, tag), fn in runs.items():
            t, _ = timed(lambda: fwd_bwd(model, b1 if tag == "b1" else b8, target), dev)
            fb[tag].append(t)
            t, _ = timed(fn, dev)
            times[(n, tag)].append(t)
    fb1, fb8 = statistics.median(fb["b1"]), statistics.median(fb["b8"])
    print(f"\n{label}: {tokens} tokens, {n_blocks} blocks; fwd+bwd b1 {fb1 * 1e3:.1f} ms, b8 {fb8 * 1e3:.1f} ms "
          f"({fb8 / 8 / fb1:.2f} per sample); median of {args.repeats}\n")
    print("| method | b1 ms | b8 ms / 8 | per-sample b8 / b1 | passes / sample | × per pass b1 | × per pass b8 |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for n in names:
        if (n, "b1") not in times:
            continue
        t1, t8 = statistics.median(times[(n, "b1")]), statistics.median(times[(n, "b8")]) / 8
        p = count_vitcx_masks(model, b1) if n == "vit_cx" else passes(n, tokens)
        per = (f"{p} | {t1 / (p * fb1):.2f} | {t8 / (p * fb8 / 8):.2f}" if p else " | | ")
        flag = "" if n in SAMPLING or t8 <= t1 else " **>1**"
        print(f"| {n} | {t1 * 1e3:.1f} | {t8 * 1e3:.1f} | {t8 / t1:.2f}{flag} | {per} |", flush=True)


def count_vitcx_masks(model, x):
    """The number of masks ViT-CX scores for sample 0 (its pass count)."""
    from relprop.methods import perturbation
    counted = []
    original = perturbation.vitcx_masks

    def spy(*a, **k):
        m = original(*a, **k)
        counted.append(m.shape[0])
        return m
    perturbation.vitcx_masks = spy
    try:
        relprop.explain(model, x, target=1, method="vit_cx")
    finally:
        perturbation.vitcx_masks = original
    return counted[0]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--models", default="vit,bert")
    p.add_argument("--methods", default="")
    p.add_argument("--skip", default="")
    p.add_argument("--device", default="cpu")
    p.add_argument("--bert-layers", type=int, default=12)
    p.add_argument("--bert-tokens", type=int, default=64)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    infos = all_methods()
    names = [n for n in (args.methods.split(",") if args.methods else list(infos)) if n not in args.skip.split(",")]
    print(f"torch {torch.__version__}, device {args.device}, {torch.get_num_threads()} threads, "
          f"load {os.getloadavg()[0]:.2f}")
    torch.manual_seed(0)
    if "vit" in args.models.split(","):
        vit = timm.models.vision_transformer.VisionTransformer(
            img_size=112, patch_size=16, embed_dim=384, depth=6, num_heads=6, num_classes=10).eval().to(args.device)
        bench("timm ViT (112 px, patch 16, 384 wide, 6 blocks)", vit, torch.randn(8, 3, 112, 112, device=args.device),
              names, args)
    if "vitb16" in args.models.split(","):
        vitb = timm.create_model("vit_base_patch16_224", pretrained=False).eval().to(args.device)
        bench("timm ViT-B/16 (224 px)", vitb, torch.randn(8, 3, 224, 224, device=args.device), names, args)
    if "bert" in args.models.split(","):
        cfg = transformers.BertConfig(num_labels=2, num_hidden_layers=args.bert_layers)
        bert = transformers.BertForSequenceClassification(cfg).eval().to(args.device)
        s = args.bert_tokens
        ids = {"input_ids": torch.randint(1000, 30000, (8, s), device=args.device),
               "attention_mask": torch.ones(8, s, dtype=torch.long, device=args.device)}
        bench(f"BERT-base-like ({args.bert_layers} layers, 768 wide), {s} tokens", bert, ids, names, args)
    print(f"\nload at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
