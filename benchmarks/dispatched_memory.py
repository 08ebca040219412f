"""Peak resident memory of explaining a model loaded whole vs dispatched by accelerate to disk.

A LLaMA-style decoder with random weights (hidden 1024, 6 blocks, MLP 2816, vocabulary 8192: about
94 M parameters, 377 MB in float32) is saved once; then, each in a fresh subprocess (``--child``):

* ``plain``: ``from_pretrained(ckpt)``: every weight in memory;
* ``disk``: ``from_pretrained(ckpt, device_map="auto", max_memory={"cpu": "1MB"}, offload_folder=...)``:
  every weight on disk, read by relprop when a node needs it (:mod:`relprop.graph.dispatch`).

Each child loads the model, explains one 16-token prompt (capture included) with the given method
and prints the resident set (``VmRSS``) before and after loading, the peak while loading
(``ru_maxrss``: transformers' own loading, not relprop) and the peak while explaining (``VmHWM``,
reset with ``5 > /proc/self/clear_refs`` once the model is loaded). The explanations of both must agree (printed as the
largest relative difference of the scores).

    PYTHONPATH=$PWD python benchmarks/dispatched_memory.py [--method lrp]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile


def _status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # VmHWM := VmRSS
        f.write("5")


def child(ckpt: str, mode: str, method: str, offload: str) -> None:
    import torch
    import transformers

    import relprop
    torch.set_num_threads(1)
    before = _status_mb("VmRSS")
    if mode == "plain":
        model = transformers.LlamaForCausalLM.from_pretrained(ckpt)
    else:
        model = transformers.LlamaForCausalLM.from_pretrained(ckpt, device_map="auto", max_memory={"cpu": "1MB"},
                                                              offload_folder=offload)
    ids = torch.randint(3, 8192, (1, 16), generator=torch.Generator().manual_seed(0))
    loaded = _status_mb("VmRSS")
    load_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    _reset_peak()
    exp = relprop.explain(model.eval(), {"input_ids": ids}, method=method)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    print(json.dumps({"mode": mode, "peak_mb": _status_mb("VmHWM"), "loaded_mb": loaded, "load_peak_mb": load_peak,
                      "before_mb": before, "weights_mb": weights / 2 ** 20, "scores": exp.scores.flatten().tolist(),
                      "placed": sorted(set(map(str, getattr(model, "hf_device_map", {"": "cpu"}).values())))}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--method", default="transformer_attribution")
    ap.add_argument("--child", nargs=4, metavar=("CKPT", "MODE", "METHOD", "OFFLOAD"))
    args = ap.parse_args()
    if args.child:
        child(*args.child)
        return
    import torch
    import transformers
    with tempfile.TemporaryDirectory() as ckpt, tempfile.TemporaryDirectory() as offload:
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(vocab_size=8192, hidden_size=1024, intermediate_size=2816, num_hidden_layers=6,
                                       num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=64)
        transformers.LlamaForCausalLM(cfg).save_pretrained(ckpt)
        rows = {}
        for mode in ("plain", "disk"):
            out = subprocess.run([sys.executable, __file__, "--child", ckpt, mode, args.method, offload],
                                 capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
            if out.returncode:
                sys.exit(out.stderr[-3000:])
            rows[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    p, d = rows["plain"]["scores"], rows["disk"]["scores"]
    diff = max(abs(a - b) for a, b in zip(p, d)) / max(abs(a) for a in p)
    print(f"method {args.method}; weights {rows['plain']['weights_mb']:.0f} MB (float32)")
    for mode, r in rows.items():
        print(f"{mode:6s} on {','.join(r['placed']):5s} RSS before loading {r['before_mb']:5.0f} MB, loaded "
              f"{r['loaded_mb']:5.0f} MB (loading peak {r['load_peak_mb']:5.0f} MB); "
              f"explain peak {r['peak_mb']:5.0f} MB "
              f"= {r['peak_mb'] - r['before_mb']:4.0f} MB over the RSS before loading")
    print(f"max relative difference of the scores, disk vs plain: {diff:.2e}")


if __name__ == "__main__":
    main()
