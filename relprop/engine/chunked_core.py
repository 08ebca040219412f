"""An attention core evaluated in chunks of query rows, with autograd (step 2 of the row-chunked
walk; used by a segmented run whose schedule has ``cores``, :mod:`relprop.engine.chunked_walk`).

:func:`core_in_row_chunks` evaluates a block's row-local core (:func:`relprop.graph.attention_core.find_core`:
Q·Kᵀ, scale, mask, softmax, A·V) one chunk of query rows at a time and returns A·V; its backward
recomputes each chunk with autograd and gives the chunk's rows of ∇Q (and of any other split
operand) and its share of ∇Kᵀ and ∇V. Neither pass holds a heads × queries × keys tensor: the peak
of the core is one chunk's scores, softmax and their gradients (as memory-efficient attention
does), against the whole map A and ∇A of the unchunked core (CVPR 2021 Eq. 1–3 unchanged; only the
order of the sums of ∇Kᵀ and ∇V changes, over the chunks).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.fx

from ..graph.attention_core import AttentionCore, evaluate_rows
from ..graph.fused_attention import sdpa_form, sdpa_rows
from ..graph.key_bounds import key_bounds, rows_open


#: query rows per chunk of a row-chunked core: a segmented run's long-input path, where the whole cores'
#: heads x tokens^2 tensors are the peak; the chunked walk gives the same numbers to float rounding
ROW_CHUNK = 256
#: the most bytes a chunk's heads × rows × keys tensor may take on an accelerator: where the keys are
#: many, a chunk has fewer rows than ``rows`` (at least ``min_rows``). The recomputation of a chunk holds
#: about four such tensors (scores, softmax, their gradients) on top of what forward+backward holds:
#: 32 MiB is 128 rows of 8 heads × 8192 keys (256 rows gave 1.15× the peak of a fused forward+backward
#: pass there on an H200, 64 rows 1.04×).
CHUNK_BYTES = 32 * 2 ** 20
#: the same on the CPU: 16 MiB. glibc serves a block of at most 32 MiB (its largest mmap threshold)
#: from its heap once such blocks were freed, and reuses that memory; a 32 MiB tensor is a fresh mapping
#: the kernel faults in page by page at every chunk. At 4096 tokens (LLaMA-style, 8 heads, 1 thread)
#: ``transformer_attribution`` took 14.0–14.3 s with 16 MiB, 14.7–14.9 s with 32 MiB, 15.0 s with 8 MiB.
CPU_CHUNK_BYTES = 16 * 2 ** 20
MIN_ROWS = 16


@dataclasses.dataclass(frozen=True)
class RowChunks:
    """How a row-local attention core is cut into chunks of query rows (``Tuning(chunks=...)``; a field
    of the engine's schedule): ``rows`` per chunk, fewer where a chunk's batch × heads × rows × keys tensor
    would exceed ``bytes`` (``cpu_bytes`` on the CPU), but at least ``min_rows``. ``small``: also chunk a
    core whose query rows fit one chunk of ``rows`` (else it is evaluated whole, as chunking it would only
    recompute it). No chunk holds a heads × tokens² tensor: the long-input path's peak is one chunk's
    scores, softmax and their gradients (CVPR 2021 Eq. 1–3 unchanged, the sums over the chunks reordered)."""

    rows: int = ROW_CHUNK
    bytes: int = CHUNK_BYTES
    cpu_bytes: int = CPU_CHUNK_BYTES
    min_rows: int = MIN_ROWS
    small: bool = False

    def __post_init__(self):
        if not (isinstance(self.rows, int) and self.rows >= 1 and self.min_rows >= 1):
            raise ValueError(f"RowChunks: rows={self.rows!r} and min_rows={self.min_rows!r} must be ints >= 1")

    def rows_for(self, lead: int, keys: int, itemsize: int = 4, cpu: bool = False) -> int:
        """Rows per chunk of a core with ``lead`` (batch × heads) and ``keys`` keys (class docstring)."""
        limit = self.cpu_bytes if cpu else self.bytes
        return min(self.rows, max(self.min_rows, limit // max(1, lead * keys * itemsize)))


def row_chunks(queries: int, chunk: int) -> List[tuple]:
    """(lo, hi) of each chunk of ``chunk`` query rows (the last one shorter)."""
    return [(lo, min(lo + chunk, queries)) for lo in range(0, queries, max(1, chunk))]


def chunk_plan(core: AttentionCore, value: Callable[[torch.fx.Node], torch.Tensor], queries: int,
               chunks: RowChunks) -> List[tuple]:
    """(lo, hi, (kept keys, all keys)) of each chunk of query rows: ``chunks.rows`` rows or fewer
    (:meth:`RowChunks.rows_for`), and the keys each chunk attends to
    (:func:`relprop.graph.key_bounds.key_bounds`; on a causal decoder the keys before ``hi``), so
    that it is evaluated on those only. The forward pass, the backward pass and the walk of a core
    get the same chunks."""
    q = value(core.nodes[0].args[0])
    keys = value(core.nodes[0].args[1]).shape[-1]
    lead = max(1, q.numel() // max(1, q.shape[-1] * q.shape[-2])) if torch.is_tensor(q) and q.dim() >= 2 else 1
    itemsize = max(4, q.element_size()) if torch.is_tensor(q) else 4
    cpu = not torch.is_tensor(q) or q.device.type == "cpu"
    cut = row_chunks(queries, chunks.rows_for(lead, keys, itemsize, cpu))
    return [(lo, hi, (kept, keys)) for (lo, hi), kept in zip(cut, key_bounds(core, value, cut))]


def core_forward(core: AttentionCore, value: Callable[[torch.fx.Node], torch.Tensor], chunks: RowChunks,
                 compute: Optional[torch.dtype] = None, fused: bool = False) -> torch.Tensor:
    """A·V of ``core`` without autograd, in ``chunks`` of query rows (``value(n)``: the whole value
    of each operand): the forward pass of a segmented run evaluates the row-local cores so. With
    ``fused`` (:attr:`relprop.engine.schedule.Schedule.fused_forward`) a chunk
    of a core of the form softmax(Q·Kᵀ·s + M)·V whose every row has an open key is evaluated by
    :func:`torch.nn.functional.scaled_dot_product_attention` (:func:`relprop.graph.fused_attention.sdpa_rows`:
    the same values to float rounding, as the model's own SDPA computes them), the others node by node
    (then equal to the forward of :func:`core_in_row_chunks` bit for bit: the same chunks)."""
    queries = value(core.rows[0]).shape[-2]  # (the captured size may be another: sizes are dynamic)
    form = sdpa_form(core) if fused and compute is None else None
    with torch.no_grad():
        plan = chunk_plan(core, value, queries, chunks)
        fused = rows_open(core, value, [(lo, hi) for lo, hi, _ in plan]) if form is not None else [False] * len(plan)
        outs = []
        for (lo, hi, keys), fuse in zip(plan, fused):
            out = sdpa_rows(form, core, value, lo, hi, keys) if fuse else None
            if out is None:
                out = evaluate_rows(core, value, lo, hi, compute, keys=keys)[core.nodes[-1]]
            outs.append(out)
        return outs[0] if len(outs) == 1 else torch.cat(outs, -2)


class _CoreInRowChunks(torch.autograd.Function):
    @staticmethod
    def forward(ctx, core, nodes, chunks, compute, known, rows_hook, fns, *tensors):
        env = dict(zip(nodes, tensors))
        queries = env[core.rows[0]].shape[-2]  # (the captured size may be another: sizes are dynamic)
        ctx.core, ctx.nodes, ctx.chunks, ctx.compute, ctx.queries = core, nodes, chunks, compute, queries
        ctx.rows_hook, ctx.fns = rows_hook, fns
        ctx.save_for_backward(*tensors)
        if known is not None:  # the forward pass's own result (core_forward: the same chunks, the same values)
            return known if known._base is None else known.clone()
        return core_forward(core, env.__getitem__, chunks, compute)

    @staticmethod
    def backward(ctx, grad_out):
        core, nodes, tensors = ctx.core, ctx.nodes, ctx.saved_tensors
        split = set(core.rows)
        wants = [ctx.needs_input_grad[7 + i] for i in range(len(nodes))]
        grads: List[Optional[torch.Tensor]] = [None] * len(nodes)
        row_grads: Dict[int, List[torch.Tensor]] = {i: [] for i, n in enumerate(nodes) if wants[i] and n in split}
        env = dict(zip(nodes, tensors))
        for lo, hi, keys in chunk_plan(core, env.__getitem__, ctx.queries, ctx.chunks):
            with torch.enable_grad():
                leaves = {}
                for n, t in zip(nodes, tensors):
                    v = t[..., lo:hi, :] if n in split else t
                    leaves[n] = v.detach().requires_grad_(True) if t.is_floating_point() else v
                # (the keys are cut inside: the gradient of a whole operand keeps all its keys)
                vals = evaluate_rows(core, leaves.__getitem__, lo, hi, ctx.compute, sliced=True, fns=ctx.fns,
                                     keys=keys)
                out = vals[core.nodes[-1]]
                idx = [i for i in range(len(nodes)) if wants[i]]
                also = [vals[ctx.rows_hook[0]]] if ctx.rows_hook is not None else []
                gs = torch.autograd.grad(out, [leaves[nodes[i]] for i in idx] + also, grad_out[..., lo:hi, :],
                                         allow_unused=True)
                if also:  # A and dA on the chunk's rows, handed over (as chunked_walk.chunk_values gives them)
                    da = gs[-1] if gs[-1] is not None else torch.zeros_like(also[0])
                    attention, gs = also[0].detach(), gs[:-1]
                del vals, also
            if ctx.rows_hook is not None:
                ctx.rows_hook[1](lo, hi, ctx.queries, attention, da, keys[1])
                del attention, da
            for i, g in zip(idx, gs):
                if g is None:
                    g = torch.zeros_like(leaves[nodes[i]])
                if i in row_grads:
                    row_grads[i].append(g)
                else:
                    grads[i] = g if grads[i] is None else grads[i] + g
            del out, gs, leaves
        for i, parts in row_grads.items():
            grads[i] = torch.cat(parts, -2)
        return (None, None, None, None, None, None, None, *grads)


def core_in_row_chunks(core: AttentionCore, values: Dict[torch.fx.Node, torch.Tensor], chunks: RowChunks,
                       compute: Optional[torch.dtype] = None, known: Optional[torch.Tensor] = None,
                       rows_hook: Optional[tuple] = None, fns: Optional[dict] = None) -> torch.Tensor:
    """A·V of ``core`` from the whole values of its operands (``values``: each node of ``core.rows``
    and ``core.whole``), computed in ``chunks`` of query rows forward and backward (see the
    module docstring). Differentiable in every floating-point operand.

    ``known``: A·V as :func:`core_forward` gave it on these operands (then the forward is not
    computed again). ``rows_hook`` = (attention node, fn): the backward calls ``fn(lo, hi, queries,
    A, dA)`` with each chunk's attention map and its gradient ∂y/∂A (no grad), in row order, as it
    computes them anyway (a gradient-only folded run folds them there,
    :meth:`relprop.engine.fold_hooks.BlockFolder.rows_hook`). ``fns``: replacements of core nodes'
    ops in the backward's recomputation (the modified gradients of :mod:`relprop.engine.fast_path`:
    the chunks' backward then gives the modified gradient, :mod:`relprop.engine.fast_low`)."""
    nodes: Sequence[torch.fx.Node] = tuple(core.rows) + tuple(core.whole)
    return _CoreInRowChunks.apply(core, nodes, chunks, compute, known, rows_hook, fns, *(values[n] for n in nodes))
