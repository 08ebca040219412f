"""``memory="low"``: the engine run segment by segment, one attention block at a time.

A forward pass without autograd keeps only the values that cross from one segment to the next;
then, from the output back, each segment is recomputed with autograd, its gradients taken and its
part of the relevance walk done, and its values freed. Same results as the default path (the
recomputed values are bit for bit the same; gradients are sums of the same terms in another order),
about one more forward pass of time.
"""
from __future__ import annotations

import functools
from typing import Any, Dict, List, Optional

import torch
import torch.fx

from ..graph.aliasing import shares_memory
from ..graph.attention_core import CHECKS
from ..graph.dispatch import saving_by_name
from ..graph.nodes import ancestors, evaluate
from ..graph.run_memo import once_per_run
from ..graph.tokens import token_positions
from . import chunked_core
from .chunked_walk import ChunkedCores, plan_cores
from .forward import forward, output_seed, relevance_seed
from .fused_segment import segment_walk
from .memory import crossing, last_uses, read_after_walk, rematerializable, segments
from .request import Request
from .trace import Pass
from .walk import Walker


@once_per_run()  # (each mask's key bounds and boolean tests read once per run)
def run_low(request: Request, schedule, out_nodes: List[torch.fx.Node], wrt: List[torch.fx.Node], remat,
            folder: Optional[Any] = None) -> Pass:
    """``memory="low"``: gradient checkpointing at the attention blocks, for the walk as well.

    1. A forward pass without autograd keeps only the values that cross segments
       (:func:`relprop.engine.memory.segments`, :func:`~relprop.engine.memory.crossing`): the
       hidden states between blocks, the masks the
       blocks share, the outputs.
    2. The target score's partial derivatives at the outputs start the backward pass.
    3. Segment by segment, from the output back: the segment is recomputed from its kept inputs
       with autograd on, the gradient arriving at its outgoing values is propagated through it
       (:func:`torch.autograd.grad` with ``grad_outputs``) to its incoming values and to the
       attention maps and hidden states it holds, the relevance walk visits its nodes with the
       same rules as the default path, and its values are freed (the block records excepted).

    Each recomputed value equals the one of the default path bit for bit (same ops on the same
    inputs); the gradients are sums of the same terms in another order. Costs one more forward
    pass; the peak holds the block records, the crossing values and one segment.

    ``folder`` (a folded run, :class:`relprop.engine.fold_hooks.BlockFolder`) is the walk's hooks
    (the walker calls its ``reached`` at each attention map, and it hands the block to the methods'
    folds) and is called after each segment (``after_segment``, which returns the nodes whose values
    and gradients it dropped): then the peak holds the crossing values and one segment. Where
    ``schedule.cores`` (:class:`relprop.engine.schedule.Schedule`) is set, such a run evaluates each
    row-local attention core in those chunks of query rows, forward, backward and in the walk
    (:mod:`relprop.engine.chunked_walk`): then no heads × tokens² tensor is held whole;
    ``schedule.fused_segment`` walks a segment's chunked core with its backward pass
    (:mod:`relprop.engine.fused_segment`), ``schedule.fused_forward`` evaluates the chunks of the
    forward pass with torch's fused attention kernel where it may.
    """
    captured = request.captured
    a = captured.analysis
    sources = set(a.sources)
    kept = crossing(captured)
    keep = kept | sources | {a.primary} | _token_trace_reads(a)
    chunks = schedule.cores
    planned = plan_cores(a) if folder is not None and chunks is not None else {}
    computed, skip = cores_in_the_forward(planned, keep, request.compute, chunks, schedule.fused_forward)
    discard = {n for n in captured.graph.nodes if n.op == "call_function" and n not in keep | set(computed)}
    with torch.no_grad():
        env, outputs = forward(captured, request.model, request.kwargs, discard=discard, compute=request.compute,
                               computed=computed, skip=skip)
    scores, seed = output_seed(captured, env, request.target.score, out_nodes, with_scores=True)
    with torch.no_grad():
        target = request.target.classes(outputs)
        tokens = token_positions(a.tokens, env, scores.shape[0])
    batch = scores.shape[0]
    # the gradients to record; outputs only where a block record reads them (hidden states that
    # the program also returns, e.g. output_hidden_states=True): their total gradient, the seed
    # and what the nodes reading them add
    records = {n for b in a.blocks for n in (b.attention, b.hidden, b.features) if n is not None}
    grad_nodes = set(wrt) - (set(out_nodes) - records)
    gbuf: Dict[torch.fx.Node, torch.Tensor] = dict(seed)  # gradient arriving at each crossing value
    grad: Dict[torch.fx.Node, torch.Tensor] = {}
    cores = {p: (c, b) for p, (c, b) in planned.items() if _rows_exceed_a_chunk(c, tokens, chunks)}
    known = {p: env[p] for p in cores if p in computed}  # A·V from the forward pass, as the segment would compute it
    for p in set(computed) - set(known):
        env.pop(p, None)
    steps = ChunkedCores(cores, grad, chunks, folder) if cores else None
    walker = None
    if schedule.relevance == "walk":  # (no memo of |W| here: memory="high" only)
        walker = Walker(request, env, relevance_seed(seed, env, request.preset.seed, request.target.rows), out_nodes,
                        batch, remat, hooks=folder, steps=steps)
    needed_later = read_after_walk(a)
    dropped: set = set()
    if folder is not None:
        folder.attach(env, grad, batch, walked=walker is not None, cores=steps, compute=request.compute)
    hooks = {p: (b.attention, folder.rows_hook(b)) for p, (_, b) in cores.items()} \
        if folder is not None and walker is None else {}
    for seg in reversed(segments(captured)):
        fused = segment_walk(seg, steps, walker, request.compute) if schedule.fused_segment else None
        backward_segment(captured, env, seg, gbuf, grad, grad_nodes, kept, request.compute, cores, known, hooks,
                         walk=fused, chunks=chunks)
        if walker is not None:
            with torch.no_grad():
                for node in reversed(seg if fused is None else fused.rest()):
                    walker.visit(node)
        if folder is not None:
            dropped |= folder.after_segment(seg)
        if walker is None:
            for node in seg:
                if node not in needed_later:
                    env.pop(node, None)
    for n in grad_nodes:  # placeholders (pixels, inputs_embeds): the sum over the segments reading them
        if n not in grad and n not in dropped:
            g = gbuf.get(n)
            grad[n] = g if g is not None else torch.zeros_like(env[n])
    if walker is None:
        return Pass(env, outputs, scores, target, grad, tokens=tokens)
    walked = walker.finish()
    return Pass(env, outputs, scores, target, grad, walked.relevance_at, walked.conservation, walked.input_relevance,
                tokens=tokens, stream_relevance=walked.stream_relevance)


def _token_trace_reads(a) -> set:
    """The values the token-position trace reads (kept by the forward pass without autograd)."""
    if a.tokens is None:
        return set()
    return {a.tokens.start} | set(a.tokens.reads)


def cores_in_the_forward(planned, keep, compute, chunks, fused: bool = False) -> tuple:
    """({A·V node: fn}, inner nodes): the row-local cores of ``planned``
    (:func:`relprop.engine.chunked_walk.plan_cores`) that the forward pass without autograd evaluates
    in ``chunks`` of query rows (:func:`relprop.engine.chunked_core.core_forward`; ``fused``: with torch's
    fused attention kernel where it may), so that it holds no heads × tokens² tensor either, and whose
    inner values it then never has (none of them is kept)."""
    computed, skip = {}, set()
    for product, (core, _) in planned.items():
        inner = set(core.nodes[:-1])
        inner |= {u for n in inner for u in n.users if u.target in CHECKS}
        if inner & keep:
            continue
        computed[product] = functools.partial(chunked_core.core_forward, core, chunks=chunks, compute=compute,
                                              fused=fused)
        skip |= inner
    return computed, frozenset(skip)


def _rows_exceed_a_chunk(core, tokens, chunks) -> bool:
    """Whether ``core``'s block has more query rows than one chunk of ``chunks`` on these inputs (its
    tokens as traced, else the captured size when it is a number): a core of one chunk is evaluated
    whole, as chunking it would only recompute it (unless ``chunks.small``)."""
    if chunks.small:
        return True
    rows = tokens.get(core.block)
    n = rows.shape[1] if rows is not None else core.queries
    return not isinstance(n, int) or n > chunks.rows


def backward_segment(captured, env, seg, gbuf, grad, grad_nodes, kept, compute=None, cores=None, known=None,
                      hooks=None, plan=None, walk=None, chunks=None):
    """Recompute one segment with autograd from its inputs in ``env``, propagate the gradients in
    ``gbuf`` (at its outgoing values) back to its incoming values (added to ``gbuf``) and to the
    nodes of ``grad_nodes`` it holds (into ``grad``); leave its values, detached, in ``env``.
    ``cores`` ({A·V node: (core, block)}): those cores are evaluated in chunks of query rows
    (:func:`relprop.engine.chunked_core.core_in_row_chunks`), their inner nodes get no value and
    no gradient, and the gradient at their output goes into ``grad``; their operands stay in
    ``env``. ``known`` ({A·V node: value}): a core's output as the forward pass computed it in the
    same chunks (not computed again); ``chunks``: the :class:`relprop.engine.chunked_core.RowChunks`
    of ``cores``; ``hooks`` ({A·V node: rows hook}): the rows hook of
    :func:`relprop.engine.chunked_core.core_in_row_chunks` for that core. ``plan``: a
    :class:`relprop.engine.fast_path.Plan` whose modified-gradient replacements the recomputation
    uses (the segmented fast path, :mod:`relprop.engine.fast_low`).

    ``walk`` (a :class:`relprop.engine.fused_segment.SegmentWalk`): its core's output is cut from
    autograd; the gradients are propagated to that output (and along the other paths) first, the
    segment's values put in ``env``, then ``walk(senv, grad)`` walks the segment down to the core and
    the core itself, computing the core's backward pass with the walk's chunks and returning the
    gradients at the core's operands, which are then propagated to the segment's inputs; then
    ``walk.done()``."""
    a = captured.analysis
    sources = set(a.sources)
    remat, last = rematerializable(captured), last_uses(captured)  # plans memoized on the graph
    senv: Dict[torch.fx.Node, Any] = {}
    leaves: List[torch.fx.Node] = []

    def val(n):
        if n in senv:
            return senv[n]
        v = env[n]
        if n in a.live and torch.is_tensor(v) and v.is_floating_point():
            v = v.detach().requires_grad_(True)
            leaves.append(n)
        elif n.op == "placeholder":
            return v  # a weight: read from env at each use (an offloaded one is fetched, then dropped)
        senv[n] = v
        return v

    fn_nodes = [n for n in seg if n.op == "call_function"]
    seg_cores = {p: c for p, (c, _) in (cores or {}).items() if p in set(fn_nodes)}
    inner = {n for c in seg_cores.values() for n in c.nodes[:-1]}
    inner |= {u for n in inner for u in n.users if u.target in CHECKS}  # metadata checks of inner values
    operands = {n for c in seg_cores.values() for n in c.rows + c.whole}
    if plan is not None:  # a subgraph explained as a whole reads its operands after its last node
        operands |= {m for n in seg if n in plan.functions for m in plan.functions[n][0]}
    fn_nodes = [n for n in fn_nodes if n not in inner]
    inside = set(fn_nodes)
    cut = walk.product if walk is not None else None
    with torch.enable_grad(), saving_by_name(env):  # offloaded weights: saved by name, not value
        for node in fn_nodes:
            core = seg_cores.get(node)
            if node is cut:  # A·V as the forward pass computed it, a leaf: the walk differentiates the core
                for m in core.rows + core.whole:
                    val(m)  # (each live operand a leaf or a value of the segment, to be differentiated)
                out = (known or {}).pop(node, None)
                if out is None:
                    out = chunked_core.core_forward(core, val, chunks, compute)
                out = out.detach().requires_grad_(True)
            elif core is not None:
                out = chunked_core.core_in_row_chunks(core, {n: val(n) for n in core.rows + core.whole},
                                                     chunks, compute, (known or {}).pop(node, None),
                                                     (hooks or {}).get(node), plan.replacements if plan else None)
            else:
                out = evaluate(node, val, plan.replacements.get(node) if plan else None, compute=compute)
                if plan is not None and node in plan.functions:  # a subgraph explained as a whole
                    args, call = plan.functions[node]
                    out = call(*(val(m) for m in args), out)
            if node in sources:
                out = out.detach().requires_grad_(True)
            senv[node] = out
            for m in last.get(node, ()):
                # (a value that is its operand, e.g. a where selecting one operand everywhere, keeps it)
                if m in inside and m in remat and m not in kept and m not in operands \
                        and not shares_memory(senv.get(m), out):
                    senv.pop(m, None)  # the walk computes it again (autograd keeps what it saved)
        roots = [n for n in fn_nodes if n in gbuf and torch.is_tensor(senv.get(n)) and senv[n].requires_grad]
        targets = list(leaves) + [n for n in fn_nodes if (n in grad_nodes or n in seg_cores) and n in senv
                                  and senv[n].requires_grad]
        targets = list(dict.fromkeys(targets))
        _propagate([senv[n] for n in roots], [gbuf[n] for n in roots], targets, senv, inside, gbuf, grad,
                   retain=cut is not None and _paths_meet(roots, seg_cores[cut], cut, (inside | inner) - sources, senv))
        for n in roots:
            del gbuf[n]
        if cut is not None:
            for n in fn_nodes:
                if n in senv:
                    v = senv[n]
                    env[n] = v.detach() if torch.is_tensor(v) else v
            with torch.no_grad():
                at_operands = walk(senv, grad)
            back = [n for n in at_operands if torch.is_tensor(senv.get(n)) and senv[n].requires_grad]
            _propagate([senv[n] for n in back], [at_operands[n] for n in back], [n for n in targets if n is not cut],
                       senv, inside, gbuf, grad)
            del at_operands
    for n in (grad_nodes | set(seg_cores)) & inside - {cut}:  # (the walk took the gradient at the cut)
        if n not in grad:
            grad[n] = torch.zeros_like(senv[n])
    if walk is not None:
        walk.done()
    if cut is None:
        for n in fn_nodes:
            if n in senv:
                v = senv[n]
                env[n] = v.detach() if torch.is_tensor(v) else v
    senv.clear()


def _paths_meet(roots, core, cut, inside, senv) -> bool:
    """Whether the segment's backward pass from its outputs ``roots`` to the cut core output ``cut``
    and its inputs, and the one from the core's operands on, may run a node of the segment's graph
    twice: a node that both the outputs depend on, other than through the core, and the operands
    depend on (a block whose feed-forward layer reads the attention's input, as parallel blocks
    do). Then the first pass keeps the graph (``retain_graph``); else it frees what it ran, as a
    plain backward pass does, and the peak holds no saved tensors of the part after the core while
    the core is walked. ``inside``: the segment's nodes, the inner nodes of its cores included (the
    paths through another core run through its operands), but the sources (leaves); a node on both
    paths whose value ``senv`` holds and is no tensor with a graph (a size) does not count."""
    after = ancestors([n for n in roots if n is not cut], inside - {cut})
    before = ancestors([n for n in core.rows + core.whole if n in inside], inside)

    def may_have_graph(n) -> bool:
        v = senv.get(n)
        return n not in senv or (torch.is_tensor(v) and v.requires_grad)
    return any(may_have_graph(n) for n in after & before)


def _propagate(outs, grads_out, targets, senv, inside, gbuf, grad, retain: bool = False) -> None:
    """Gradients ``grads_out`` at tensors ``outs`` taken back to the nodes ``targets`` (values in
    ``senv``): added into ``grad`` for the nodes ``inside`` the segment, into ``gbuf`` for the others
    (the segment's inputs, whose gradient the segments before it go on with)."""
    if not (outs and targets):
        return
    gs = torch.autograd.grad(outs, [senv[n] for n in targets], grad_outputs=grads_out, allow_unused=True,
                             retain_graph=retain)
    for n, g in zip(targets, gs):
        if g is None:
            continue
        if n in inside:
            grad[n] = grad[n] + g if n in grad else g
        else:
            gbuf[n] = gbuf[n] + g if n in gbuf else g
