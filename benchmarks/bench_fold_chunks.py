"""Time of the fold of Transformer Attribution (CVPR 2021, Eq. 13-14) with each block's
map built in chunks of query rows, against one chunk per block, on random records.

    PYTHONPATH=. python benchmarks/bench_fold_chunks.py [--heads 8] [--tokens 2048] [--blocks 3] [--rounds 3]

The records are random (a lower-triangular A, ∇A non-zero at the last row of the block next to the
output, R_A of both signs) and are fed to :class:`relprop.methods.fold_maps.RowFold` output block
first, as the engine hands them over; the rounds interleave the chunk sizes (least time printed,
every run listed) and every chunked row is checked against the single-chunk one.
"""
import argparse
import time

import torch

from relprop.engine.trace import BlockRecord
from relprop.methods import get_method
from relprop.methods.fold_maps import RowFold


def records(heads, n, blocks):
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(blocks):
        grad = torch.randn(1, heads, n, n, generator=g)
        if i == blocks - 1:
            grad.zero_()[..., -1, :] = 1
        a = torch.rand(1, heads, n, n, generator=g).tril()
        r = torch.randn(1, heads, n, n, generator=g)
        out.append(BlockRecord(index=i, name=f"b{i}", layer=f"l.{i}", attention=a, gradient=grad, relevance=r,
                               hidden=None, hidden_gradient=None, hidden_relevance=None))
    return out


def fold(recs, chunk_bytes):
    f = RowFold(get_method("transformer_attribution"), {}, len(recs), torch.ones(1, recs[0].attention.shape[-1]),
                None, None, chunk_bytes)
    t = time.perf_counter()
    for r in reversed(recs):
        f(r)
    row = f.result()["tokens"]
    return time.perf_counter() - t, row


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--blocks", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    torch.set_num_threads(1)
    recs = records(a.heads, a.tokens, a.blocks)
    sizes = (1 << 40, 16 << 20, 1 << 20)
    times = {s: [] for s in sizes}
    for _ in range(a.rounds):
        for s in sizes:
            t, row = fold(recs, s)
            times[s].append(t)
            if s == sizes[0]:
                ref = row
            torch.testing.assert_close(row, ref, rtol=1e-5, atol=1e-7)
    print(f"{a.blocks} blocks of {a.heads} heads x {a.tokens}^2, 1 thread "
          "(the block next to the output is never chunked)")
    for s, ts in times.items():
        label = "one chunk per block" if s == sizes[0] else f"chunks of {s >> 20} MiB of per-head maps"
        print(f"{label}: {min(ts):.3f} s (runs {', '.join(f'{t:.3f}' for t in ts)})")


if __name__ == "__main__":
    main()
