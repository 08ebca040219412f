"""``relprop visualize``: activation maximization (:func:`relprop.maximize_activation`) from the command line.

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

from ..tools.activation_maximization import maximize_activation
from .common import EXIT_OK, EXIT_USAGE, CliError
from .loading import load_model
from .parser import add_visualize


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``visualize`` on an ``argparse`` subparsers object (the arguments of
    :func:`relprop.cli.parser.add_visualize`); it sets ``func=run``."""
    p = add_visualize(subparsers)
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
        vis = maximize_activation(loaded.model, spec, steps=args.steps, lr=args.lr, l2=args.l2, jitter=args.jitter,
                                  blur=args.blur, blur_every=args.blur_every, tv=args.tv, seed=args.seed,
                                  normalization=norm, length=args.length, tokenizer=loaded.tokenizer,
                                  progress=False if args.no_progress else None)
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
