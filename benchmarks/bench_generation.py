"""Cost of generation attribution (relprop.explain_generation) per generated token, against one
forward + backward pass of the model on the same sequence.

    PYTHONPATH=. python benchmarks/bench_generation.py [--layers 4] [--width 128] [--prompt 32] [--new 16]

A randomly initialised GPT-2 (no download). Reports, for the teacher-forced explanation of G tokens
(a fixed continuation, so that generation is not timed; the capture is warmed by a first call):
seconds per generated token, and that divided by the seconds of one forward + backward pass
(``model(ids).logits[0, -1, t].backward()``) on the full sequence, batch 1.

With ``--memory`` it measures peak memory instead, each in a fresh process (CPU: peak resident set
above the start, glibc's mmap threshold lowered so that freed tensors leave it; CUDA:
``max_memory_allocated``; :mod:`peak_memory`), the capture done before the measurement:

* ``fwdbwd``: one forward + backward pass of the full sequence, batch 1;
* ``generation``: ``explain_generation`` of the ``--new`` tokens with the default chunks of copies
  (about ``relprop.generation.TOKENS_PER_CALL`` tokens per call);
* ``generation-all``: the same with ``batch_size=--new`` (every copy in one call, as before chunking;
  ``--no-all`` leaves it out).

    PYTHONPATH=. python benchmarks/bench_generation.py --memory --prompt 1024 --new 64
    PYTHONPATH=. python benchmarks/bench_generation.py --memory --arch llama --prompt 1024 --new 64 --no-all
"""
import argparse
import copy
import json
import os
import sys
import time

import torch
import transformers as tf

import relprop


def best_of(fns, repeat):
    """The least time of each function over ``repeat`` interleaved rounds (a shared, noisy machine
    slows both alike within a round)."""
    times = [[] for _ in fns]
    for _ in range(repeat):
        for fn, ts in zip(fns, times):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
    return [min(ts) for ts in times]


def build(layers, width, prompt_len, new, arch="gpt2"):
    """A random GPT-2 or LLaMA-style decoder (eager attention, as relprop's graph computes it), a
    prompt and a continuation."""
    torch.manual_seed(0)
    if arch == "llama":
        cfg = tf.LlamaConfig(vocab_size=1000, hidden_size=width, intermediate_size=2 * width, num_hidden_layers=layers,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=prompt_len + new,
                             pad_token_id=0, bos_token_id=1, eos_token_id=2, attn_implementation="eager")
        model = tf.LlamaForCausalLM(cfg).eval()
    else:
        cfg = tf.GPT2Config(vocab_size=1000, n_embd=width, n_layer=layers, n_head=4,
                            n_positions=max(512, prompt_len + new), attn_implementation="eager")
        model = tf.GPT2LMHeadModel(cfg).eval()
    prompt = torch.randint(0, 1000, (1, prompt_len))
    cont = torch.randint(0, 1000, (new,))
    return model, prompt, cont


def child(what, arch, layers, width, prompt_len, new):
    """One peak-memory measurement in this (fresh) process; prints one JSON line."""
    from peak_memory import PeakMeter
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    model, prompt, cont = build(layers, width, prompt_len, new, arch)
    full = torch.cat([prompt, cont[None, :-1]], 1)
    size = {"generation": None, "generation-all": new}.get(what)
    calls = 0
    if what != "fwdbwd":  # the capture (one per batch shape) outside the measurement
        exp = relprop.explain_generation(model, None, prompt, target=cont, batch_size=size)
        calls = len(exp.explanation) if isinstance(exp.explanation, list) else 1
        del exp
    with PeakMeter("cpu") as meter:
        if what == "fwdbwd":
            model(input_ids=full, use_cache=False).logits[0, -1, int(cont[-1])].backward()
        else:
            relprop.explain_generation(model, None, prompt, target=cont, batch_size=size)
    print(json.dumps({"what": what, "peak_bytes": meter.peak_bytes, "seconds": meter.seconds, "calls": calls}))


def memory(a):
    """Peak memory of fwd+bwd, chunked and all-at-once generation attribution (fresh processes)."""
    from peak_memory import run_child
    tokens = a.prompt + a.new - 1
    name = {"gpt2": "GPT-2", "llama": "LLaMA-style decoder (2 key/value heads)"}[a.arch]
    print(f"{name} {a.layers} layers x {a.width}, 4 heads, eager attention; prompt {a.prompt} + {a.new} generated "
          f"tokens ({tokens} tokens per copy); CPU peak RSS delta, {os.environ.get('OMP_NUM_THREADS', '1')} thread(s)")
    print("| measured | calls of explain() | peak MiB | x fwd+bwd | seconds |")
    print("|---|---:|---:|---:|---:|")
    ref = None
    for what in ("fwdbwd", "generation") + (() if a.no_all else ("generation-all",)):
        r, _, err = run_child(__file__, [what, a.arch, str(a.layers), str(a.width), str(a.prompt), str(a.new)])
        if r is None:
            print(f"| {what} | failed: {err.strip().splitlines()[-1:]} | | | |", flush=True)
            continue
        ref = ref or r
        print(f"| {what} | {r['calls']} | {r['peak_bytes'] / 2**20:.0f} | {r['peak_bytes'] / ref['peak_bytes']:.2f} "
              f"| {r['seconds']:.1f} |", flush=True)


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        what, arch, *nums = sys.argv[2:]
        return child(what, arch, *map(int, nums))
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", choices=("gpt2", "llama"), default="gpt2",
                   help="--memory: the decoder measured (GPT-2, or a LLaMA-style decoder: RMSNorm, rotary, GQA)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--new", type=int, default=16)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--memory", action="store_true", help="peak memory in fresh processes instead of times")
    p.add_argument("--no-all", action="store_true", help="--memory: leave out every copy in one call")
    a = p.parse_args()
    if a.memory:
        return memory(a)
    torch.manual_seed(0)
    cfg = tf.GPT2Config(vocab_size=1000, n_embd=a.width, n_layer=a.layers, n_head=4, n_positions=512,
                        attn_implementation="eager")
    model = tf.GPT2LMHeadModel(cfg).eval()
    prompt = torch.randint(0, 1000, (1, a.prompt))
    cont = torch.randint(0, 1000, (a.new,))
    full = torch.cat([prompt, cont[None, :-1]], 1)
    grad_model = copy.deepcopy(model)

    def fwd_bwd():
        grad_model.zero_grad(set_to_none=True)
        grad_model(input_ids=full, use_cache=False).logits[0, -1, int(cont[-1])].backward()

    def gen():
        relprop.explain_generation(model, None, prompt, target=cont)

    t0 = time.perf_counter()
    gen()  # capture
    first = time.perf_counter() - t0
    fb, g = best_of([fwd_bwd, gen], a.repeat)
    print(f"GPT-2 {a.layers} layers x {a.width}, prompt {a.prompt} + {a.new} generated tokens, "
          f"{torch.get_num_threads()} threads")
    print(f"one forward+backward (batch 1, {full.shape[1]} tokens): {fb * 1e3:.1f} ms")
    print(f"explain_generation (lrp/attnlrp, fast path), first call with capture: {first:.2f} s")
    print(f"explain_generation warm: {g * 1e3:.1f} ms total, {g / a.new * 1e3:.1f} ms per generated token = "
          f"{g / a.new / fb:.2f} x one forward+backward")


if __name__ == "__main__":
    main()
