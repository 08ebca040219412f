"""What the first explain() of a model costs against one plain torch.export of it.

Each model runs in a fresh Python process (1 thread by default, random weights, the disk cache off
unless ``--disk``): a tiny warm-up export (torch's one-time setup), one static
``torch.export.export(copy, (), inputs, strict=False)`` of a copy of the model, then relprop's first
``explain()`` (the capture split into ``export``, ``decompose``, relprop's ``analysis`` of the graph
at this input size, and the ``first run``: the rest of the first call), a ``warm`` call on the same
inputs and one forward+backward pass of the same score. Printed: the table of issue 45 (static
export, first call, warm call, forward+backward, capture / static export where capture = first −
warm, first / forward+backward) and the breakdown. Goals (issue 45): capture ≤ 1.5 × the static
export; BERT-base's first call ≤ 2.5 × its warm call. With ``--disk`` each model also runs a second
process that reads the graph from the disk cache (issue 26: its first call ≤ 2 × its warm call).

    python benchmarks/cold_start.py [--models bert,vitb16,llama8,llama32] [--threads 1]
        [--method transformer_attribution] [--disk] [--root DIR]

Models: ``bert`` BERT-base classifier, 128 tokens; ``vitb16`` timm ViT-B/16, one 224×224 image;
``llama8`` / ``llama32`` LLaMA-style decoders of 8 / 32 layers, width 256, 64 tokens (next-token
target); ``llama`` the 8-layer width-512 decoder at 128 tokens of the earlier table. ``--root``
runs another checkout of relprop (e.g. a ``git worktree`` of an older commit, for a before/after).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..")


def _static_export(model, inputs) -> float:
    """Seconds of one plain static torch.export of a copy of ``model`` (after a tiny warm-up export)."""
    import copy

    import torch
    tiny = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU())
    with torch.no_grad():
        torch.export.export(tiny, (torch.randn(2, 4),), strict=False)
        other = copy.deepcopy(model)
        kwargs = dict(inputs) if isinstance(inputs, dict) else {"x": inputs}
        if "input_ids" in kwargs and hasattr(model.config, "use_cache"):
            kwargs["use_cache"] = False
        t = time.perf_counter()
        torch.export.export(other, (), kwargs, strict=False)
        return time.perf_counter() - t


def child(args) -> dict:
    t0 = time.perf_counter()
    import torch
    sys.path.insert(0, args.root)
    import relprop
    from relprop import api
    from relprop.graph import disk_cache
    imports = time.perf_counter() - t0
    torch.set_num_threads(args.threads)
    disk_cache.set_cache_dir(args.cache)
    import warnings
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    t = time.perf_counter()
    model, inputs, target = build(args.model)
    load_model = time.perf_counter() - t
    static = _static_export(model, inputs) if args.static else None
    explain = relprop.explain  # the lazy import of the api happens here, not inside the timed call
    t = time.perf_counter()
    prepared = api.prepare(model, inputs, None)
    capture = time.perf_counter() - t
    t = time.perf_counter()
    explain(model, inputs, target=target, method=args.method)
    first_rest = time.perf_counter() - t
    t = time.perf_counter()
    explain(model, inputs, target=target, method=args.method)
    warm = time.perf_counter() - t
    t = time.perf_counter()
    out = model(**inputs) if isinstance(inputs, dict) else model(inputs)
    logits = out.logits if hasattr(out, "logits") else out
    (logits[:, -1, 0] if logits.dim() == 3 else logits[:, 0]).sum().backward()
    fwdbwd = time.perf_counter() - t
    e = prepared.event
    return {"imports": imports, "load_model": load_model, "kind": e.kind, "seconds": e.seconds, "static": static,
            "capture": capture, "first_rest": first_rest, "first": capture + first_rest, "warm": warm,
            "fwdbwd": fwdbwd}


def build(name):
    import timm
    import torch
    import transformers
    if name == "bert":
        model = transformers.BertForSequenceClassification(transformers.BertConfig(num_labels=2)).eval()
        ids = torch.randint(1000, 20000, (1, 128))
        return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, 0
    if name == "vitb16":
        model = timm.create_model("vit_base_patch16_224", pretrained=False).eval()
        return model, torch.randn(1, 3, 224, 224), 0
    if name in ("llama8", "llama32"):
        cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=256, intermediate_size=688,
                                       num_hidden_layers=int(name[5:]), num_attention_heads=4, num_key_value_heads=4,
                                       max_position_embeddings=512)
        model = transformers.LlamaForCausalLM(cfg).eval()
        ids = torch.randint(3, 31999, (1, 64))
        return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, "next_token"
    if name == "llama":
        cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                                       num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=512)
        model = transformers.LlamaForCausalLM(cfg).eval()
        ids = torch.randint(3, 31999, (1, 128))
        return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, "next_token"
    raise SystemExit(f"unknown model {name!r}")


def _row(name, label, r) -> str:
    s = r["seconds"]
    decompose = sum(v for k, v in s.items() if k.startswith("decompose"))
    capture = r["first"] - r["warm"]
    static = r.get("static")
    ratio = f"{capture / static:.2f}" if static else "—"
    how = "whole program" if "decompose (whole program)" in s else "node by node"
    return (f"| {name} | {label} | {r['kind']} | {static or 0:.2f} | {r['first']:.2f} | {r['warm']:.2f} | "
            f"{r['fwdbwd']:.2f} | **{ratio}** | {r['first'] / r['fwdbwd']:.1f} | {r['first'] / r['warm']:.2f} | "
            f"{s.get('export', 0):.2f} | {decompose:.2f} ({how}) | {s.get('load', 0):.2f} | "
            f"{s.get('analysis', 0):.2f} | {r['first_rest']:.2f} |")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="bert,vitb16,llama8,llama32")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--method", default="transformer_attribution")
    p.add_argument("--disk", action="store_true", help="also a second process reading the disk cache")
    p.add_argument("--root", default=ROOT, help="the relprop checkout to run")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--static", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--cache", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return
    print(f"# first explain() in a new process, {args.threads} thread(s), method {args.method}, relprop at "
          f"{os.path.abspath(args.root)}; seconds")
    print("| model | process | graph | static export | first call | warm call | fwd+bwd | capture / export | "
          "first / fwd+bwd | first / warm | export | decompose | load | analysis | first run |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    for name in args.models.split(","):
        with tempfile.TemporaryDirectory() as cache:
            for label in (("new", "next") if args.disk else ("new",)):
                cmd = [sys.executable, os.path.abspath(__file__), "--child", "--model", name,
                       "--cache", cache if args.disk else "", "--threads", str(args.threads), "--method", args.method,
                       "--root", os.path.abspath(args.root)] + (["--static"] if label == "new" else [])
                out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
                print(_row(name, label, json.loads(out.stdout.strip().splitlines()[-1])), flush=True)


if __name__ == "__main__":
    main()
