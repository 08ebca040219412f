"""Time of every method divided by one forward+backward pass of the same model.

Models with random weights: timm vit_base_patch16_224 at batch 1 and 8, BERT-base at 128 tokens.
Both timings are taken in the same run, interleaved, median of ``--repeats``. Attention-only methods
(needs_relevance=False and no re-runs) should stay at or below 1.3.

    python benchmarks/bench_methods.py [--repeats 3] [--methods a,b,...] [--skip vit_cx,value_zeroing]
"""
from __future__ import annotations

import argparse
import statistics
import time

import timm
import torch
import transformers

import relprop

SAMPLING = {"smoothgrad", "integrated_gradients", "value_zeroing", "vit_cx"}


def forward_backward(model, inputs, target):
    out = model(**inputs) if isinstance(inputs, dict) else model(inputs)
    logits = out.logits if hasattr(out, "logits") else out
    logits[:, target].sum().backward()
    model.zero_grad(set_to_none=True)


def bench(label, model, inputs, names, repeats):
    target = 1
    relprop.explain(model, inputs, target=target)  # capture once
    forward_backward(model, inputs, target)
    base = []
    for _ in range(repeats):
        t = time.perf_counter()
        forward_backward(model, inputs, target)
        base.append(time.perf_counter() - t)
    for name in names:
        if name == "vit_cx" and isinstance(inputs, dict):
            continue
        times, fb = [], []
        reps = 1 if name in SAMPLING else repeats
        for _ in range(reps):
            t = time.perf_counter()
            forward_backward(model, inputs, target)
            fb.append(time.perf_counter() - t)
            t = time.perf_counter()
            relprop.explain(model, inputs, target=target, method=name)
            times.append(time.perf_counter() - t)
        f = statistics.median(base + fb)
        kind = ("sampling/perturbation" if name in SAMPLING
                else ("relevance" if name in RELEVANCE else "attention/gradient"))
        print(f"| {label} | {name} | {kind} | {statistics.median(times) * 1000:9.1f} | {f * 1000:8.1f} | "
              f"{statistics.median(times) / f:6.2f} |", flush=True)


RELEVANCE = set()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--methods", default="")
    p.add_argument("--skip", default="")
    p.add_argument("--models", default="vit1,vit8,bert")
    args = p.parse_args()
    from relprop.methods import all_methods
    infos = all_methods()
    RELEVANCE.update(n for n, i in infos.items() if i.needs_relevance)
    names = [n for n in (args.methods.split(",") if args.methods else sorted(infos)) if n not in args.skip.split(",")]
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| model | method | kind | method ms | fwd+bwd ms | ratio |")
    print("|---|---|---|---:|---:|---:|")
    wanted = args.models.split(",")
    if "vit1" in wanted or "vit8" in wanted:
        vit = timm.create_model("vit_base_patch16_224", pretrained=False).eval()
        if "vit1" in wanted:
            bench("ViT-B/16 batch 1", vit, torch.randn(1, 3, 224, 224), names, args.repeats)
        if "vit8" in wanted:
            bench("ViT-B/16 batch 8", vit, torch.randn(8, 3, 224, 224), names, args.repeats)
        del vit
    if "bert" in wanted:
        bert = transformers.BertForSequenceClassification(transformers.BertConfig(num_labels=2)).eval()
        ids = {"input_ids": torch.randint(1000, 30000, (1, 128)),
               "attention_mask": torch.ones(1, 128, dtype=torch.long)}
        bench("BERT-base 128 tokens", bert, ids, names, args.repeats)


if __name__ == "__main__":
    main()
