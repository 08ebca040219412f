"""Peak memory and time of ``transformer_attribution`` as inputs grow, against one forward+backward.

Goal 3 of issue 14 ("memory flat in sequence length"): Transformer Attribution within 1.5x the
peak memory and 2.5x the time of one forward+backward pass of the same model, on BERT-base at up
to 2048 tokens and on a LLaMA-style decoder at up to 4096 tokens.

Models (random weights, built from configs; memory and time do not depend on the weights):

* ``bert``: HuggingFace BERT-base (12 blocks, 12 heads, hidden 768; ``max_position_embeddings``
  raised to the length), sequence classification, batch 1, target class 1.
* ``llama``: a LLaMA-style decoder (RMSNorm, rotary embeddings, gated SiLU MLP, grouped-query
  attention) far smaller than a real LLaMA so that one thread can run it at 4096 tokens: hidden 512,
  8 heads of 64 (2 key/value heads), MLP 1408, 4 blocks, vocabulary 4096; causal LM, batch 1, target
  a fixed next token at the last position.
* ``llama_mha``: the same decoder with 8 key/value heads (no grouping). On CUDA, sdpa has no fused
  kernel for grouped-query attention in float32 (``llama``'s forward+backward there is math attention,
  a heads x tokens² tensor per block); this variant's runs the memory-efficient kernel, the baseline
  a GPU user of a fused model pays.

Measured, each in a fresh subprocess (``--child``):

* ``fwdbwd``: the model's forward, then ``backward()`` of the target score (parameter gradients
  included), with the model's default attention (``sdpa``: fused, no tokens² tensor kept);
* ``fwdbwd-eager``: the same with ``attn_implementation="eager"`` (the attention probabilities of
  every block kept for the backward pass, as relprop's captured graph computes them);
* ``ta-full``: ``relprop.explain(..., method="transformer_attribution")`` with ``keep_blocks=True``
  (every block's A, dA, R_A kept; the full-matrix path);
* ``ta-fold`` (``ta-stream`` in older results): the same with ``keep_blocks=False`` (each block
  folded into the query row during the reverse walk and dropped, :mod:`relprop.methods.fold_maps`);
* ``ta-default``: the same with ``keep_blocks`` not given (records kept while they fit
  ``records_budget``, else folded: :func:`relprop.engine.schedule.fold_choice`); the row says which ran.
* ``ta-rows``, ``gr-rows`` (``gr-fold``): ``transformer_attribution`` (``gradient_rollout``) folded with the
  row-chunked walk (``relprop.Tuning(chunks=relprop.RowChunks(rows=ROWS))``; on by default since 2026-11-27,
  so ``ta-fold`` and ``gr-fold`` run it too);
* ``lrp``: ``method="lrp", preset="attnlrp"`` (the plain one-backward fast path: ``memory="high"``, which
  never segments; before 2026-11-27 ``memory="default"`` was this path at every length);
  ``lrp-default``: the same with ``memory`` not given (plain, or segmented beyond ``records_budget``:
  :func:`relprop.engine.schedule.segment_choice`);
  ``lrp-low``: the same with ``memory="low"`` (the fast path segment by segment, attention cores in row
  chunks of :data:`ROWS`: :mod:`relprop.engine.fast_low`).
* ``lrp-rules``: ``method="lrp"`` as a user calls it, with its own preset (``"lrp"``, the authors' LRP
  baseline rules, which have no fast path: the graph is walked rule by rule) and ``memory`` not given
  (the whole walk, or segmented without block records beyond ``records_budget`` since 2026-11-27).

Memory on CPU is the peak resident set size of the process (VmHWM of /proc/self/status, reset with
``5 > /proc/self/clear_refs`` once the model, the inputs and, for relprop, the captured graph exist)
minus the resident set at that moment; glibc is told to serve allocations over 128 KiB with mmap
(``MALLOC_MMAP_THRESHOLD_``) so that freed tensors leave the resident set at once. On CUDA it is
``torch.cuda.max_memory_allocated`` minus what was allocated before. Time is the wall-clock time of
the one measured call (the capture, cached per model and input shape, is done before it); on CPU it
is taken in a second fresh process with glibc's default allocator (``--one-run``: from the memory
run, where every tensor over 128 KiB is fresh memory the kernel faults in page by page, which
penalizes the call that allocates more).

    OMP_NUM_THREADS=1 python benchmarks/memory_scaling.py                       # every configuration
    OMP_NUM_THREADS=1 python benchmarks/memory_scaling.py --model bert --tokens 512 1024 2048
    OMP_NUM_THREADS=1 python benchmarks/memory_scaling.py --model llama --tokens 4096 --what fwdbwd ta-fold
    OMP_NUM_THREADS=1 python benchmarks/memory_scaling.py --model bert --tokens 2048 --repeats 3
    OMP_NUM_THREADS=1 python benchmarks/memory_scaling.py --model llama --tokens 4096 --what fwdbwd lrp lrp-low
    bash benchmarks/long_context_gpu.sh        # issue 29's three targets on a CUDA GPU
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

from peak_memory import PeakMeter, run_child

WHATS = ("fwdbwd", "fwdbwd-eager", "ta-full", "ta-fold", "ta-default", "ta-rows", "gr-fold", "gr-rows", "lrp",
         "lrp-low", "lrp-default", "lrp-rules")
#: query rows per chunk of the row-chunked walk of the "-rows" measurements (relprop.RowChunks(rows=...))
ROWS = 256
DEFAULT_TOKENS = {"bert": (512, 1024, 2048), "llama": (1024, 2048, 4096), "llama_mha": (1024, 2048, 4096)}
TARGET_TOKEN = 7


def _threads() -> int:
    env = os.environ.get("OMP_NUM_THREADS")
    return int(env) if env and env.isdigit() else 1


def build(name: str, n: int, attn: str, device: str):
    """(model, inputs, target) for model ``name`` at ``n`` tokens with attention ``attn``."""
    import torch
    import transformers
    torch.manual_seed(0)
    if name == "bert":
        cfg = transformers.BertConfig(num_labels=2, max_position_embeddings=max(512, n), attn_implementation=attn)
        model = transformers.BertForSequenceClassification(cfg)
        ids = torch.randint(1000, 20000, (1, n))
        target = 1
    else:
        cfg = transformers.LlamaConfig(vocab_size=4096, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                                       num_attention_heads=8, num_key_value_heads=8 if name == "llama_mha" else 2,
                                       max_position_embeddings=n,
                                       pad_token_id=0, bos_token_id=1, eos_token_id=2, attn_implementation=attn)
        model = transformers.LlamaForCausalLM(cfg)
        ids = torch.randint(3, 4096, (1, n))
        target = TARGET_TOKEN
    model = model.eval().to(device)
    ids = ids.to(device)
    return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, target


def child(name: str, n: int, what: str, device: str) -> None:
    """Measure one configuration in this (fresh) process; print one JSON line."""
    import gc
    import warnings

    import torch

    import relprop
    from relprop.graph.capture import CACHE
    from relprop.graph.inputs import bind_inputs

    warnings.simplefilter("ignore")
    torch.set_num_threads(_threads())
    model, inputs, target = build(name, n, "eager" if what == "fwdbwd-eager" else "sdpa", device)
    if not what.startswith("fwdbwd"):
        CACHE.get(model, bind_inputs(model, inputs))  # the capture is outside the measurement
    rows = relprop.Tuning(chunks=relprop.RowChunks(rows=ROWS))
    kept = []

    def call():
        if what.startswith("fwdbwd"):
            logits = model(**inputs).logits
            score = logits[:, 1] if name == "bert" else logits[:, -1, target]
            score.sum().backward()
            del logits, score
            model.zero_grad(set_to_none=True)
        elif what == "lrp-rules":  # lrp as a user calls it: its own preset ("lrp": no fast path), memory not given
            exp = relprop.explain(model, inputs, target=target, method="lrp")
            del exp
        elif what.startswith("lrp"):
            memory = {"lrp": "high", "lrp-low": "low", "lrp-default": "default"}[what]
            exp = relprop.explain(model, inputs, target=target, method="lrp", preset="attnlrp", memory=memory,
                                  tuning=rows)
            del exp
        else:
            keep = {"ta-full": True, "ta-fold": False, "ta-rows": False, "gr-fold": False, "gr-rows": False}.get(what)
            # the row-chunked walk (on by default since 2026-11-27; "-rows": ROWS rows per chunk)
            tuning = rows if what.endswith("-rows") else None
            method = "gradient_rollout" if what.startswith("gr") else "transformer_attribution"
            exp = relprop.explain(model, inputs, target=target, method=method, keep_blocks=keep, tuning=tuning)
            kept[:] = [exp.kept_blocks]
            del exp

    if device.startswith("cuda"):  # one call outside the measurement: kernels loaded, the allocator warm
        call()
        torch.cuda.synchronize()
    gc.collect()
    with PeakMeter(device) as meter:
        call()
    kept = kept[0] if kept else None
    print(json.dumps({"model": name, "tokens": n, "what": what, "device": device, "peak_bytes": meter.peak_bytes,
                      "seconds": meter.seconds, "threads": torch.get_num_threads(), "kept_blocks": kept}))


def measure(name: str, n: int, what: str, device: str, for_memory: bool = True, rows: int = ROWS) -> dict:
    result, _, stderr = run_child(__file__, [name, str(n), what, device, str(rows)], for_memory=for_memory)
    return result if result is not None else {"error": stderr.strip().splitlines()[-1:] or ["no output"]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=("bert", "llama", "llama_mha", "all"), default="all")
    parser.add_argument("--tokens", type=int, nargs="+", default=None, help="sequence lengths (default per model)")
    parser.add_argument("--what", nargs="+", choices=WHATS, default=None, help="subset of the measurements")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    parser.add_argument("--one-run", action="store_true",
                        help="CPU: take the time from the memory run (lowered mmap threshold) instead of a second "
                             "process with glibc's default allocator")
    parser.add_argument("--repeats", type=int, default=1,
                        help="CPU: time runs per configuration (fresh processes, default allocator); the median")
    parser.add_argument("--rows", type=int, default=ROWS,
                        help=f"query rows per chunk of the -rows and lrp measurements (default {ROWS})")
    parser.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        name, n, what, device, rows = args.child
        globals()["ROWS"] = int(rows)  # (read by child's calls)
        child(name, int(n), what, device)
        return 0
    import torch
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    names = ["bert", "llama"] if args.model == "all" else [args.model]
    whats = list(args.what or WHATS)
    if "fwdbwd" not in whats:
        whats = ["fwdbwd"] + whats
    memory = "peak RSS delta" if device == "cpu" else "max_memory_allocated delta"
    second = device == "cpu" and not args.one_run
    clock = "default allocator" if second else "the memory run"
    print(f"| model ({device}, {_threads()} thread(s), {memory}; time: {clock}) | tokens | measured | peak MiB "
          f"| × fwd+bwd | seconds | time × fwd+bwd |")
    print("|---|---:|---|---:|---:|---:|---:|")
    for name in names:
        for n in args.tokens or DEFAULT_TOKENS[name]:
            ref = None
            for w in whats:
                r = measure(name, n, w, device, rows=args.rows)
                if "error" not in r and second:  # the time of runs under glibc's defaults: the median
                    times = [measure(name, n, w, device, for_memory=False, rows=args.rows)
                             for _ in range(max(1, args.repeats))]
                    bad = [t for t in times if "error" in t]
                    r = bad[0] if bad else dict(r, seconds=statistics.median(t["seconds"] for t in times),
                                                 runs=[round(t["seconds"], 2) for t in times])
                if "error" in r:
                    print(f"| {name} | {n} | {w} | failed: {r['error'][0][:120]} | | | |", flush=True)
                    continue
                ref = ref or (r if w == "fwdbwd" else None)
                mib = r["peak_bytes"] / 2**20
                ratio = f"{r['peak_bytes'] / ref['peak_bytes']:.2f}" if ref else "-"
                tratio = f"{r['seconds'] / ref['seconds']:.2f}" if ref else "-"
                runs = f" ({', '.join(map(str, r['runs']))})" if len(r.get("runs", [])) > 1 else ""
                if w == "ta-default" and r.get("kept_blocks") is not None:
                    w = f"{w} ({'records kept' if r['kept_blocks'] else 'folded'})"
                print(f"| {name} | {n} | {w} | {mib:.0f} | {ratio} | {r['seconds']:.2f}{runs} | {tratio} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
