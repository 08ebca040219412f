"""Where the relevance of position encodings goes under ``"attnlrp"`` and ``"pa_lrp"`` (Bakish et al.,
NeurIPS 2025), on tiny random models built from configs with every bias set to 0 (so that biases absorb
nothing and the ledger shows the position encodings' share alone).

Per model and preset (the sums over a batch of 2, the target class 0 / 1): the explained score (injected),
the relevance reaching the input, what position encodings absorb (AttnLRP: the learned position
embeddings; rotary factors get none, the content path gets all), what everything else absorbs (the
softmax's bias term, the class token, ...), and the end-to-end relative conservation error.

    python benchmarks/position_share.py
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
import models  # noqa: E402

import relprop  # noqa: E402

def hf_deit():
    """HF DeiT initializes its position embedding (and class/distillation tokens) to 0: drawn here instead."""
    m = models.hf_deit("eager")
    with torch.no_grad():
        for p in (m.deit.embeddings.position_embeddings, m.deit.embeddings.cls_token,
                  m.deit.embeddings.distillation_token):
            p.normal_(0, 0.02, generator=torch.Generator().manual_seed(1))
    return m


MODELS = {"hf_vit": lambda: models.hf_vit("eager"), "hf_deit": hf_deit,
          "timm_vit_tiny": models.timm_vit_tiny, "timm_deit_tiny_distilled": models.timm_deit_tiny_distilled,
          "hf_bert": lambda: models.hf_bert("eager"), "hf_gpt2_cls": lambda: models.hf_gpt2_cls("eager"),
          "hf_llama": lambda: models.hf_llama("eager")}
PREFIX = "position embeddings of the prefix tokens (class, ...)"


def inputs(name, model):
    if name.startswith("timm") or name in ("hf_vit", "hf_deit"):
        return models.image_batch(model, batch=2), [0, 1]
    if name == "hf_llama":
        return torch.randint(3, 50, (2, 6), generator=torch.Generator().manual_seed(0)), [5, 7]
    return models.text_batch((7, 5)), [0, 1]


def row(name):
    model = models.zero_biases(MODELS[name]())
    x, target = inputs(name, model)
    a, p = (relprop.explain(model, x, target=target, method="lrp", preset=preset, fast_path=False).conservation
            for preset in ("attnlrp", "pa_lrp"))
    prefix = p.absorbed_by.get(PREFIX, torch.zeros(2))
    leak = a.absorbed - p.absorbed  # what AttnLRP's position encodings absorb and PA-LRP gives the tokens

    def f(t):
        return f"{float(t.sum()):+.4f}"
    return (f"| {name} | {f(a.injected)} | {f(a.input)} | {f(a.absorbed)} | {f(leak)} | {f(p.input)} | "
            f"{f(p.absorbed)} | {f(prefix)} | {float(a.error.max()):.1e} / {float(p.error.max()):.1e} |")


def main():
    print("| model | injected | attnlrp: input | attnlrp: absorbed | of which at patch/token positions | "
          "pa_lrp: input | pa_lrp: absorbed | of which at prefix-token positions | rel. error attnlrp / pa_lrp |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in MODELS:
        print(row(name), flush=True)


if __name__ == "__main__":
    main()
