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

``--coverage`` prints instead, per preset, the share of each model's graph nodes handled by an exact rule,
a structural one, a fallback, or missing (``relprop.coverage``; capture only, no explanation), and the total
over the zoo; it draws them (``--figure``) and, given a checkout of DynamicLRP (``--dynamiclrp DIR``), runs
its node count on the same models (``benchmarks/zoo_coverage.py``):

    python benchmarks/zoo_report.py --coverage --dynamiclrp /path/to/dynamicLRP
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
import zoo_coverage  # noqa: E402

FIGURE = os.path.join(ROOT, "docs", "figures", "coverage.png")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", help="zoo names (default: every model)")
    parser.add_argument("--fast", action="store_true", help="only the default subset of tests/test_zoo.py")
    parser.add_argument("--width", type=int, default=150, help="longest cell, in characters")
    parser.add_argument("--reads", action="store_true", help="add a column saying how each head reads its tokens")
    parser.add_argument("--coverage", action="store_true", help="node coverage by rule category instead (see above)")
    parser.add_argument("--presets", default="chefer2021,attnlrp", help="--coverage: presets, comma-separated")
    parser.add_argument("--figure", default=FIGURE, help="--coverage: where the bar chart goes ('' for none)")
    parser.add_argument("--dynamiclrp", metavar="DIR", help="--coverage: a DynamicLRP checkout to count with")
    args = parser.parse_args(argv)
    names = args.models or (zoo.FAST if args.fast else list(zoo.ZOO))
    unknown = [n for n in names if n not in zoo.ZOO]
    if unknown:
        parser.error(f"unknown model(s) {unknown}; choices: {list(zoo.ZOO)}")
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    warnings.filterwarnings("ignore")
    print(f"relprop {relprop.__version__} from {os.path.dirname(relprop.__file__)}, torch {torch.__version__}, "
          f"transformers {transformers.__version__}, timm {timm.__version__}\n")
    if args.coverage:
        return coverage(names, [p for p in args.presets.split(",") if p], args.figure, args.dynamiclrp)

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


def coverage(names, presets, figure, dynamiclrp):
    """The ``--coverage`` report (module docstring)."""
    start = time.perf_counter()
    rows = zoo_coverage.coverage_rows(names, presets)
    for preset in presets:
        t = zoo_coverage.total(rows, preset)
        print(f"## preset '{preset}'\n\n{zoo_coverage.markdown(rows, preset)}\n")
        print(f"{len(names)} models, preset '{preset}': {t.nodes} graph nodes, exact {t.share('exact'):.2f} %, "
              f"structural {t.share('structural'):.2f} %, fallback {t.share('fallback'):.2f} %, missing "
              f"{t.share('missing'):.2f} %; relevance path {sum(t.path_counts.values())} nodes, exact or "
              f"structural {t.share('exact', True) + t.share('structural', True):.2f} %")
        for category in ("fallback", "missing"):
            for op, n, models in zoo_coverage.named_ops(rows, category, preset):
                print(f"  {category}: {op} x{n} in {', '.join(models)}")
        refused = [r.model for r in rows if r.preset == preset and r.error]
        print(f"  capture refused: {', '.join(refused) or 'none'}\n")
    print(f"same counts under: {', '.join(zoo_coverage.same_counts(rows, presets))}")
    print(f"({time.perf_counter() - start:.0f} s)")
    peer = None
    if not dynamiclrp:
        print("\nDynamicLRP: no checkout given (--dynamiclrp DIR), its count not run")
    else:
        start = time.perf_counter()
        peer = zoo_coverage.dynamiclrp_rows(names, dynamiclrp)
        print(f"\n## DynamicLRP ({dynamiclrp}) beside relprop\n\n"
              f"{zoo_coverage.peer_markdown(peer, rows, presets[0])}")
        print(f"({time.perf_counter() - start:.0f} s)")
    if figure:
        zoo_coverage.draw(rows, presets, figure, peer)
        print(f"figure: {os.path.relpath(figure, ROOT)}")


if __name__ == "__main__":
    main()
