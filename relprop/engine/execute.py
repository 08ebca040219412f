"""``execute(request, schedule)``: the engine's one entry point. It runs a
:class:`relprop.engine.schedule.Schedule` (made by :func:`relprop.engine.schedule.choose`) over the
request's captured graph and returns the :class:`relprop.engine.trace.Trace` the methods read.

==================  ===================================================================================
schedule            run
==================  ===================================================================================
gradient, whole     :func:`relprop.engine.fast_path.run_fast`: one forward, one modified backward pass
gradient, segmented :func:`relprop.engine.fast_low.run_fast_low`: the same segment by segment, the
                    attention cores in row chunks
walk/none, whole    :func:`relprop.engine.whole_run.run_whole`: forward, gradients, the whole walk
walk/none,          :func:`relprop.engine.low_memory.run_low`: segment by segment; with records folded
segmented           or dropped a :class:`relprop.engine.fold_hooks.BlockFolder` hands each block to the
                    folds (or to none) and frees it, and the cores may be walked in row chunks
==================  ===================================================================================
"""
from __future__ import annotations

from typing import List

import torch
import torch.utils._pytree as pytree

from ..errors import RelpropError, warn
from ..graph.nodes import live_outputs
from ..graph.run_memo import once_per_run
from ..graph.window_attention import globalize
from ..targets import find_logits, fixed
from .fast_low import run_fast_low
from .fast_path import run_fast
from .fold_hooks import FOLD_WINDOWS, BlockFolder, foldable
from .low_memory import run_low
from .memory import rematerializable
from .records import block_record, record
from .request import Request
from .schedule import WHOLE_WALK, Schedule, fit
from .session import Session
from .stream_relevance import primary_parts, stream_masks
from .trace import NotKept, Pass, Trace
from .walk import check_rules
from .whole_run import gradient_nodes, run_whole


@once_per_run()  # (facts about values many nodes share read once: relprop.graph.run_memo)
def execute(request: Request, schedule: Schedule = WHOLE_WALK) -> Trace:
    """Run ``schedule`` (default: the whole walk with every block's records) for ``request``: the
    forward pass, the gradients of the target score and, as the schedule says, the relevance by the
    rule-by-rule walk or by the preset's modified gradients, whole or segment by segment; the
    schedule's notes go to ``Trace.notes``, its warnings are raised as :class:`relprop.RelpropWarning`.

    A schedule with ``records="folded"`` hands every block's records to ``request.folds`` (each fold's
    ``result()`` in ``Trace.folded``) and keeps none; ``"dropped"`` keeps none (``Trace.blocks`` empty,
    as on the fast path). A segmented schedule on a graph whose window attention (Swin) it cannot
    segment runs whole, with a warning (:func:`relprop.engine.schedule.fit`)."""
    captured = request.captured
    a = captured.analysis
    schedule = fit(schedule, a)
    for w in schedule.warnings:
        warn(w)
    notes = list(schedule.notes)
    if schedule.relevance == "gradient":
        trace = run_fast_low(request, schedule) if schedule.segmented else run_fast(request)
        trace.notes.extend(notes)
        return trace
    if schedule.relevance == "walk":
        check_rules(captured, request.preset, request.unsupported)
    if (schedule.records == "folded") != bool(request.folds):
        raise RelpropError(f"a schedule with records={schedule.records!r} and {len(request.folds)} folds in the "
                           "request: the folds are the folded run's (a bug of the caller)")
    out_nodes = live_outputs(captured.graph, a.live)
    remat = rematerializable(captured)
    if schedule.records != "kept":
        if not foldable(a):
            raise RelpropError(FOLD_WINDOWS)
        folder = BlockFolder(request)
        result = run_low(request, schedule, out_nodes, gradient_nodes(a, out_nodes), remat, folder)
        result.token_count = folder.token_count
    elif schedule.segmented:
        result = run_low(request, schedule, out_nodes, gradient_nodes(a, out_nodes), remat)
    else:
        result = run_whole(request, schedule, out_nodes, remat)
    return build_trace(request, schedule, result, notes + result.notes)


def build_trace(request: Request, schedule: Schedule, result: Pass, notes: List[str]) -> Trace:
    """The block records and the Trace, from the values the walk kept
    (:func:`relprop.engine.memory.read_after_walk`)."""
    captured = request.captured
    a = captured.analysis
    env, grad, rel_at = result.env, result.grad, result.rel_at
    batch = result.scores.shape[0]
    unmapped = a.unmapped
    if schedule.records == "folded":  # a folded run: the folds read every block and its records are gone
        blocks, stages = NotKept("the per-block records (exp.blocks)", _names(request.folds)), None
        n_tok = result.token_count
    elif schedule.records == "dropped":  # no fold: only the input relevance is read, as on the fast path
        blocks, stages, n_tok = [], None, result.token_count
    else:
        blocks = [block_record(b, env, grad, rel_at, batch) for b in a.blocks]
        try:
            blocks, stages = globalize(result.windows, blocks, batch)
        except RelpropError as why:  # the methods that read the blocks as token maps refuse, with this reason
            stages, unmapped = None, f"attention on windows whose stages relprop cannot place on one grid ({why})"
        n_tok = blocks[0].attention.shape[-1] if blocks else None
    input_grad = None
    if a.sources and all(s in grad for s in a.sources):
        g = [grad[s] for s, _ in primary_parts(a, [(s, None) for s in a.sources])]
        input_grad = record(g[0]) if len(g) == 1 else record(torch.stack(g).sum(0))
    outputs = pytree.tree_map(lambda t: t.detach() if torch.is_tensor(t) else t, result.outputs)
    logits = find_logits(outputs)
    score = request.target.score if result.target is None else fixed(result.target, captured.primary).score
    session = Session(captured, request.model, request.kwargs, score,
                      env[a.sources[0]].detach() if a.sources else None, compute=request.compute)
    am = request.kwargs.get("attention_mask")
    if torch.is_tensor(am) and am.dim() == 2 and n_tok == am.shape[1]:
        token_mask = am.to(result.scores.device) != 0
    else:
        token_mask = torch.ones(batch, n_tok, dtype=torch.bool, device=result.scores.device) if n_tok else None
    return Trace(outputs=outputs, logits=logits, target=result.target, target_scores=result.scores.detach(),
                 blocks=blocks, input_relevance=result.input_relevance, input_gradient=input_grad,
                 conservation=result.conservation, modality=a.modality, grid=a.grid, batch_size=batch,
                 session=session, token_mask=token_mask, stages=stages, notes=notes, token_map=result.tokens.get(0),
                 token_maps=result.tokens, token_mixing=a.token_mixing, unmapped_blocks=unmapped,
                 streams=list(a.streams), merged=bool(a.merges), stream_relevance=result.stream_relevance,
                 stream_masks=stream_masks(a, request.kwargs, batch),
                 folded=[f.result() for f in request.folds])


def _names(folds) -> str:
    """The methods of a folded run's folds, for the message of :class:`NotKept`."""
    return ", ".join(dict.fromkeys(getattr(f, "name", type(f).__name__) for f in folds))
