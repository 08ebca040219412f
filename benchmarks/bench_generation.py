"""Cost of generation attribution (relprop.explain_generation) per generated token, against one
forward + backward pass of the model on the same sequence.

    PYTHONPATH=. python benchmarks/bench_generation.py [--layers 4] [--width 128] [--prompt 32] [--new 16]

A randomly initialised GPT-2 (no download). Reports, for the teacher-forced explanation of G tokens
(a fixed continuation, so that generation is not timed; the capture is warmed by a first call):
seconds per generated token, and that divided by the seconds of one forward + backward pass
(``model(ids).logits[0, -1, t].backward()``) on the full sequence, batch 1.
"""
import argparse
import copy
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


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--new", type=int, default=16)
    p.add_argument("--repeat", type=int, default=5)
    a = p.parse_args()
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
