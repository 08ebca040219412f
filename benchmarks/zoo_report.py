"""The model zoo's table: every architecture of ``tests/zoo.py`` (tiny random configs) explained with
``transformer_attribution``, ``lrp`` under ``preset="attnlrp"``, ``rollout`` and ``gradient_rollout``, each
outcome checked as ``tests/test_zoo.py`` checks it (``tests/zoo_checks.py``). Printed as markdown: one
row per model, one column per method, each cell

* ``ok``: an explanation that passed every check;
* ``refused: ErrorClass: <first words of the message>``: a RelpropError that says why;
* ``WRONG: <check>: <by how much>``: an explanation that failed a check (the first ones found);
* ``CRASH: <exception type>: <message>``: an exception other than a RelpropError leaked out.

    python benchmarks/zoo_report.py                 # the whole zoo
    python benchmarks/zoo_report.py bert timm_cait  # some models
    python benchmarks/zoo_report.py --fast          # the subset tests/test_zoo.py runs by default
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

import torch

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]  # this checkout's relprop, and the zoo
import relprop  # noqa: E402
import timm  # noqa: E402
import transformers  # noqa: E402
import zoo  # noqa: E402
from zoo_checks import run_cell  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", help="zoo names (default: every model)")
    parser.add_argument("--fast", action="store_true", help="only the default subset of tests/test_zoo.py")
    parser.add_argument("--width", type=int, default=150, help="longest cell, in characters")
    parser.add_argument("--reads", action="store_true", help="add a column saying how each head reads its tokens")
    args = parser.parse_args(argv)
    names = args.models or (zoo.FAST if args.fast else list(zoo.ZOO))
    unknown = [n for n in names if n not in zoo.ZOO]
    if unknown:
        parser.error(f"unknown model(s) {unknown}; choices: {list(zoo.ZOO)}")
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    warnings.filterwarnings("ignore")
    print(f"relprop {relprop.__version__} from {os.path.dirname(relprop.__file__)}, torch {torch.__version__}, "
          f"transformers {transformers.__version__}, timm {timm.__version__}\n")

    methods = list(zoo.METHODS)
    head = ["model", "tags"] + (["head reads"] if args.reads else []) + methods
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---" for _ in head) + "|")
    counts = {"ok": 0, "refused": 0, "wrong": 0, "crash": 0}
    start = time.perf_counter()
    for name in names:
        entry = zoo.ZOO[name]
        cells = []
        for method in methods:
            outcome = run_cell(name, method)
            counts[outcome.status] += 1
            cells.append(outcome.cell(args.width))
        row = [name, ", ".join(entry.tags)] + ([entry.reads.replace("|", "\\|")] if args.reads else []) + cells
        print("| " + " | ".join(row) + " |", flush=True)
    total = sum(counts.values())
    print(f"\n{len(names)} models x {len(methods)} methods = {total} cells: {counts['ok']} ok, "
          f"{counts['refused']} refused, {counts['wrong']} WRONG, {counts['crash']} CRASH "
          f"({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
