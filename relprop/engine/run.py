"""``run(request)``: the forward pass, the gradients of the target, the relevance walk, the Trace.

One ``torch.autograd.grad`` call gives the gradient of the target score with respect to the model
outputs (the relevance seed: exactly the one-hot of the target class for an integer target), the
attention maps and the hidden states entering each block. The reverse walk
(:mod:`relprop.engine.walk`) then propagates relevance under the request's preset. Per attention
block the Trace records A, dA = ∂y_t/∂A, R_A, h and dh.
"""
from __future__ import annotations

from typing import List

import torch
import torch.fx
import torch.utils._pytree as pytree

from ..errors import RelpropError, warn
from ..graph.nodes import live_outputs
from ..graph.run_memo import once_per_run
from ..graph.tokens import token_positions
from ..graph.window_attention import globalize, locate_windows
from ..targets import find_logits, fixed, require_input_dependence
from .forward import forward, output_seed
from .low_memory import run_low
from .memory import rematerializable
from .request import Request
from .session import Session
from .stream_relevance import primary_parts, stream_masks
from .records import block_record, record
from .fold_hooks import FOLD_WINDOWS, BlockFolder, foldable
from .trace import NotKept, Pass, Trace
from .walk import Walker, check_rules, walk

WINDOWS_LOW_MEMORY = ("memory='low' does not segment window attention (Swin): its window bookkeeping reads every "
                      "block's forward values. Explaining with memory='default'.")


def gradient_nodes(analysis, out_nodes: List[torch.fx.Node], sources: bool = True) -> List[torch.fx.Node]:
    """The nodes whose gradient a run records: the outputs, each block's attention, hidden states
    and features, and (if ``sources``) the relevance sources."""
    a = analysis
    nodes = out_nodes + [b.attention for b in a.blocks] + [b.hidden for b in a.blocks if b.hidden is not None] \
        + [b.features for b in a.blocks if b.features is not None] + (list(a.sources) if sources else [])
    return list(dict.fromkeys(nodes))


@once_per_run()  # (facts about values many nodes share read once: relprop.graph.run_memo)
def run(request: Request) -> Trace:
    """Forward once, take the gradients of the target score, and (if ``request.relevance``) walk the
    graph back under ``request.preset``.

    ``memory="low"`` keeps only the values that cross segment boundaries (one segment per
    attention block) from a forward pass without autograd, then recomputes each segment, from the
    output back, for its gradients and its part of the walk (:func:`relprop.engine.low_memory.run_low`);
    same results. ``request.folds`` (or ``keep_records=False``) makes it the folded run: segmented, the
    attention cores in row chunks, each block's records handed to the folds (to none) and freed.
    """
    captured = request.captured
    a = captured.analysis
    notes = []
    if request.relevance:
        check_rules(captured, request.preset, request.unsupported)
    if request.memory == "low" and a.windows:
        warn(WINDOWS_LOW_MEMORY)
        notes.append(WINDOWS_LOW_MEMORY)
        request = request.but(memory="default")
    out_nodes = live_outputs(captured.graph, a.live)
    remat = rematerializable(captured)
    if request.folds or not request.keep_records:
        if not foldable(a):
            raise RelpropError(FOLD_WINDOWS)
        folder = BlockFolder(request)
        result = run_low(request, out_nodes, gradient_nodes(a, out_nodes), remat, folder)
        result.token_count = folder.token_count
        return build_trace(request, result, notes)
    if request.memory == "low":
        return build_trace(request, run_low(request, out_nodes, gradient_nodes(a, out_nodes), remat), notes)
    # without a method that reads Trace.input_gradient the gradient pass stops at the blocks
    wrt = gradient_nodes(a, out_nodes, sources=request.input_gradient)
    with torch.enable_grad():
        env, outputs = forward(captured, request.model, request.kwargs, discard=remat, compute=request.compute)
        scores = request.target.score(outputs)
        target = request.target.classes(outputs)
        require_input_dependence(scores)
        grads = torch.autograd.grad(scores.sum(), [env[n] for n in wrt], allow_unused=True)
        scores = scores.detach()
    grad = {n: (g if g is not None else torch.zeros_like(env[n])) for n, g in zip(wrt, grads)}
    del grads
    batch = scores.shape[0]
    result = Pass(env, outputs, scores, target, grad)
    result.windows = locate_windows(a, env, batch)  # window attention: read before the walk frees values
    result.tokens = token_positions(a.tokens, env, batch)
    if request.relevance:
        with torch.no_grad():
            seed = {**grad, **output_seed(captured, env, request.target.score, out_nodes,
                                          seed=request.preset.seed)}
            walked = walk(Walker(request, env, seed, out_nodes, batch, remat), captured.graph)
            result.rel_at, result.conservation = walked.relevance_at, walked.conservation
            result.input_relevance, result.stream_relevance = walked.input_relevance, walked.stream_relevance
    return build_trace(request, result, notes)


def build_trace(request: Request, result: Pass, notes: List[str]) -> Trace:
    """The block records and the Trace, from the values the walk kept
    (:func:`relprop.engine.memory.read_after_walk`)."""
    captured = request.captured
    a = captured.analysis
    env, grad, rel_at = result.env, result.grad, result.rel_at
    batch = result.scores.shape[0]
    if request.folds:  # a folded run: the folds read every block and its records are gone
        blocks, stages = NotKept("the per-block records (exp.blocks)", _names(request.folds)), None
        n_tok = result.token_count
    elif not request.keep_records:  # segmented with no fold: only the input relevance is read, as on the fast path
        blocks, stages, n_tok = [], None, result.token_count
    else:
        blocks = [block_record(b, env, grad, rel_at, batch) for b in a.blocks]
        blocks, stages = globalize(result.windows, blocks, batch)
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
                 token_maps=result.tokens, token_mixing=a.token_mixing, unmapped_blocks=a.unmapped,
                 streams=list(a.streams), merged=bool(a.merges), stream_relevance=result.stream_relevance,
                 stream_masks=stream_masks(a, request.kwargs, batch),
                 folded=[f.result() for f in request.folds])


def _names(folds) -> str:
    """The methods of a folded run's folds, for the message of :class:`NotKept`."""
    return ", ".join(dict.fromkeys(getattr(f, "name", type(f).__name__) for f in folds))
