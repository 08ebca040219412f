"""Peak memory of one attention core's forward+backward, whole or in chunks of query rows (issue 29,
goal 5, step 2 of the row-chunked walk; :mod:`relprop.engine.chunked_core`).

The core (Q·Kᵀ, scale, causal mask, softmax, A·V) of a LLaMA-style block (8 heads of 64, 2 key/value
heads) is found in a captured 1-block model and evaluated at ``--tokens`` on random Q, K, V:

* ``whole``: the captured core node by node with autograd, then its backward (A, the scores and
  their gradients are heads × tokens² tensors, as in relprop's recomputed block today);
* ``chunked``: :func:`relprop.engine.chunked_core.core_in_row_chunks` with ``--chunk`` rows.

Each in a fresh process (:mod:`peak_memory`: CPU peak resident set above the start, glibc's mmap
threshold lowered; CUDA ``max_memory_allocated``).

    cd benchmarks && OMP_NUM_THREADS=1 PYTHONPATH=.. python bench_chunked_core.py --tokens 4096 --chunk 256
"""
from __future__ import annotations

import argparse
import json
import sys

from peak_memory import PeakMeter, run_child


def child(what: str, tokens: int, chunk: int, device: str) -> None:
    import torch
    import transformers
    from relprop.engine.chunked_core import RowChunks, core_in_row_chunks
    from relprop.graph.attention_core import evaluate_rows, find_core
    from relprop.graph.capture import capture
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=512, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=tokens,
                                   pad_token_id=0, attn_implementation="eager")
    model = transformers.LlamaForCausalLM(cfg).eval()
    small = 16
    captured = capture(model, {"input_ids": torch.randint(3, 256, (1, small)), "use_cache": False}, "input_ids")
    b = captured.analysis.blocks[0]
    core, why = find_core(b, captured.analysis.live)
    if core is None:
        raise SystemExit(why)
    values = {}
    for n in core.rows + core.whole:
        shape = [tokens if d == small else int(d) for d in n.meta["val"].shape]
        values[n] = torch.randn(shape, device=device, requires_grad=n in captured.analysis.live)
    seed = torch.randn(values[b.scores.args[0]].shape, device=device)
    with PeakMeter(device) as meter:
        if what == "whole":
            out = evaluate_rows(core, values.__getitem__, 0, tokens)[core.nodes[-1]]
        else:
            out = core_in_row_chunks(core, values, RowChunks(rows=chunk))
        out.backward(seed)
        del out
    print(json.dumps({"what": what, "peak_bytes": meter.peak_bytes, "seconds": meter.seconds}))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--device", default="cpu")
    p.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        child(a.child[0], int(a.child[1]), int(a.child[2]), a.child[3])
        return 0
    print(f"attention core of a LLaMA-style block, 8 heads of 64, {a.tokens} tokens, {a.device}; chunk {a.chunk} rows")
    print("| measured | peak MiB | seconds |")
    print("|---|---:|---:|")
    for what in ("whole", "chunked"):
        r, _, err = run_child(__file__, [what, str(a.tokens), str(a.chunk), a.device])
        if r is None:
            print(f"| {what} | failed: {err.strip().splitlines()[-1:]} | |", flush=True)
            continue
        print(f"| {what} | {r['peak_bytes'] / 2**20:.0f} | {r['seconds']:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
