"""``relprop visualize``: activation maximization (:func:`relprop.visualize`) from the command line.

::

    relprop visualize --model MODEL --unit class:207 [--unit head:11:2 ...] --out DIR

Writes one PNG per unit (images) or a text file with the nearest tokens (text models), and
``values.csv`` with the unit's value at every step.
"""
from __future__ import annotations

import argparse
import csv
import os
import re

from ..actmax import visualize
from .common import EXIT_OK, EXIT_USAGE, CliError
from .loading import load_model

DESCRIPTION = ("Activation maximization: optimize an input (an image at the model's input size and normalization, "
               "or relaxed word embeddings for text models) to maximize a unit of the model: class:C, "
               "neuron:B:I[:T], channel:B:I, head:B:H, norm:B:T, layer:B (blocks counted from the input). "
               "Writes a PNG per unit (or the nearest tokens) and values.csv into --out.")


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``visualize`` on an ``argparse`` subparsers object; it sets ``func=run``."""
    p = subparsers.add_parser("visualize", help="activation maximization of a unit (class, neuron, head, ...)",
                              description=DESCRIPTION)
    p.add_argument("--model", required=True, metavar="NAME", help="a timm model name, a cached hub id or a folder")
    p.add_argument("--unit", action="append", required=True, metavar="UNIT",
                   help="class:C | neuron:B:I[:T] | channel:B:I | head:B:H | norm:B:T | layer:B (repeatable)")
    p.add_argument("--out", required=True, metavar="FOLDER", help="output folder")
    p.add_argument("--steps", type=int, default=200, help="gradient-ascent steps (200)")
    p.add_argument("--lr", type=float, default=0.05, help="Adam learning rate (0.05)")
    p.add_argument("--l2", type=float, default=1e-3, help="L2 penalty λ (1e-3)")
    p.add_argument("--jitter", type=int, default=0, help="random shift of up to N pixels per step (0: off)")
    p.add_argument("--blur", type=float, default=0.0, help="Gaussian blur σ every --blur-every steps (0: off)")
    p.add_argument("--blur-every", type=int, default=4, help="steps between blurs (4)")
    p.add_argument("--tv", type=float, default=0.0, help="total-variation weight (0: off)")
    p.add_argument("--length", type=int, default=8, help="text models: relaxed positions (8)")
    p.add_argument("--seed", type=int, default=0, help="random seed (0)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Run ``relprop visualize``; returns the exit code."""
    if args.steps < 1:
        raise CliError("--steps must be >= 1", EXIT_USAGE)
    loaded = load_model(args.model)
    os.makedirs(args.out, exist_ok=True)
    norm = (loaded.mean, loaded.std) if loaded.kind == "image" and loaded.mean is not None else None
    rows = []
    for spec in args.unit:
        vis = visualize(loaded.model, spec, steps=args.steps, lr=args.lr, l2=args.l2, jitter=args.jitter,
                        blur=args.blur, blur_every=args.blur_every, tv=args.tv, seed=args.seed,
                        normalization=norm, length=args.length, tokenizer=loaded.tokenizer,
                        progress=not args.no_progress)
        stem = re.sub(r"[^A-Za-z0-9_-]+", "_", str(vis.unit))
        if vis.image is not None:
            path = vis.save(os.path.join(args.out, f"{stem}.png"))
        else:
            path = os.path.join(args.out, f"{stem}.txt")
            with open(path, "w") as f:
                f.write(" ".join(vis.tokens) + "\n")
        rows += [{"unit": str(vis.unit), "step": i, "value": v} for i, v in enumerate(vis.values)]
        print(f"{vis.unit}: {vis.values[0]:.4g} -> {vis.values[-1]:.4g}  {path}"
              + (f"  tokens: {' '.join(vis.tokens)}" if vis.tokens else ""))
    with open(os.path.join(args.out, "values.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["unit", "step", "value"])
        w.writeheader()
        w.writerows(rows)
    return EXIT_OK
