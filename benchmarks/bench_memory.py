"""Peak memory of ``transformer_attribution`` vs one forward + backward pass ("memory").

Models (random weights; memory does not depend on them): timm ViT-B/16 at batch 8 (224x224),
HuggingFace BERT-base at 512 tokens (batch 1), and (``--model bert2048``) BERT-base at 2048 tokens
(``max_position_embeddings`` raised in a random config) to show how ``memory="low"`` bounds long
inputs. Each measurement runs in a fresh subprocess:

* CUDA: ``torch.cuda.max_memory_allocated`` minus what was allocated before the measured call.
* CPU: tracemalloc does not see torch's CPU tensors, so the peak resident set size (VmHWM of
  /proc/self/status) is read, after resetting it (``5 > /proc/self/clear_refs``) once the model,
  the inputs and the captured graph exist; glibc is told to serve every allocation over 128 KiB
  with mmap (``MALLOC_MMAP_THRESHOLD_``), so that freed tensors leave the resident set at once.

Measured: ``fwdbwd`` (the model's forward, then ``backward`` of the target logit, as a training
step computes it, parameter gradients included), ``fwdbwd-input`` (parameters frozen: the gradient
reaches only the input), ``explain`` (``transformer_attribution``, ``memory="default"``),
``explain-low`` (``memory="low"``), ``explain-high`` (``memory="high"``, the first call: it fills
the per-model memo of split weights, 2x the linear weights) and ``explain-high-2nd`` (the same call
again in the same process, the memo already there). Ratios are to ``fwdbwd``; times are wall-clock
(one call each: noisy on a shared machine; bench_engine.py times repeated calls).

    python benchmarks/bench_memory.py                 # both models, on CUDA if available
    python benchmarks/bench_memory.py --device cpu --model vit
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from peak_memory import PeakMeter, run_child

def _build(name, device):
    import torch
    torch.manual_seed(0)
    if name == "vit":
        import timm
        model = timm.create_model("vit_base_patch16_224", pretrained=False).eval().to(device)
        inputs = torch.randn(8, 3, 224, 224, device=device)
    else:
        import transformers
        n = 2048 if name == "bert2048" else 512
        cfg = transformers.BertConfig(num_labels=2, max_position_embeddings=max(512, n))
        model = transformers.BertForSequenceClassification(cfg).eval().to(device)
        ids = torch.randint(1000, 20000, (1, n), device=device)
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    return model, inputs


def _threads():
    """OMP_NUM_THREADS when set (e.g. 1 on a shared machine), else up to 4."""
    env = os.environ.get("OMP_NUM_THREADS")
    return int(env) if env and env.isdigit() else max(1, min(4, os.cpu_count() or 1))


def child(name, what, device):
    """Measure one thing in this (fresh) process; print a JSON line."""
    import gc

    import torch

    import relprop
    from relprop.graph.capture import CACHE
    from relprop.graph.inputs import bind_inputs

    torch.set_num_threads(_threads())
    model, inputs = _build(name, device)
    if what.startswith("explain"):
        CACHE.get(model, bind_inputs(model, inputs))  # capture outside the measurement
    if what == "explain-high-2nd":
        relprop.explain(model, inputs, target=1, memory="high")  # the first call fills the weight memo
    if what == "fwdbwd-input":
        for p in model.parameters():
            p.requires_grad_(False)
        if torch.is_tensor(inputs):
            inputs = inputs.clone().requires_grad_(True)
        else:  # text: the gradient reaches the word embeddings, passed as inputs_embeds
            embeds = model.get_input_embeddings()(inputs["input_ids"]).detach().requires_grad_(True)
            inputs = {"inputs_embeds": embeds, "attention_mask": inputs["attention_mask"]}
    gc.collect()
    with PeakMeter(device) as meter:
        if what.startswith("fwdbwd"):
            out = model(inputs) if torch.is_tensor(inputs) else model(**inputs)
            logits = out if torch.is_tensor(out) else out.logits
            logits[:, 1].sum().backward()
        else:
            memory = {"explain-low": "low", "explain-high": "high", "explain-high-2nd": "high"}.get(what, "default")
            exp = relprop.explain(model, inputs, target=1, memory=memory)
            del exp
    print(json.dumps({"model": name, "what": what, "device": device, "peak_bytes": meter.peak_bytes,
                      "seconds": meter.seconds}))


def measure(name, what, device):
    result, cmd, stderr = run_child(__file__, [name, what, device])
    if result is None:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{stderr[-3000:]}")
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=("vit", "bert", "bert2048", "all"), default="all")
    parser.add_argument("--what", nargs="+", default=None, help="subset of the measurements")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(*args.child)
        return 0
    import torch
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    names = ["vit", "bert", "bert2048"] if args.model == "all" else [args.model]
    whats = args.what or ["fwdbwd", "fwdbwd-input", "explain", "explain-low", "explain-high", "explain-high-2nd"]
    if "fwdbwd" not in whats:
        whats = ["fwdbwd"] + whats
    label = {"vit": "ViT-B/16, batch 8, 224x224", "bert": "BERT-base, 512 tokens",
             "bert2048": "BERT-base, 2048 tokens"}
    print(f"| model ({device}, {_threads()} threads) | measured | peak MiB | × fwd+bwd | seconds "
          f"| time × fwd+bwd |")
    print("|---|---|---:|---:|---:|---:|")
    for name in names:
        rows = {w: measure(name, w, device) for w in whats}
        ref = rows["fwdbwd"]
        for w in whats:
            r = rows[w]
            peak, ratio = r['peak_bytes'] / 2**20, r['peak_bytes'] / ref['peak_bytes']
            print(f"| {label[name]} | {w} | {peak:.0f} | {ratio:.2f} | "
                  f"{r['seconds']:.2f} | {r['seconds'] / ref['seconds']:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
