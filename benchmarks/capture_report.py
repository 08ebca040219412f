"""Which axes of each zoo model stay dynamic in relprop's capture (one graph for every size), and
what the first capture costs.

For every architecture of ``tests/zoo.py`` (tiny random configs) this explains the zoo's inputs once
with ``raw_attention`` after forgetting every capture (disk cache off), then reads the program the
capture cache holds and prints, per input, each axis as ``batch`` (dynamic batch), ``any`` (another
dynamic size: sequence length, image height/width) or its fixed size. A text model whose sequence
axis is a number is captured again for every new length, and its explanations say so in
``exp.notes``; the last column counts the programs after a second call at other sizes (batch 3,
and for text models every sequence cut by one token).

    python benchmarks/capture_report.py            # the whole zoo
    python benchmarks/capture_report.py --fast     # the default subset of tests/test_zoo.py
    python benchmarks/capture_report.py bert gpt2  # some models
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

import torch

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
os.environ.setdefault("RELPROP_CACHE_DIR", "off")
import relprop  # noqa: E402
from relprop.graph.capture import CACHE  # noqa: E402
import zoo  # noqa: E402


def _axes(program) -> str:
    out = []
    for name, pattern in program.patterns.items():
        if not pattern.tensor:
            continue
        dims = []
        for d in pattern.dims:
            if isinstance(d, int):
                dims.append(str(d))
            else:
                dims.append("batch" if getattr(d, "name", None) == program.batch_symbol else "any")
        out.append(f"{name}[{', '.join(dims)}]")
    return " ".join(out)


def _shorter(inputs):
    """The same inputs with the last position cut (text models): another sequence length."""
    if torch.is_tensor(inputs):
        return inputs[..., :-1] if not inputs.dtype.is_floating_point else inputs
    out = {}
    for k, v in inputs.items():
        cut = torch.is_tensor(v) and not v.dtype.is_floating_point and v.dim() == 2
        out[k] = v[:, :-1] if cut else v
    return out


def _explain(model, entry, inputs):
    try:
        relprop.explain(model, inputs, target=entry.target, method="raw_attention", wrt=entry.wrt)
        return ""
    except relprop.RelpropError as e:  # the capture ran before the method refused
        return type(e).__name__


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*")
    parser.add_argument("--fast", action="store_true")
    args = parser.parse_args(argv)
    names = args.models or (zoo.FAST if args.fast else list(zoo.ZOO))
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    warnings.filterwarnings("ignore")
    print(f"relprop {relprop.__version__}, torch {torch.__version__}\n")
    print("| model | tags | captured axes | first call s | programs after other sizes |")
    print("|---|---|---|---:|---:|")
    fixed = []
    for name in names:
        entry = zoo.ZOO[name]
        model = entry.build()
        relprop.clear_cache(model)
        start = time.perf_counter()
        refused = _explain(model, entry, entry.inputs(model, 2, 0))
        seconds = time.perf_counter() - start
        programs = CACHE.programs(model)
        if not programs:
            print(f"| {name} | {', '.join(entry.tags)} | not captured ({refused}) | {seconds:.1f} | |", flush=True)
            continue
        axes = _axes(programs[-1])
        other = entry.inputs(model, 3, 1)
        _explain(model, entry, _shorter(other) if "text" in entry.tags else other)
        count = len(CACHE.programs(model))
        if count > 1:
            fixed.append(name)
        print(f"| {name} | {', '.join(entry.tags)} | {axes} | {seconds:.1f} | {count} |", flush=True)
    print(f"\n{len(names)} models; captured more than once at other sizes: {', '.join(fixed) or 'none'}")


if __name__ == "__main__":
    main()
