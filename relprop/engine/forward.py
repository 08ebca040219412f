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
from ..graph.nodes import HALF_DTYPES, evaluate, output_leaves, output_values
from ..rules.stabilize import on_nonzero_rows
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
            only: Optional[set] = None, discard: Optional[set] = None, compute: Optional[torch.dtype] = None,
            computed: Optional[Dict[torch.fx.Node, Callable]] = None, skip: frozenset = frozenset()):
    """Evaluate the captured graph; returns (env, outputs).

    ``perturb(value)`` replaces the value of the relevance source (pixels, or the word embeddings)
    before it is used; ``overrides`` replaces node values; with ``env`` and ``only`` given, only
    the nodes in ``only`` are re-evaluated (the rest are read from ``env``). The values of the
    nodes in ``discard`` leave ``env`` after their last use (autograd keeps what it saved of them;
    :func:`relprop.engine.memory.rematerializable`). Sources are made leaves that require grad.
    ``compute`` (float32 for a half-precision model, :attr:`relprop.engine.request.Request.compute`)
    is the precision every node is evaluated in (:func:`relprop.graph.nodes.evaluate`).
    ``computed`` ({node: fn}) gives the value of those nodes as ``fn(value)`` (``value(n)``: the
    value of node ``n``) instead of evaluating their op, and the nodes of ``skip`` are not evaluated
    (only such functions read them: the attention cores of the row-chunked walk,
    :func:`relprop.engine.chunked_core.core_forward`).
    """
    a = captured.analysis
    count_forward()
    sources = set(a.sources)
    overrides = overrides or {}
    if env is None:
        env = bind(captured, model, kwargs, compute)
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
    pending: List[torch.fx.Node] = []  # values last read by a skipped node: freed after the next computed one
    with saving_by_name(env):  # offloaded weights: autograd saves their names, not their values
        for node in captured.graph.nodes:
            if node.op != "call_function":
                continue
            if node in overrides:
                env[node] = overrides[node]
                continue
            if node in skip:
                pending.extend(last.get(node, ()))
                continue
            if only is not None and node not in only:
                continue
            fn = computed.get(node) if computed else None
            out = fn(env.__getitem__) if fn is not None else evaluate(node, env.__getitem__, compute=compute)
            if node in sources:
                if perturb is not None:
                    out = perturb(out)
                out = out.detach().requires_grad_(True)
            env[node] = out
            freed = list(last.get(node, ()))
            if fn is not None:
                freed, pending = freed + pending, []
            for m in freed:
                if m in discard:
                    env.pop(m, None)
    return env, output_values(captured.graph, captured.out_spec, env.__getitem__)


def bind(captured: Captured, model, kwargs, compute: Optional[torch.dtype] = None) -> dict:
    """The placeholder values (:meth:`relprop.graph.capture.Captured.bind`), the model's inputs in
    ``compute`` precision when it is given (the weights stay as they are: :func:`evaluate` casts
    each where the graph reads it)."""
    env = captured.bind(model, kwargs)
    if compute is not None:
        for node, kind, _ in captured.bindings:
            v = env[node]
            if kind not in ("param", "buffer", "constant") and torch.is_tensor(v) and v.dtype in HALF_DTYPES:
                env[node] = v.to(compute)
    return env


def output_seed(captured: Captured, env, score_fn, out_nodes: List[torch.fx.Node], with_scores: bool = False,
                seed: str = "gradient", rows: Optional[int] = None):
    """The relevance seed at each output: the partial derivative of the target score with respect to
    that output, the other outputs held fixed (``seed="gradient"``, CVPR 2021 §3.3: the one-hot of
    the target logit), or that derivative times the output (``seed="score"``: the target logit's
    value, sign included, where relevance starts in Bach et al. 2015, Eq. 2, and AttnLRP; for a
    score linear in the outputs, such as a logit or a difference of logits, it sums to the score).
    The preset decides (:attr:`relprop.rules.Preset.seed`).

    It differs from the gradient at the output node when one output is computed from another
    (CLIP returns the image and text embeddings and the similarity logits computed from them):
    seeding the total gradient there would inject the relevance of the logits twice. Returns
    {node: seed}, or (scores, {node: seed}) with ``with_scores``. ``rows``: at most how many rows of an
    output the score reads (``Target.rows``).
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
    out: Dict[torch.fx.Node, torch.Tensor] = {}
    for (n, v), g in zip(leaves, grads):
        g = torch.zeros_like(v) if g is None else g
        out[n] = out[n] + g if n in out else g
    out = relevance_seed(out, env, seed, rows)
    return (scores.detach(), out) if with_scores else out


def relevance_seed(gradients: Dict[torch.fx.Node, torch.Tensor], env, seed: str,
                   rows: Optional[int] = None) -> Dict[torch.fx.Node, torch.Tensor]:
    """The relevance at each output from the score's partial derivatives there (:func:`output_seed`
    with ``seed="gradient"``): those derivatives themselves, or for ``seed="score"`` the derivatives
    times the outputs' values (:func:`times_output`; ``rows``: the target's bound on the rows they reach)."""
    if seed == "gradient":
        return gradients
    return {n: times_output(g, env[n].detach(), rows) for n, g in gradients.items()}


def times_output(gradient: torch.Tensor, output: torch.Tensor, rows: Optional[int] = None) -> torch.Tensor:
    """``gradient ⊙ output`` (the ``"score"`` seed), computed on the rows the gradient reaches only
    (a language model's vocabulary-sized logits are seeded at one position per sample: at most ``rows``)."""
    return on_nonzero_rows(lambda g, y: torch.where(g != 0, g * y, torch.zeros_like(g)), gradient, output,
                           bound=rows)

