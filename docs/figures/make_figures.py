"""Make the figures of docs/methods/aggregation.md, docs/methods/norm_flows.md, docs/methods/heads.md,
docs/activation-maximization.md and the colour legend of docs/getting-started.md (offline: the packaged
all-MiniLM-L6-v2 demo model, and the gallery's trained ViT, docs/gallery/trained_vit: the faithfulness
benchmark's 4-block ViT trained to name the shape in generated images, see docs/gallery/make_vit_gallery.py).

    PYTHONPATH=. python docs/figures/make_figures.py      # writes docs/figures/*.png, prints what it shows
"""
import os
import sys

import matplotlib
import numpy as np
import torch

import relprop
from relprop import demo
from relprop.tools.activation_maximization import total_variation
from relprop.viz import colours, heads_figure, save_figure

matplotlib.use("Agg")
from matplotlib.figure import Figure  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "gallery"))
import make_vit_gallery as trained  # noqa: E402  (the trained ViT and its generated images)

TEXT = "The striker scored twice as the home team won the cup final"


def text_rows(model, tok, rows, title, path):
    batch = tok([TEXT], return_tensors="pt")
    tokens = tok.convert_ids_to_tokens(batch["input_ids"][0])
    data, names = [], []
    for name, method, opts in rows:
        e = relprop.explain(model, batch, method=method, tokenizer=tok, **opts)
        s = e.scores[0].double().numpy()
        real = e.mask[0].numpy()
        lo, hi = s[real].min(), s[real].max()
        data.append(np.where(real, (s - lo) / ((hi - lo) or 1.0), 0.0))  # min-max over the real tokens
        names.append(name)
        top = [tokens[i] for i in np.argsort(-s)[:3]]
        print(f"{title}: {name:<45} top tokens {top}")
    fig = Figure(figsize=(0.45 * len(tokens) + 3.2, 0.38 * len(rows) + 1.4))
    ax = fig.add_subplot(1, 1, 1)
    ax.imshow(np.array(data), aspect="auto", cmap=colours.colormap(signed=False), vmin=0, vmax=1)
    ax.set_xticks(range(len(tokens)))
    ax.set_xticklabels(tokens, rotation=90, fontsize=8)
    ax.set_yticks(range(len(names)))
    ax.set_yticklabels(names, fontsize=8)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    save_figure(fig, path)


def legend():
    """The colour legend (relprop.viz.colours) of docs/getting-started.md#colours."""
    save_figure(colours.legend_figure(), os.path.join(HERE, "colours.png"))


def main():
    legend()
    torch.manual_seed(0)
    model, tok = demo.load()
    q = {"query": "mean"}  # the demo classifies from mean pooling
    text_rows(model, tok, [
        ("rollout (default: mean, rollout)", "rollout", q),
        ("rollout head_fusion=max", "rollout", {**q, "head_fusion": "max"}),
        ("rollout head_fusion=max discard_ratio=0.9", "rollout", {**q, "head_fusion": "max", "discard_ratio": 0.9}),
        ("rollout head_fusion=gradient", "rollout", {**q, "head_fusion": "gradient"}),
        ("rollout start_block=-2", "rollout", {**q, "start_block": -2}),
        ("rollout layers=sum", "rollout", {**q, "layers": "sum"}),
        ("raw_attention (last block)", "raw_attention", q),
        ("gradient_rollout", "gradient_rollout", q),
        ("transformer_attribution", "transformer_attribution", q),
        ("transformer_attribution start_block=-2", "transformer_attribution", {**q, "start_block": -2}),
    ], "aggregation choices (all-MiniLM-L6-v2 zero-shot, predicted label)", os.path.join(HERE, "aggregation.png"))
    text_rows(model, tok, [
        ("raw_attention (last block)", "raw_attention", q),
        ("attention_norm (last block, Kobayashi 2020)", "attention_norm", q),
        ("attention_norm layers=rollout", "attention_norm", {**q, "layers": "rollout"}),
        ("attn_res_ln_norm layers=last (Kobayashi 2021)", "attn_res_ln_norm", {**q, "layers": "last"}),
        ("attn_res_ln_norm (rollout)", "attn_res_ln_norm", q),
    ], "norm-based flows (all-MiniLM-L6-v2)", os.path.join(HERE, "norm_flows.png"))
    batch = tok([TEXT], return_tensors="pt")
    e = relprop.explain(model, batch, method="raw_attention", tokenizer=tok, **q)
    fig = heads_figure(e, 0, tokens=tok.convert_ids_to_tokens(batch["input_ids"][0]))
    save_figure(fig, os.path.join(HERE, "heads_text.png"))
    print(f"heads: text {tuple(e.heads.shape)}")
    vit = trained.load_model()  # the gallery's trained ViT: 64×64 images, 8×8 patches, 4 blocks of 4 heads
    pixels, pair = trained.images()
    x = trained.synth.normalize(pixels[3:])  # the image of two shapes
    e = relprop.explain(vit, x, method="raw_attention")
    save_figure(heads_figure(e, 0, image=x[0], mean=trained.synth.MEAN, std=trained.synth.STD),
                os.path.join(HERE, "heads_image.png"))
    print(f"heads: image {tuple(e.heads.shape)}, shapes {[trained.synth.SHAPES[c] for c in pair]}")
    # activation maximization, before/after the regularizers, of the trained ViT's class "circle"
    plain = relprop.maximize_activation(vit, "class:0", steps=40, lr=0.1, progress=False)
    reg = relprop.maximize_activation(vit, "class:0", steps=40, lr=0.1, jitter=4, blur=1.0, blur_every=4, tv=2.0,
                                      progress=False)
    fig = Figure(figsize=(7, 2.6))
    for i, (name, v) in enumerate([("L2 only", plain), ("L2 + jitter + blur + TV", reg)]):
        ax = fig.add_subplot(1, 3, i + 1)
        ax.imshow(v.image)
        ax.set_axis_off()
        ax.set_title(f"{name}\nlogit {v.values[0]:.2f} → {v.values[-1]:.2f}", fontsize=8)
    ax = fig.add_subplot(1, 3, 3)
    ax.plot(plain.values, label="L2 only")
    ax.plot(reg.values, label="regularized")
    ax.set_xlabel("step", fontsize=8)
    ax.set_title("unit value (class:0, circle)", fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, os.path.join(HERE, "activation_maximization.png"))
    print(f"visualize: L2 only {plain.values[0]:.3f} -> {plain.values[-1]:.3f}; regularized {reg.values[0]:.3f} -> "
          f"{reg.values[-1]:.3f}; TV {float(total_variation(plain.input)):.3f} vs "
          f"{float(total_variation(reg.input)):.3f}")
    t = relprop.maximize_activation(model, "class:0", steps=30, lr=0.05, length=6, tokenizer=tok, progress=False)
    print(f"visualize text (MiniLM demo, label '{list(demo.DEFAULT_LABELS)[0]}'): "
          f"{t.values[0]:.2f} -> {t.values[-1]:.2f}; nearest tokens {t.tokens}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
