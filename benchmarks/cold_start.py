"""What the first explain() of a model costs, in a new process and in the next one.

For each model, two fresh Python processes share one new disk-cache directory:

1. the first process exports the model (nothing cached anywhere) and writes its graph to disk;
2. the second process (a restarted notebook, a second ``relprop explain``) reads the graph from disk.

Each process loads the model, then times its first ``explain()`` call split into the capture
(``export`` by torch.export, ``decompose`` by ``run_decompositions``, ``load`` from disk, ``store``
to disk, relprop's ``analysis`` of the graph at this input size) and the ``first run`` (the rest of
the first call: the engine's plans and the walk), then a ``warm`` call on the same inputs, and one
forward+backward pass of the same score. Goal (issue 26): the second process's first call ≤ 2 ×
its warm call.

    python benchmarks/cold_start.py [--models bert,vitb16,llama] [--threads 1] [--method transformer_attribution]

Models (random weights, built from configs): ``bert`` BERT-base, 128 tokens; ``vitb16`` ViT-B/16
(timm), one 224×224 image; ``llama`` a LLaMA-style decoder (8 layers, width 512), 128 tokens.
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


def child(args) -> dict:
    t0 = time.perf_counter()
    import torch
    sys.path.insert(0, ROOT)
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
    return {"imports": imports, "load_model": load_model, "kind": e.kind, "seconds": e.seconds,
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
    if name == "llama":
        cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                                       num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=512)
        model = transformers.LlamaForCausalLM(cfg).eval()
        ids = torch.randint(3, 31999, (1, 128))
        return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, "next_token"
    raise SystemExit(f"unknown model {name!r}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="bert,vitb16,llama")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--method", default="transformer_attribution")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--cache", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return
    print(f"# first explain() in a new process, {args.threads} thread(s), method {args.method}; seconds")
    print("| model | process | graph | export | decompose | load | store | analysis | first run | first call | "
          "warm call | fwd+bwd | first / warm |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    for name in args.models.split(","):
        with tempfile.TemporaryDirectory() as cache:
            for label in ("new", "next"):
                cmd = [sys.executable, os.path.abspath(__file__), "--child", "--model", name, "--cache", cache,
                       "--threads", str(args.threads), "--method", args.method]
                out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
                r = json.loads(out.stdout.strip().splitlines()[-1])
                s = r["seconds"]
                print(f"| {name} | {label} | {r['kind']} | {s.get('export', 0):.2f} | {s.get('decompose', 0):.2f} | "
                      f"{s.get('load', 0):.2f} | {s.get('store', 0):.2f} | {s.get('analysis', 0):.2f} | "
                      f"{r['first_rest']:.2f} | {r['first']:.2f} | {r['warm']:.2f} | {r['fwdbwd']:.2f} | "
                      f"{r['first'] / r['warm']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
