"""The fast path: a preset's rules as one modified-gradient backward pass over the captured graph.

When every rule on the relevance path has a gradient form (:mod:`relprop.rules.gradient_forms`),
LRP is Input × (modified) Gradient: the captured graph is evaluated once with the ops whose rule
is not their own gradient swapped for autograd functions whose backward implements the rule
(identity rule on element-wise non-linearities, detached normalization statistics, halved
gradients for bilinear products), the target's relevance is turned into an output gradient
(g = R / y: the seed divided by the output, so that y ⊙ g = R), and one ``torch.autograd.grad``
gives the gradient at the relevance sources; relevance = source ⊙ gradient. The ε-rule nodes
multiply the gradient reaching them by z / (z + ε·sign z), the stabilizer the interpreter applies
there (:func:`relprop.rules.gradient_forms.epsilon_stabilized`), so this equals the rule-by-rule
walk of :mod:`relprop.engine.walk` (the reference) to float rounding, whatever ``eps``, at the
cost of about one forward and one backward pass (Achtibat et al., ICML 2024,
§3.3; Arras et al. 2025). What it does not give: per-block records (A, dA, R_A, ...), the
itemized absorbed relevance (``Trace.conservation`` is None) and the unmodified input gradient.
:func:`relprop.explain` uses it for methods that only read the input relevance (``"lrp"``) under a
preset that has gradient forms (``"attnlrp"``, ``"cp_lrp"``), unless ``fast_path=False``.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Callable, Dict, Optional, Union

import torch
import torch.fx
import torch.utils._pytree as pytree

from ..errors import RelpropError
from ..graph.capture import Captured
from ..graph.dispatch import saving_by_name
from ..graph.nodes import evaluate, is_live, live_outputs, module_path, output_leaves, relevance_path
from ..graph.run_memo import once_per_run
from ..rules import rule_registry as registry
from ..rules.gradient_forms import rows_read
from ..rules.pa_lrp import is_positional
from ..rules.rule_registry import Preset
from ..rules.stabilize import on_nonzero_rows, promote, relevance_dtype, safe_divide
from ..targets import find_logits, fixed, require_input_dependence
from .forward import bind, count_forward
from .ledger import sample_sum
from .node_rules import rule_finder
from .request import Request
from .session import Session
from .stream_relevance import per_stream, primary_parts, stream_masks
from .trace import Trace


class FastPathUnavailable(RelpropError):
    """The preset cannot be run as a modified gradient on this graph (the reason says why);
    :func:`relprop.explain` then uses the interpreter."""


@dataclasses.dataclass
class Plan:
    """Which nodes of a captured graph run as modified-gradient replacements, for one preset."""

    preset: str
    eps: float
    replacements: Dict[torch.fx.Node, Callable]
    #: outputs of subgraphs explained as a whole (element-wise functions): node -> (operand nodes,
    #: ``call(*operand values, output) -> output`` with the rule's backward)
    functions: Dict[torch.fx.Node, tuple] = dataclasses.field(default_factory=dict)


def plan(captured: Captured, preset: Union[str, Preset], eps: float) -> Plan:
    """The replacement of every node on the relevance path whose rule is not its own gradient.

    Follows the relevance path of :func:`relprop.graph.nodes.relevance_path` (a rule's
    ``no_relevance_to`` positions are not followed). Raises :class:`FastPathUnavailable` naming the
    first op whose rule has no gradient form. Cached on ``captured`` per (preset, eps, rules seen).
    ``preset``: the :class:`relprop.rules.Preset` of the request (a name, from a direct caller, is
    resolved here).
    """
    preset = registry.get_preset(preset)
    cache = captured.plans.setdefault("modified_gradient", {})
    key = (preset.name, eps, registry.state(preset))
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


def _plan(captured: Captured, preset: Preset, eps: float) -> Plan:
    if is_positional(preset):
        raise FastPathUnavailable(f"preset '{preset.name}' reassigns the relevance of position encodings to the "
                                  "tokens, which the rule-by-rule walk does")
    a = captured.analysis
    rule_of = rule_finder(captured, preset)
    replacements, functions = {}, {}
    for node in relevance_path(captured.graph, a.live, a.sources, rule_of):
        if node in a.sources or node.op != "call_function" or node.target is operator.getitem:
            continue
        spec = rule_of(node)
        if spec is None:
            raise FastPathUnavailable(f"no rule for {node.target} (in '{module_path(node)}') in preset '{preset.name}'")
        if spec in _ADJOINT_RULES:  # routing rules give relevance exactly as the gradient does
            continue
        form = spec.gradient_form
        if form is None:
            raise FastPathUnavailable(f"the rule {spec.name} of {node.target} (in '{module_path(node)}') in "
                                      f"preset '{preset.name}' has no gradient form")
        operands = spec.operands
        if operands is not None:  # a subgraph explained as a whole: its output from its operands and itself
            functions[node] = (operands, form(node, tuple(is_live(x, a.live) for x in operands), eps))
            continue
        rep = form(node, tuple(is_live(x, a.live) for x in node.args), eps)
        if rep is not None:
            replacements[node] = rep
    return Plan(preset.name, eps, replacements, functions)


def _gradient_seed(seed: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The output gradient R / y for the ``"gradient"`` seed R = ∂s/∂y."""
    return safe_divide(seed, y, 0.0)


def _score_seed(seed: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The output gradient R / y for the ``"score"`` seed R = y ⊙ ∂s/∂y: ∂s/∂y, 0 where y = 0."""
    return torch.where(y != 0, seed, torch.zeros_like(seed))


def supports(captured: Captured, preset: Union[str, Preset], eps: float) -> Optional[str]:
    """None if ``preset`` runs as a modified gradient on ``captured``; else the reason it does not."""
    try:
        plan(captured, preset, eps)
    except FastPathUnavailable as e:
        return str(e)
    return None


@once_per_run()  # (facts about values many nodes share read once: relprop.graph.run_memo)
def run_fast(request: Request) -> Trace:
    """Input relevance under ``request.preset`` with one forward and one (modified) backward pass.

    Returns a :class:`relprop.engine.trace.Trace` with ``input_relevance`` set (pixels
    [batch, C, H, W]; text: the word embeddings' relevance summed over the embedding size), no
    blocks, ``conservation=None`` and ``input_gradient=None``. Raises
    :class:`FastPathUnavailable` when the preset has no gradient form for some op of the graph or
    the activations are in half precision (relevance accumulates in float32 at least).
    """
    captured, eps = request.captured, request.eps
    p = plan(captured, request.preset, eps)
    a = captured.analysis
    if not a.sources:
        raise FastPathUnavailable("no relevance source (pixels or embedding lookup) in the graph")
    sources = set(a.sources)
    count_forward()
    with torch.enable_grad():
        compute = request.compute
        env = bind(captured, request.model, request.kwargs, compute)
        if a.primary in sources:
            env[a.primary] = env[a.primary].detach().requires_grad_(True)
        for s in a.sources:  # a second stream's float input (two-stream models)
            if s.op == "placeholder" and s is not a.primary:
                env[s] = env[s].detach().requires_grad_(True)
        # (the rows the target reads, for the backward of a language model's head: rows_read)
        with saving_by_name(env), rows_read(request.target.rows):
            for node in captured.graph.nodes:
                if node.op != "call_function":
                    continue
                out = evaluate(node, env.__getitem__, p.replacements.get(node), compute=compute)
                if node in p.functions:
                    operands, call = p.functions[node]
                    out = call(*(env[m] for m in operands), out)
                if node in sources:
                    out = out.detach().requires_grad_(True)
                env[node] = out
        src_vals = [env[s] for s in a.sources]
        if any(v.dtype in (torch.float16, torch.bfloat16) for v in src_vals):
            raise FastPathUnavailable("half-precision activations: the interpreter accumulates relevance in float32")
        out_nodes = live_outputs(captured.graph, a.live)
        # the seed: d score / d output on detached copies (cheap: nothing of the network is traversed)
        leaves = {n: env[n].detach().requires_grad_(True) for n in out_nodes}
        flat_vals = [leaves.get(n, env[n]) if isinstance(n, torch.fx.Node) else n
                     for n in output_leaves(captured.graph)]
        outputs = pytree.tree_unflatten(flat_vals, captured.out_spec)
        scores = request.target.score(outputs)
        target = request.target.classes(outputs)
        require_input_dependence(scores)
        seeds = torch.autograd.grad(scores.sum(), [leaves[n] for n in out_nodes], allow_unused=True)
        roots, grad_outputs = [], []
        for n, seed in zip(out_nodes, seeds):
            if seed is None:
                continue
            roots.append(env[n])
            grad_outputs.append(output_gradient(seed, env[n], request.preset.seed, request.target.rows))
        grads = torch.autograd.grad(roots, src_vals, grad_outputs, allow_unused=True)
    injected = injected_relevance(a, {n: s for n, s in zip(out_nodes, seeds) if s is not None}, env,
                                  request.preset.seed, scores.shape[0])
    return fast_trace(request, outputs, scores, target, src_vals, grads, injected)


def injected_relevance(analysis, seeds, env, kind: str, batch: int) -> torch.Tensor:
    """[batch]: the relevance the seeds start with, per sample (what the rule walk's ledger books as
    injected): Σ ∂s/∂y under the ``"gradient"`` seed, Σ y ⊙ ∂s/∂y under ``"score"``
    (:func:`output_gradient`)."""
    total = None
    for n, seed in seeds.items():
        r = seed.detach() * env[n].detach() if kind == "score" else seed.detach()
        r = sample_sum(r, analysis.batch_dim.get(n), batch)
        total = r if total is None else total + r
    return total


def output_gradient(seed: torch.Tensor, y: torch.Tensor, kind: str, rows=None) -> torch.Tensor:
    """The gradient that starts the modified backward pass at output ``y``, from ``seed`` = ∂s/∂y:
    exact R / y (the ε of the ε-rule enters at each ε-rule node, as in the interpreter), on the rows
    the seed reaches (a decoder's logits are seeded at one position; ``rows``: at most how many, the
    target's); with the ``"score"`` seed (``kind``, :attr:`relprop.rules.Preset.seed`) R = y ⊙ ∂s/∂y,
    so R / y is the derivative itself where y ≠ 0."""
    fn = _score_seed if kind == "score" else _gradient_seed
    return on_nonzero_rows(fn, seed, y.detach(), bound=rows).to(y.dtype)


def fast_trace(request: Request, outputs, scores, target, src_vals, grads, injected=None) -> Trace:
    """The :class:`relprop.engine.trace.Trace` of a fast-path run from the sources' values
    ``src_vals`` and their modified gradients ``grads`` (relevance = source ⊙ gradient); ``injected``:
    the seeds' relevance per sample (:func:`injected_relevance`)."""
    captured, compute = request.captured, request.compute
    a = captured.analysis
    batch = scores.shape[0]
    input_rel = None
    parts = [(s, promote(v.detach() * g) if g is not None else torch.zeros(v.shape, dtype=relevance_dtype(v.dtype),
                                                                          device=v.device))
             for s, v, g in zip(a.sources, src_vals, grads)]
    for _, r in primary_parts(a, parts):
        if a.modality == "text":
            r = r.sum(-1)
        input_rel = r if input_rel is None else input_rel + r
    outputs_d = pytree.tree_map(lambda t: t.detach() if torch.is_tensor(t) else t, outputs)
    score = request.target.score if target is None else fixed(target, captured.primary).score
    session = Session(captured, request.model, request.kwargs, score, src_vals[0].detach(), compute=compute)
    return Trace(outputs=outputs_d, logits=find_logits(outputs_d), target=target,
                 target_scores=scores.detach(), blocks=[], input_relevance=input_rel, input_gradient=None,
                 conservation=None, modality=a.modality, grid=a.grid, batch_size=batch, session=session,
                 token_mask=None, streams=list(a.streams), merged=bool(a.merges), stream_relevance=per_stream(a, parts),
                 stream_masks=stream_masks(a, request.kwargs, batch), injected=injected)
