"""The fast path: a preset's rules as one modified-gradient backward pass over the captured graph.

When every rule on the relevance path has a gradient form (:mod:`relprop.rules.gradient_forms`),
LRP is Input × (modified) Gradient: the captured graph is evaluated once with the ops whose rule
is not their own gradient swapped for autograd functions whose backward implements the rule
(identity rule on element-wise non-linearities, detached normalization statistics, halved
gradients for bilinear products), the target's relevance is turned into an output gradient
(g = R / y: the seed divided by the output, so that y ⊙ g = R), and one ``torch.autograd.grad``
gives the gradient at the relevance sources; relevance = source ⊙ gradient. This equals the
rule-by-rule walk of :mod:`relprop.graph.interpreter` (the reference) up to the ε of the
denominators, at the cost of about one forward and one backward pass (Achtibat et al., ICML 2024,
§3.3; Arras et al. 2025). What it does not give: per-block records (A, dA, R_A, ...), the
itemized absorbed relevance (``Trace.conservation`` is None) and the unmodified input gradient.
:func:`relprop.explain` uses it for methods that only read the input relevance (``"lrp"``) under a
preset that has gradient forms (``"attnlrp"``, ``"cp_lrp"``), unless ``fast_path=False``.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Any, Callable, Dict, Optional

import torch
import torch.fx
import torch.utils._pytree as pytree

from ..errors import RelpropError
from ..rules import registry
from ..rules.context import module_path
from ..rules.stabilize import safe_divide
from .capture import Captured
from .interpreter import _STATS_LOCK, STATS, Session, Trace, _fixed_scores, _liveness, _logits, bind_values


class FastPathUnavailable(RelpropError):
    """The preset cannot be run as a modified gradient on this graph (the reason says why);
    :func:`relprop.explain` then uses the interpreter."""


@dataclasses.dataclass
class Plan:
    """Which nodes of a captured graph run as modified-gradient replacements, for one preset."""

    preset: str
    eps: float
    replacements: Dict[torch.fx.Node, Callable]


def plan(captured: Captured, preset: str, eps: float) -> Plan:
    """The replacement of every node on the relevance path whose rule is not its own gradient.

    Follows the same argument positions as :func:`relprop.graph.interpreter.check_rules` (a rule's
    ``no_relevance_to`` positions are not followed). Raises :class:`FastPathUnavailable` naming the
    first op whose rule has no gradient form. Cached on ``captured`` per (preset, eps).
    """
    cache = captured.__dict__.setdefault("_modified_gradient_plans", {})
    key = (preset, eps, _registry_state(preset))
    if key not in cache:
        try:
            cache[key] = _plan(captured, preset, eps)
        except FastPathUnavailable as e:
            cache[key] = e
    if isinstance(cache[key], FastPathUnavailable):
        raise cache[key]
    return cache[key]


#: the shape-only routing rules of ``"base"`` as relprop defines them: their rule is the adjoint of
#: the op's index map, i.e. its gradient (a rule registered later, by a user, is not assumed to be)
_ADJOINT_RULES = frozenset(registry.get_preset("base").rules.values())


def _registry_state(preset: str) -> tuple:
    """A fingerprint of the rules ``preset`` sees (registering a rule invalidates cached plans)."""
    state, todo = [], [preset]
    while todo:
        p = registry.get_preset(todo.pop())
        state.append((p.name, len(p.rules), tuple(id(f) for f in p.rules.values())))
        todo.extend(p.parents)
    return tuple(state)


def _plan(captured: Captured, preset: str, eps: float) -> Plan:
    a = captured.analysis
    out_node = next(n for n in captured.graph.nodes if n.op == "output")
    stack = [n for n in pytree.tree_leaves(out_node.args[0]) if isinstance(n, torch.fx.Node) and n in a.live]
    seen, replacements = set(), {}
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node in a.sources or node.op != "call_function":
            continue
        if node.target is operator.getitem:
            stack.append(node.args[0])
            continue
        fn = registry.lookup(preset, node.target)
        if fn is None:
            raise FastPathUnavailable(f"no rule for {node.target} (in '{module_path(node)}') in preset '{preset}'")
        if fn not in _ADJOINT_RULES:  # routing rules give relevance exactly as the gradient does
            form = getattr(fn, "gradient_form", None)
            if form is None:
                raise FastPathUnavailable(f"the rule {fn.__name__} of {node.target} (in '{module_path(node)}') in "
                                          f"preset '{preset}' has no gradient form")
            live = tuple(_liveness(x, a.live) for x in node.args)
            rep = form(node, live, eps)
            if rep is not None:
                replacements[node] = rep
        blocked = getattr(fn, "no_relevance_to", ())
        for i, arg in enumerate(node.args):
            if i in blocked:
                continue
            for m in pytree.tree_leaves(arg):
                if isinstance(m, torch.fx.Node) and m in a.live:
                    stack.append(m)
    return Plan(preset, eps, replacements)


def supports(captured: Captured, preset: str, eps: float) -> Optional[str]:
    """None if ``preset`` runs as a modified gradient on ``captured``; else the reason it does not."""
    try:
        plan(captured, preset, eps)
    except FastPathUnavailable as e:
        return str(e)
    return None


def run_fast(captured: Captured, model: torch.nn.Module, kwargs: Dict[str, Any],
             score_fn: Callable[[Any], torch.Tensor], *, preset: str, eps: float,
             target_of: Optional[Callable[[Any], Optional[torch.Tensor]]] = None) -> Trace:
    """Input relevance under ``preset`` with one forward and one (modified) backward pass.

    Returns a :class:`relprop.graph.interpreter.Trace` with ``input_relevance`` set (pixels
    [batch, C, H, W]; text: the word embeddings' relevance summed over the embedding size), no
    blocks, ``conservation=None`` and ``input_gradient=None``. Raises
    :class:`FastPathUnavailable` when the preset has no gradient form for some op of the graph or
    the activations are in half precision (relevance must accumulate in float32: DESIGN §2).
    """
    p = plan(captured, preset, eps)
    a = captured.analysis
    if not a.sources:
        raise FastPathUnavailable("no relevance source (pixels or embedding lookup) in the graph")
    sources = set(a.sources)
    with _STATS_LOCK:
        STATS["forward"] += 1
    with torch.enable_grad():
        env = bind_values(captured, model, kwargs)
        if a.primary in sources:
            env[a.primary] = env[a.primary].detach().requires_grad_(True)
        for node in captured.graph.nodes:
            if node.op != "call_function":
                continue
            args, kw = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: env[n])
            out = p.replacements.get(node, node.target)(*args, **kw)
            if node in sources:
                out = out.detach().requires_grad_(True)
            env[node] = out
        src_vals = [env[s] for s in a.sources]
        if any(v.dtype in (torch.float16, torch.bfloat16) for v in src_vals):
            raise FastPathUnavailable("half-precision activations: the interpreter accumulates relevance in float32")
        out_node = next(n for n in captured.graph.nodes if n.op == "output")
        flat_nodes = pytree.tree_leaves(out_node.args[0])
        out_nodes = list(dict.fromkeys(n for n in flat_nodes if isinstance(n, torch.fx.Node) and n in a.live))
        # the seed: d score / d output on detached copies (cheap: nothing of the network is traversed)
        leaves = {n: env[n].detach().requires_grad_(True) for n in out_nodes}
        flat_vals = [leaves.get(n, env[n]) if isinstance(n, torch.fx.Node) else n for n in flat_nodes]
        outputs = pytree.tree_unflatten(flat_vals, captured.out_spec)
        scores = score_fn(outputs)
        target = target_of(outputs) if target_of is not None else None
        if not scores.requires_grad:
            raise RuntimeError("the target score does not depend on the input; nothing to explain")
        seeds = torch.autograd.grad(scores.sum(), [leaves[n] for n in out_nodes], allow_unused=True)
        roots, grad_outputs = [], []
        for n, seed in zip(out_nodes, seeds):
            if seed is None:
                continue
            roots.append(env[n])
            grad_outputs.append(safe_divide(seed, env[n].detach(), eps).to(env[n].dtype))
        grads = torch.autograd.grad(roots, src_vals, grad_outputs, allow_unused=True)
    batch = scores.shape[0]
    input_rel = None
    for s, v, g in zip(a.sources, src_vals, grads):
        r = (v.detach() * g).float() if g is not None else torch.zeros(v.shape, device=v.device)
        if a.modality == "text":
            r = r.sum(-1)
        input_rel = r if input_rel is None else input_rel + r
    outputs_d = pytree.tree_map(lambda t: t.detach() if torch.is_tensor(t) else t, outputs)
    logits = _logits(outputs_d)
    session = Session(captured, model, kwargs, score_fn if target is None else _fixed_scores(target),
                      src_vals[0].detach())
    return Trace(outputs=outputs_d, logits=logits, target=target, target_scores=scores.detach(), blocks=[],
                 input_relevance=input_rel, input_gradient=None, conservation=None, modality=a.modality,
                 grid=a.grid, batch_size=batch, session=session, token_mask=None)
