"""Peak memory of ``transformer_attribution`` vs one forward + backward pass (issue 7, "memory").

Models (random weights; memory does not depend on them): timm ViT-B/16 at batch 8 (224x224), and
HuggingFace BERT-base at 512 tokens (batch 1). Each measurement runs in a fresh subprocess:

* CUDA: ``torch.cuda.max_memory_allocated`` minus what was allocated before the measured call.
* CPU: tracemalloc does not see torch's CPU tensors, so the peak resident set size (VmHWM of
  /proc/self/status) is read, after resetting it (``5 > /proc/self/clear_refs``) once the model,
  the inputs and the captured graph exist; glibc is told to serve every allocation over 128 KiB
  with mmap (``MALLOC_MMAP_THRESHOLD_``), so that freed tensors leave the resident set at once.

Measured: ``fwd+bwd`` (the model's forward, then ``backward`` of the target logit, as a training
step computes it, parameter gradients included), ``fwd+bwd (input only)`` (parameters frozen: the
gradient reaches only the input) and ``explain`` (``transformer_attribution``). Ratios are to
``fwd+bwd``; times are wall-clock.

    python benchmarks/bench_memory.py                 # both models, on CUDA if available
    python benchmarks/bench_memory.py --device cpu --model vit
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

MMAP_THRESHOLD = str(128 * 1024)


def _build(name, device):
    import torch
    torch.manual_seed(0)
    if name == "vit":
        import timm
        model = timm.create_model("vit_base_patch16_224", pretrained=False).eval().to(device)
        inputs = torch.randn(8, 3, 224, 224, device=device)
    else:
        import transformers
        cfg = transformers.BertConfig(num_labels=2)
        model = transformers.BertForSequenceClassification(cfg).eval().to(device)
        ids = torch.randint(1000, 20000, (1, 512), device=device)
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    return model, inputs


def _rss_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def child(name, what, device):
    """Measure one thing in this (fresh) process; print a JSON line."""
    import gc

    import torch

    import relprop
    from relprop.graph.capture import CACHE
    from relprop.graph.inputs import bind_inputs

    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    model, inputs = _build(name, device)
    if what.startswith("explain"):
        CACHE.get(model, bind_inputs(model, inputs))  # capture outside the measurement
    if what == "fwdbwd-input":
        for p in model.parameters():
            p.requires_grad_(False)
        if torch.is_tensor(inputs):
            inputs = inputs.clone().requires_grad_(True)
        else:  # text: the gradient reaches the word embeddings, passed as inputs_embeds
            embeds = model.get_input_embeddings()(inputs["input_ids"]).detach().requires_grad_(True)
            inputs = {"inputs_embeds": embeds, "attention_mask": inputs["attention_mask"]}
    gc.collect()
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        base = _rss_kib("VmRSS") * 1024
    t0 = time.perf_counter()
    if what.startswith("fwdbwd"):
        out = model(inputs) if torch.is_tensor(inputs) else model(**inputs)
        logits = out if torch.is_tensor(out) else out.logits
        logits[:, 1].sum().backward()
    else:
        exp = relprop.explain(model, inputs, target=1)
        del exp
    if cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = _rss_kib("VmHWM") * 1024 - base
    seconds = time.perf_counter() - t0
    print(json.dumps({"model": name, "what": what, "device": device, "peak_bytes": peak, "seconds": seconds}))


def measure(name, what, device):
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=MMAP_THRESHOLD, PYTHONWARNINGS="ignore")
    cmd = [sys.executable, __file__, "--child", name, what, device]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=("vit", "bert", "all"), default="all")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(*args.child)
        return 0
    import torch
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    names = ["vit", "bert"] if args.model == "all" else [args.model]
    whats = ["fwdbwd", "fwdbwd-input", "explain"]
    label = {"vit": "ViT-B/16, batch 8, 224x224", "bert": "BERT-base, 512 tokens"}
    print(f"| model ({device}) | measured | peak MiB | × fwd+bwd | seconds |")
    print("|---|---|---:|---:|---:|")
    for name in names:
        rows = {w: measure(name, w, device) for w in whats}
        ref = rows["fwdbwd"]["peak_bytes"]
        for w in whats:
            r = rows[w]
            print(f"| {label[name]} | {w} | {r['peak_bytes'] / 2**20:.0f} | {r['peak_bytes'] / ref:.2f} | "
                  f"{r['seconds']:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
