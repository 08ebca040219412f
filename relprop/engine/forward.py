"""The forward pass over a captured graph, and the relevance seed at its outputs.

:func:`forward` evaluates every node on the current parameters of the model (read by name at each
call, so a fine-tuned model is explained with its current weights); the relevance sources (pixels,
word embeddings) become leaves that require grad. :func:`output_seed` is the partial derivative of
the target score with respect to each output (CVPR 2021 §3.3: the one-hot of the target logit).
"""
from __future__ import annotations

import threading
from typing import Callable, Dict, List, Optional

import torch
import torch.fx
import torch.utils._pytree as pytree

from ..graph.capture import Captured
from ..graph.dispatch import saving_by_name
from ..graph.nodes import evaluate, output_leaves, output_values
from ..targets import require_input_dependence
from .memory import last_uses

#: counters the tests read: how many times the captured graph was evaluated (all or in part);
#: the only module-level state of the engine, updated under a lock (threads may explain at once)
STATS = {"forward": 0}
_STATS_LOCK = threading.Lock()


def count_forward() -> None:
    """Count one evaluation of the captured graph (:data:`STATS`)."""
    with _STATS_LOCK:
        STATS["forward"] += 1


def forward(captured: Captured, model, kwargs, *, perturb: Optional[Callable] = None,
            overrides: Optional[Dict[torch.fx.Node, torch.Tensor]] = None, env: Optional[dict] = None,
            only: Optional[set] = None, discard: Optional[set] = None):
    """Evaluate the captured graph; returns (env, outputs).

    ``perturb(value)`` replaces the value of the relevance source (pixels, or the word embeddings)
    before it is used; ``overrides`` replaces node values; with ``env`` and ``only`` given, only
    the nodes in ``only`` are re-evaluated (the rest are read from ``env``). The values of the
    nodes in ``discard`` leave ``env`` after their last use (autograd keeps what it saved of them;
    :func:`relprop.engine.memory.rematerializable`). Sources are made leaves that require grad.
    """
    a = captured.analysis
    count_forward()
    sources = set(a.sources)
    overrides = overrides or {}
    if env is None:
        env = captured.bind(model, kwargs)
        if a.primary in sources:
            v = env[a.primary]
            if perturb is not None:
                v = perturb(v)
            env[a.primary] = v.detach().requires_grad_(True)
        for s in a.sources:  # a second stream's float input (two-stream models)
            if s.op == "placeholder" and s is not a.primary:
                env[s] = env[s].detach().requires_grad_(True)
    else:
        env = env.copy()  # (a LazyEnv stays one: offloaded weights are read on demand)
    last = last_uses(captured) if discard else {}
    with saving_by_name(env):  # offloaded weights: autograd saves their names, not their values
        for node in captured.graph.nodes:
            if node.op != "call_function":
                continue
            if node in overrides:
                env[node] = overrides[node]
                continue
            if only is not None and node not in only:
                continue
            out = evaluate(node, env.__getitem__)
            if node in sources:
                if perturb is not None:
                    out = perturb(out)
                out = out.detach().requires_grad_(True)
            env[node] = out
            for m in last.get(node, ()):
                if m in discard:
                    env.pop(m, None)
    return env, output_values(captured.graph, captured.out_spec, env.__getitem__)


def output_seed(captured: Captured, env, score_fn, out_nodes: List[torch.fx.Node], with_scores: bool = False):
    """The relevance seed at each output: the partial derivative of the target score with respect to
    that output, the other outputs held fixed (CVPR 2021 §3.3: the one-hot of the target logit).

    It differs from the gradient at the output node when one output is computed from another
    (CLIP returns the image and text embeddings and the similarity logits computed from them):
    seeding the total gradient there would inject the relevance of the logits twice. Returns
    {node: seed}, or (scores, {node: seed}) with ``with_scores``.
    """
    leaves, values = [], []
    for n in output_leaves(captured.graph):
        v = env[n] if isinstance(n, torch.fx.Node) else n
        if isinstance(n, torch.fx.Node) and n in out_nodes and torch.is_tensor(v) and v.is_floating_point():
            v = v.detach().requires_grad_(True)
            leaves.append((n, v))
        values.append(v)
    if not leaves and not with_scores:
        return {}
    with torch.enable_grad():
        scores = score_fn(pytree.tree_unflatten(values, captured.out_spec))
        if with_scores:
            require_input_dependence(scores)
        grads = torch.autograd.grad(scores.sum(), [v for _, v in leaves], allow_unused=True)
    seed: Dict[torch.fx.Node, torch.Tensor] = {}
    for (n, v), g in zip(leaves, grads):
        g = torch.zeros_like(v) if g is None else g
        seed[n] = seed[n] + g if n in seed else g
    return (scores.detach(), seed) if with_scores else seed

