"""Make ``docs/models/img/vision_language.png`` from a tiny randomly initialised LLaVA (no download).

    PYTHONPATH=.:tests python docs/models/make_vlm_figure.py

A synthetic 32x32 image (a bright square on a dark ramp, 4x4 patches of 8) and a prompt of 3 words,
16 image placeholders and 3 words; the model is the tiny LLaVA of ``tests/vlm_models.py`` (CLIP vision
tower, MLP projector, LLaMA, random weights). Panels: the image; ``lrp`` under ``"attnlrp"`` (one run:
the signed pixel map, red positive, blue negative); ``rollout`` on the language model's blocks with
the image placeholders' scores placed on the patch grid; the prompt tokens' ``lrp`` relevance.

The weights are random: the figure shows the layout of the pictures, not what a trained model reads.
"""
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

import relprop  # noqa: E402
import vlm_models  # noqa: E402
from relprop.viz import colours, save_figure  # noqa: E402

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "img")


def main():
    model = vlm_models.llava()
    batch = vlm_models.batch("llava", batch=1)
    img = torch.linspace(0, 0.3, 32)[None, :].expand(32, 32).clone()
    img[8:20, 16:28] = 1.0  # the bright square: patches (1, 2), (1, 3), (2, 2), (2, 3) and their edges
    batch["pixel_values"] = (img[None, None].expand(1, 3, 32, 32) * 2 - 1).contiguous()
    lrp = relprop.explain(model, batch, target="next_token", method="lrp", preset="attnlrp", fast_path=False)
    roll = relprop.explain(model, batch, target="next_token", method="rollout")
    fig, ax = plt.subplots(1, 4, figsize=(13, 3.2), gridspec_kw=dict(width_ratios=[1, 1, 1, 1.6]))
    ax[0].imshow(img.numpy(), cmap="gray", vmin=0, vmax=1)
    ax[0].set_title("synthetic image (4x4 patches)")
    signed = colours.colormap(signed=True)
    m = lrp.map[0]
    lim = float(m.abs().max())
    ax[1].imshow(m.numpy(), cmap=signed, vmin=-lim, vmax=lim)
    ax[1].set_title("lrp (attnlrp): pixel relevance")
    patches = roll.streams["pixel_values"][0].reshape(4, 4)
    ax[2].imshow(img.numpy(), cmap="gray", vmin=0, vmax=1)
    ax[2].imshow(patches.numpy(), cmap=colours.colormap(signed=False), alpha=0.75, extent=(-0.5, 31.5, 31.5, -0.5))
    ax[2].set_title("rollout: image tokens on patches")
    for a in ax[:3]:
        for k in range(1, 4):
            a.axhline(k * 8 - 0.5, color="w", lw=0.4)
            a.axvline(k * 8 - 0.5, color="w", lw=0.4)
        a.set_xticks([])
        a.set_yticks([])
    ids = batch["input_ids"][0]
    words = lrp.streams["input_ids"][0]
    labels = ["<img>" if int(i) == vlm_models.IMAGE_TOKEN else str(int(i)) for i in ids]
    ax[3].bar(range(len(ids)), words.numpy(), color=["#bbbbbb" if lab == "<img>" else "#c0392b" for lab in labels])
    ax[3].set_xticks(range(len(ids)))
    ax[3].set_xticklabels(labels, rotation=90, fontsize=7)
    ax[3].set_title("lrp (attnlrp): prompt tokens (<img>: 0)")
    fig.suptitle(f"tiny LLaVA, random weights: Σ pixels {float(lrp.input_relevance.sum()):.4f} + Σ prompt "
                 f"{float(words.sum()):.4f} + absorbed {float(lrp.conservation.absorbed[0]):.4f} = score "
                 f"{float(lrp.target_scores[0]):.4f}", fontsize=9)
    fig.tight_layout()
    save_figure(fig, os.path.join(HERE, "vision_language.png"))


if __name__ == "__main__":
    main()
