"""Cost of relprop.explain() relative to one forward+backward pass of the same model.

The paper's method should cost at most 2.5x one forward+backward pass. Timings on
a shared CPU are noisy, so both are measured in the same run, interleaved, and the median of
``--repeats`` runs is reported. Models have random weights (built from their configs).

    python benchmarks/bench_engine.py [--repeats 5] [--method transformer_attribution]
"""
from __future__ import annotations

import argparse
import statistics
import time

import timm
import torch
import transformers

import relprop
from relprop.graph.capture import CACHE


def forward_backward(model, inputs, target):
    out = model(**inputs) if isinstance(inputs, dict) else model(inputs)
    logits = out.logits if hasattr(out, "logits") else out
    logits[:, target].sum().backward()
    model.zero_grad(set_to_none=True)


def measure(name, model, inputs, repeats, method):
    target = 1
    relprop.explain(model, inputs, target=target, method=method)  # capture (cached afterwards)
    traces = CACHE.traces
    forward_backward(model, inputs, target)  # warm-up
    fb, ex = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        forward_backward(model, inputs, target)
        fb.append(time.perf_counter() - t)
        t = time.perf_counter()
        relprop.explain(model, inputs, target=target, method=method)
        ex.append(time.perf_counter() - t)
    assert CACHE.traces == traces, "explain() traced again on the same input shapes"
    f, e = statistics.median(fb), statistics.median(ex)
    print(f"| {name} | {method} | {f * 1000:8.1f} | {e * 1000:8.1f} | {e / f:5.2f} |", flush=True)
    return e / f


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--method", default="transformer_attribution")
    args = p.parse_args()
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| model | method | fwd+bwd ms | explain ms | ratio |")
    print("|---|---|---:|---:|---:|")
    vit = timm.create_model("vit_base_patch16_224", pretrained=False).eval()
    measure("timm vit_base_patch16_224, batch 1", vit, torch.randn(1, 3, 224, 224), args.repeats, args.method)
    del vit
    bert = transformers.BertForSequenceClassification(transformers.BertConfig(num_labels=2)).eval()
    ids = {"input_ids": torch.randint(1000, 30000, (1, 128)), "attention_mask": torch.ones(1, 128, dtype=torch.long)}
    measure("BERT-base, 128 tokens, batch 1", bert, ids, args.repeats, args.method)


if __name__ == "__main__":
    main()
