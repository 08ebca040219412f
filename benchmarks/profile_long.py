"""cProfile of one folded call on memory_scaling.py's LLaMA-style decoder at a long input.

Where the time of ``transformer_attribution`` or ``gradient_rollout`` (folded, row-chunked walk) goes
beyond one forward+backward pass, timed first in the same process (the capture is done before both):

    cd benchmarks && OMP_NUM_THREADS=1 python profile_long.py 2048 transformer_attribution
    cd benchmarks && OMP_NUM_THREADS=1 python profile_long.py 2048 gradient_rollout

Prints both times, then the 30 functions of most own time and the 60 of most cumulative time.
"""
import cProfile
import pstats
import sys
import time
import warnings

import torch

from memory_scaling import build


def main(tokens: int, method: str) -> None:
    import relprop
    from relprop.graph.capture import CACHE
    from relprop.graph.inputs import bind_inputs

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    model, inputs, target = build("llama", tokens, "sdpa", "cpu")
    CACHE.get(model, bind_inputs(model, inputs))
    t = time.perf_counter()
    logits = model(**inputs).logits
    logits[:, -1, target].sum().backward()
    print("fwdbwd", time.perf_counter() - t)
    del logits
    model.zero_grad(set_to_none=True)
    profile = cProfile.Profile()
    t = time.perf_counter()
    profile.enable()
    relprop.explain(model, inputs, target=target, method=method, keep_blocks=False)
    profile.disable()
    print(method, time.perf_counter() - t)
    stats = pstats.Stats(profile)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(60)


if __name__ == "__main__":
    args = sys.argv[1:] + ["2048", "transformer_attribution"][len(sys.argv) - 1:]
    main(int(args[0]), args[1])
