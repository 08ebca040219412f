"""How clearly does the demo's picture rank words, and do the two labels' explanations differ?

For the offline demo model (all-MiniLM-L6-v2 as a zero-shot topic classifier, ``relprop.demo``) and each
candidate method, per sentence, on the words the demo displays (word pieces merged, special tokens
left out):

* ``max/min``: the largest displayed |score| over the smallest (the issue measured 1.28-1.51 for the
  old default: every word nearly the same colour);
* ``top/med``: the largest |score| over the median |score| (how far the top word stands out);
* ``rho``: Spearman's rank correlation between the word scores of the predicted label and of the
  runner-up (1 = the same ranking for both labels; lower = the explanations differ);
* ``top3``: how many of the predicted label's three top words are also the runner-up's.

    python benchmarks/demo_contrast.py            # prints a markdown table (a few minutes on 2 cores)
"""
from __future__ import annotations

import statistics
import sys

import numpy as np
import torch

import relprop
from relprop import demo
from relprop.methods import get_method
from relprop.viz import text as vtext

#: (name shown, method, options); the options the demo passes (query="mean") where the method takes them
CANDIDATES = [
    ("gradient_rollout", "gradient_rollout", {}),
    ("transformer_attribution", "transformer_attribution", {}),
    ("attcat", "attcat", {}),
    ("input_x_gradient", "input_x_gradient", {}),
    ("integrated_gradients (32 steps)", "integrated_gradients", {"n_steps": 32}),
    ("lrp, preset attnlrp", "lrp", {"preset": "attnlrp"}),
]

#: the demo's sentences plus sentences about two topics (where the two labels' explanations should differ)
TEXTS = list(demo.DEFAULT_TEXTS) + [
    "The football club's shares rose after the new stadium deal with the bank.",
    "The minister visited the hospital to discuss the new vaccine law.",
    "The chef built a phone app that plans recipes with artificial intelligence.",
]


def words(exp, tok, batch, i):
    rows = vtext.token_strings(tok, batch["input_ids"])
    return [t for t in vtext.tokens_of(exp, i, rows[i], merge_words=True) if not t.special]


def spearman(a, b):
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1])


def measure(model, tok, method, options, texts=TEXTS):
    batch = dict(tok(texts, padding=True, return_tensors="pt"))
    with torch.no_grad():
        top2 = model(**batch).topk(2, dim=-1).indices
    opts = dict(options)
    opts.update({k: v for k, v in demo.OPTIONS.items() if k in get_method(method).options})
    pred = relprop.explain(model, batch, target=top2[:, 0], method=method, **opts)
    runner = relprop.explain(model, batch, target=top2[:, 1], method=method, **opts)
    rows = []
    for i in range(len(texts)):
        a = np.array([t.score for t in words(pred, tok, batch, i)])
        b = np.array([t.score for t in words(runner, tok, batch, i)])
        mag = np.abs(a)
        top3 = set(np.argsort(-a)[:3]) & set(np.argsort(-b)[:3])
        rows.append({"max/min": float(mag.max() / max(mag.min(), 1e-12)),
                     "top/med": float(mag.max() / max(np.median(mag), 1e-12)),
                     "rho": spearman(a, b), "top3": len(top3)})
    return rows


def main(argv=None):
    model, tok = demo.load()
    print("| method | max/min (median, range) | top/med (median) | rho pred vs runner-up (median) | "
          "shared top-3 words (mean) |")
    print("|---|---|---|---|---|")
    for shown, method, options in CANDIDATES:
        r = measure(model, tok, method, options)
        mm = [x["max/min"] for x in r]
        print(f"| {shown} | {statistics.median(mm):.2f} ({min(mm):.2f}-{max(mm):.2f}) | "
              f"{statistics.median(x['top/med'] for x in r):.2f} | {statistics.median(x['rho'] for x in r):.2f} | "
              f"{statistics.mean(x['top3'] for x in r):.2f} |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
