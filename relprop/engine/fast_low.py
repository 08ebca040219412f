"""The fast path segment by segment (``memory="low"``): gradient checkpointing at the attention
blocks, and the attention cores in chunks of query rows.

The fast path (:mod:`relprop.engine.fast_path`) is one forward pass with autograd and one modified
backward pass: it holds every block's activations, and on the captured graph, which evaluates
attention unfused, every block's heads × tokens² maps. Here, as in ``memory="low"``
(:mod:`relprop.engine.low_memory`): a forward pass without autograd keeps only the values that
cross from one block to the next, then, from the output back, each segment is recomputed with
autograd under the preset's modified-gradient replacements, the modified gradient arriving at its
outgoing values is propagated through it, and its values are freed. Each row-local attention core
(:func:`relprop.graph.attention_core.find_core`) is evaluated in the schedule's chunks of query rows
(:attr:`relprop.engine.schedule.Schedule.cores`), forward and backward
(:func:`relprop.engine.chunked_core.core_in_row_chunks` with the replacements): AttnLRP's rules of
the core (Achtibat et al., ICML 2024, Eq. 8–13: the softmax, the bilinear products, the ε-rule's
stabilizer) are row-local, so a chunk's modified gradient is that of the whole core on its rows. The
input relevance is source ⊙ modified gradient, as on the fast path, to float rounding (the sums of
∇K and ∇V run over the chunks). Peak: the crossing values, one segment and one chunk's scores, as
LXT's gradient checkpointing with a memory-efficient attention kernel.
"""
from __future__ import annotations

from typing import Dict

import torch
import torch.fx

from ..graph.nodes import live_outputs
from ..rules.gradient_forms import rows_read
from ..graph.run_memo import once_per_run
from .chunked_walk import plan_cores
from .fast_path import FastPathUnavailable, fast_trace, injected_relevance, output_gradient, plan, run_fast
from .forward import forward, output_seed
from .low_memory import backward_segment, cores_in_the_forward
from .memory import crossing, segments
from .request import Request
from .trace import Trace


@once_per_run()  # (each mask's key bounds and boolean tests read once per run)
def run_fast_low(request: Request, schedule) -> Trace:
    """Input relevance under ``request.preset`` as :func:`relprop.engine.fast_path.run_fast` gives
    it, segment by segment with the attention cores in ``schedule.cores`` (module docstring). A model
    with window attention (Swin) takes :func:`~relprop.engine.fast_path.run_fast` (its windows are not
    segmented). Raises :class:`~relprop.engine.fast_path.FastPathUnavailable` as ``run_fast`` does."""
    captured, compute, chunks = request.captured, request.compute, schedule.cores
    p = plan(captured, request.preset, request.eps)
    a = captured.analysis
    if not a.sources:
        raise FastPathUnavailable("no relevance source (pixels or embedding lookup) in the graph")
    if a.windows:
        return run_fast(request)
    sources = set(a.sources)
    kept = crossing(captured)
    keep = kept | sources | {a.primary}
    # cores with a node explained as a whole (an element-wise function) are evaluated whole
    planned = {n: cb for n, cb in (plan_cores(a) if chunks is not None else {}).items()
               if not set(cb[0].nodes) & set(p.functions)}
    computed, skip = cores_in_the_forward(planned, keep, compute, chunks, schedule.fused_forward)
    discard = {n for n in captured.graph.nodes if n.op == "call_function" and n not in keep | set(computed)}
    with torch.no_grad():
        env, outputs = forward(captured, request.model, request.kwargs, discard=discard, compute=compute,
                               computed=computed, skip=skip)
    src_vals = [env[s] for s in a.sources]
    if any(v.dtype in (torch.float16, torch.bfloat16) for v in src_vals):
        raise FastPathUnavailable("half-precision activations: the interpreter accumulates relevance in float32")
    out_nodes = live_outputs(captured.graph, a.live)
    scores, seeds = output_seed(captured, env, request.target.score, out_nodes, with_scores=True)
    with torch.no_grad():
        target = request.target.classes(outputs)
    gbuf: Dict[torch.fx.Node, torch.Tensor] = {n: output_gradient(s, env[n], request.preset.seed, request.target.rows)
                                               for n, s in seeds.items()}
    cores = {n: cb for n, cb in planned.items() if n in computed}
    known = {n: env[n] for n in cores}  # A·V from the forward pass, in the chunks the segments use
    grad: Dict[torch.fx.Node, torch.Tensor] = {}
    for seg in reversed(segments(captured)):
        with rows_read(request.target.rows):  # (a language model's head: the rows the target reads)
            backward_segment(captured, env, seg, gbuf, grad, sources, kept, compute, cores, known, None, p,
                             chunks=chunks)
        for n in cores:
            grad.pop(n, None)  # (the gradient at a core's output: only the row-chunked walk reads it)
        for node in seg:
            if node not in keep:
                env.pop(node, None)
    grads = []
    for s in a.sources:  # placeholders (pixels): the sum over the segments reading them
        g = grad.get(s)
        grads.append(g if g is not None else gbuf.get(s))
    injected = injected_relevance(a, seeds, env, request.preset.seed, scores.shape[0])
    return fast_trace(request, outputs, scores, target, src_vals, grads, injected)
