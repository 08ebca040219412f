"""Conservation error and batch invariance of ``explain()`` for every supported model family.

Per family (tiny random models built from configs), the end-to-end relative
conservation error |injected - input - absorbed| / injected under ``"chefer2021"`` (max over the
samples), the worst per-block error, and the max abs difference between explaining a batch of 4
(text: different lengths, padded) and explaining each sample alone.

    python benchmarks/conservation_report.py
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
import models  # noqa: E402

import relprop  # noqa: E402


def batch_invariance(model, name):
    if name in models.VISION:
        x = models.image_batch(model, batch=4, seed=3)
        full = relprop.explain(model, x, target=[0, 1, 2, 3])
        return max(float((full.scores[i] - relprop.explain(model, x[i:i + 1], target=i).scores[0]).abs().max())
                   for i in range(4))
    lengths = (7, 5, 9, 3)
    batch = models.text_batch(lengths, pad_id=1 if "roberta" in name else 0, first_id=3)
    full = relprop.explain(model, batch, target=[0, 1, 2, 1])
    worst = 0.0
    for i, n in enumerate(lengths):
        alone = relprop.explain(model, {k: v[i:i + 1, :n] for k, v in batch.items()}, target=[0, 1, 2, 1][i])
        worst = max(worst, float((full.scores[i, :n] - alone.scores[0]).abs().max()))
    return worst


def main():
    print("| family | end-to-end rel. error | worst block rel. error | absorbed share "
          "| batch-invariance max abs diff |")
    print("|---|---:|---:|---:|---:|")
    for name, make in {**models.VISION, **models.TEXT}.items():
        model = make()
        x = (models.image_batch(model) if name in models.VISION
             else models.text_batch(pad_id=1 if "roberta" in name else 0))
        c = relprop.explain(model, x, target=1).conservation
        block = max(float(b.error.max()) for b in c.blocks)
        print(f"| {name} | {float(c.error.max()):.1e} | {block:.1e} | {float((c.absorbed / c.injected).mean()):.2f} "
              f"| {batch_invariance(model, name):.1e} |", flush=True)


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
