"""What the row chunks of the long-input path cost and save on a device, and the same methods on a wider model.

One process per model: the capture outside the measurements, one warm-up call before each measured setting, then
``--reps`` timed calls (the fastest is reported) and the largest peak above the memory held before each call
(``peak_memory.PeakMeter``, as ``memory_scaling.py`` measures: CUDA ``max_memory_allocated``; CPU the resident set's
high-water mark, without the child process's lowered mmap threshold, so freed tensors may stay counted).
Every ratio is to one forward+backward pass of the same model in the same process.

* ``tiny``: ``memory_scaling.py``'s ``llama_mha`` (width 512, 4 blocks, 8 heads) at ``--tokens``,
  ``transformer_attribution`` and ``gradient_rollout`` with each ``--settings`` pair (rows per chunk
  ``relprop.RowChunks(rows=...)`` : MiB per chunk tensor ``RowChunks(bytes=...)``), the scores compared with
  the first setting's;
* ``lrp``: the same decoder at twice the tokens, ``lrp`` as called (its ``"lrp"`` preset);
* ``wide``: a wider LLaMA (width 2048, 16 heads and key/value heads, 8 blocks, vocabulary 32000) at ``--tokens``:
  ``transformer_attribution``, ``gradient_rollout``, ``lrp`` under ``"attnlrp"`` and ``lrp`` as called, default chunks.

    PYTHONPATH=. python benchmarks/chunk_sizes.py --device cuda --which tiny wide --settings 256:32 512:64 1024:128

Prints one JSON line per measurement (``x_time``, ``x_mem``: ratios to forward+backward).
"""
import argparse
import json
import os
import sys
import warnings

import torch
import transformers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from memory_scaling import build  # noqa: E402
from peak_memory import PeakMeter  # noqa: E402

import relprop  # noqa: E402
from relprop.graph.capture import CACHE  # noqa: E402
from relprop.graph.inputs import bind_inputs  # noqa: E402


def wide(n: int, device: str, layers: int = 8):
    """The wider LLaMA at ``n`` tokens: (model, inputs, target)."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=layers,
                                   num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=n,
                                   pad_token_id=0, bos_token_id=1, eos_token_id=2, attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(cfg).eval().to(device)
    ids = torch.randint(3, 32000, (1, n), device=device)
    return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, 7


def timed(fn, device: str, reps: int):
    """(the last result of ``fn()``, the seconds of each of ``reps`` calls, the largest peak above the start in
    MiB): :class:`peak_memory.PeakMeter` around each call, as ``memory_scaling.py`` measures."""
    out, seconds, peak = None, [], 0
    for _ in range(reps):
        with PeakMeter(device) as meter:
            out = fn()
        seconds.append(meter.seconds)
        peak = max(peak, meter.peak_bytes)
    return out, seconds, peak / 2 ** 20


def bench(name, model, inputs, target, methods, settings, device: str, reps: int) -> None:
    """Forward+backward, then each (method, options) under each (rows, MiB) setting; one JSON line each."""
    CACHE.get(model, bind_inputs(model, inputs))

    def fwdbwd():
        model(**inputs).logits[:, -1, target].sum().backward()
        model.zero_grad(set_to_none=True)

    fwdbwd()
    _, ts, base_m = timed(fwdbwd, device, 3)
    base_t = min(ts)
    print(json.dumps({"model": name, "what": "fwdbwd", "s": round(base_t, 4), "MiB": round(base_m)}), flush=True)
    for method, options in methods:
        ref = None
        for rows, mib in settings:
            tuning = relprop.Tuning(chunks=relprop.RowChunks(rows=rows, bytes=mib << 20))

            def call():
                return relprop.explain(model, inputs, target=target, method=method, tuning=tuning, **options)
            call()
            exp, ts, peak = timed(call, device, reps)
            scores = exp.scores.detach().double().cpu()
            ref = scores if ref is None else ref
            diff = float((scores - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
            print(json.dumps({"model": name, "what": method, "options": options, "rows": rows, "chunk_MiB": mib,
                              "s": [round(t, 4) for t in ts], "x_time": round(min(ts) / base_t, 2),
                              "MiB": round(peak), "x_mem": round(peak / base_m, 3) if base_m else None,
                              "diff_vs_first": f"{diff:.1e}"}), flush=True)
            del exp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--which", nargs="+", choices=("tiny", "lrp", "wide"), default=["tiny", "lrp", "wide"])
    parser.add_argument("--settings", nargs="+", default=["256:32", "512:64", "1024:128"],
                        help="rows:MiB pairs (RowChunks rows and bytes); 'wide' and 'lrp' use the first only")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--layers", type=int, default=8, help="blocks of the wide model")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    settings = [tuple(int(v) for v in s.split(":")) for s in args.settings]
    both = [("transformer_attribution", {}), ("gradient_rollout", {})]
    if "tiny" in args.which:
        bench("llama_mha", *build("llama_mha", args.tokens, "sdpa", args.device), both, settings, args.device,
              args.reps)
    if "lrp" in args.which:
        bench("llama_mha", *build("llama_mha", 2 * args.tokens, "sdpa", args.device), [("lrp", {})], settings[:1],
              args.device, 1)
    if "wide" in args.which:
        methods = both + [("lrp", {"preset": "attnlrp"}), ("lrp", {})]
        bench(f"wide2048x{args.layers}", *wide(args.tokens, args.device, args.layers), methods, settings[:1],
              args.device, args.reps)


if __name__ == "__main__":
    main()
