"""The whole run: the forward pass with autograd, the gradients of the target, and the relevance walk
over the whole graph at once (a :class:`relprop.engine.schedule.Schedule` with ``segmented=False``).

One ``torch.autograd.grad`` call gives the gradient of the target score with respect to the model
outputs (the relevance seed: exactly the one-hot of the target class for an integer target), the
attention maps and the hidden states entering each block. The reverse walk
(:mod:`relprop.engine.walk`) then propagates relevance under the request's preset. Per attention
block the run keeps A, dA = ∂y_t/∂A, R_A, h and dh for the block records.
"""
from __future__ import annotations

from typing import List

import torch
import torch.fx

from ..graph.tokens import token_positions
from ..graph.window_attention import locate_windows
from ..targets import require_input_dependence
from .compiled_walk import compiled_walk
from .forward import forward, output_seed
from .request import Request
from .trace import Pass
from .walk import Walker, walk


def gradient_nodes(analysis, out_nodes: List[torch.fx.Node], sources: bool = True) -> List[torch.fx.Node]:
    """The nodes whose gradient a run records: the outputs, each block's attention, hidden states
    and features, and (if ``sources``) the relevance sources."""
    a = analysis
    nodes = out_nodes + [b.attention for b in a.blocks] + [b.hidden for b in a.blocks if b.hidden is not None] \
        + [b.features for b in a.blocks if b.features is not None] + (list(a.sources) if sources else [])
    return list(dict.fromkeys(nodes))


def run_whole(request: Request, schedule, out_nodes: List[torch.fx.Node], remat) -> Pass:
    """Forward once with autograd, take the gradients of the target score, and (``schedule.relevance ==
    "walk"``) walk the graph back under ``request.preset``; ``schedule.weight_memo`` keeps a memo of |W|
    with the captured graph (``memory="high"``)."""
    captured = request.captured
    a = captured.analysis
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
    if schedule.relevance == "walk":
        with torch.no_grad():
            seed = {**grad, **output_seed(captured, env, request.target.score, out_nodes,
                                          seed=request.preset.seed, rows=request.target.rows)}
            if schedule.compiled:  # the program of this input size (relprop.engine.compiled_walk)
                walked, note = compiled_walk(request, env, seed, out_nodes, batch, remat)
                if note is not None:
                    result.notes.append(note)
            else:
                walker = Walker(request, env, seed, out_nodes, batch, remat, weight_memo=schedule.weight_memo)
                walked = walk(walker, captured.graph)
            result.rel_at, result.conservation = walked.relevance_at, walked.conservation
            result.input_relevance, result.stream_relevance = walked.input_relevance, walked.stream_relevance
    return result
