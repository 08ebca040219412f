"""Where the time of ``transformer_attribution`` goes: ratio to one forward+backward pass, and the
op breakdown (``torch.profiler``) of one explain() call.

Random-weight timm ViT-B/16 (batch 1) and BERT-base (128 tokens). fwd+bwd is the model's own pass
with weight gradients; both are timed in the same process, interleaved, median of ``--repeats``.

    python benchmarks/profile_ta.py [--threads 1] [--repeats 3] [--device cpu|cuda] [--top 15]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import timm
import torch
import transformers
from torch.profiler import ProfilerActivity, profile

import relprop


def models(device):
    torch.manual_seed(0)
    vit = timm.create_model("vit_base_patch16_224", pretrained=False).eval().to(device)
    yield "timm vit_base_patch16_224, batch 1", vit, torch.randn(1, 3, 224, 224, device=device)
    del vit
    bert = transformers.BertForSequenceClassification(transformers.BertConfig(num_labels=2)).eval().to(device)
    ids = {"input_ids": torch.randint(1000, 30000, (1, 128), device=device),
           "attention_mask": torch.ones(1, 128, dtype=torch.long, device=device)}
    yield "BERT-base, 128 tokens, batch 1", bert, ids


def sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def fwd_bwd(model, inputs, target=1):
    out = model(**inputs) if isinstance(inputs, dict) else model(inputs)
    logits = out.logits if hasattr(out, "logits") else out
    logits[:, target].sum().backward()
    model.zero_grad(set_to_none=True)


def timed(fn, device):
    sync(device)
    t = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--method", default="transformer_attribution")
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--no-profile", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, device {args.device}, "
          f"load {os.getloadavg()[0]:.2f}")
    dev = args.device
    rows = []
    for name, model, inputs in models(dev):
        explain = lambda: relprop.explain(model, inputs, target=1, method=args.method)  # noqa: E731
        explain()
        fwd_bwd(model, inputs)
        fb, ex = [], []
        for _ in range(args.repeats):
            fb.append(timed(lambda: fwd_bwd(model, inputs), dev))
            ex.append(timed(explain, dev))
        f, e = statistics.median(fb), statistics.median(ex)
        rows.append((name, f, e))
        if not args.no_profile:
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.startswith("cuda") else [])
            with profile(activities=acts) as prof:
                explain()
            key = "self_cuda_time_total" if dev.startswith("cuda") else "self_cpu_time_total"
            print(f"\n### {name}: op breakdown of one explain(method={args.method!r})\n")
            print(prof.key_averages().table(sort_by=key, row_limit=args.top))
    print("\n| model | method | fwd+bwd ms | explain ms | ratio | threads |\n|---|---|---:|---:|---:|---:|")
    for name, f, e in rows:
        print(f"| {name} | {args.method} | {f * 1e3:.0f} | {e * 1e3:.0f} | {e / f:.2f} | {args.threads} |")
    print(f"load after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
