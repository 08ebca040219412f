"""Run a captured graph forward once, then walk it backward propagating relevance and gradients.

The forward pass evaluates every node on the current parameters of the model (read by name at
each call, so a fine-tuned model is explained with its current weights) and keeps the values the
rules and methods need. One ``torch.autograd.grad`` call then gives the gradient of the target
score with respect to the model outputs (the relevance seed: exactly the one-hot of the target
class for an integer target), the attention maps and the hidden states entering each block. The
reverse walk visits the nodes in reverse topological order; each node's relevance is complete when
it is reached, its preset's rule splits it among the node's arguments, and relevance given to
constants is booked as absorbed, per sample. Per attention block it records A, dA = ∂y_t/∂A,
R_A, h and dh (DESIGN §2, "the interpreter").
"""
from __future__ import annotations

import dataclasses
import operator
import threading
import warnings
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.fx
import torch.utils._pytree as pytree

from ..errors import UnsupportedOperation
from ..rules import registry
from ..rules.context import RuleContext, module_path, module_paths, module_type
from ..rules.generic import gradient_times_input
from ..rules.stabilize import DEFAULT_EPS
from .capture import Captured

aten = torch.ops.aten


@dataclasses.dataclass
class BlockRecord:
    """What one attention block contributed, for target t (shapes [batch, heads, tokens, tokens]
    for the attention tensors and [batch, tokens, hidden] for the hidden states)."""

    index: int
    name: str
    layer: str
    attention: torch.Tensor  # A
    gradient: torch.Tensor  # dA = d y_t / d A
    relevance: Optional[torch.Tensor]  # R_A (None when only gradients were asked for)
    hidden: Optional[torch.Tensor]  # h, the hidden states entering the block
    hidden_gradient: Optional[torch.Tensor]  # dh
    hidden_relevance: Optional[torch.Tensor]  # R_h
    value: Optional[torch.Tensor] = None  # V [batch, heads, tokens, head_dim]
    features: Optional[torch.Tensor] = None  # token features entering the attention (LN1(h) or h)
    features_gradient: Optional[torch.Tensor] = None
    out_proj_weight: Optional[torch.Tensor] = None  # W_O [hidden, heads * head_dim]


@dataclasses.dataclass
class BlockConservation:
    name: str
    relevance_in: torch.Tensor  # [batch] entering the block from the output side
    relevance_out: torch.Tensor  # [batch] leaving it at the block input h
    absorbed: torch.Tensor  # [batch] absorbed by constants inside the block

    @property
    def error(self) -> torch.Tensor:
        """Relative conservation error per sample: |in - out - absorbed| / |in|."""
        return (self.relevance_in - self.relevance_out - self.absorbed).abs() / self.relevance_in.abs().clamp_min(1e-12)


@dataclasses.dataclass
class Conservation:
    """Relevance bookkeeping per sample (DESIGN §3, "Conservation").

    ``injected`` (at the output) = ``input`` (reached the pixels / token embeddings)
    + ``absorbed`` (taken by constants: position embeddings, class token, masks, ...) under a
    conservative preset, up to numerical error.
    """

    injected: torch.Tensor
    input: torch.Tensor
    absorbed: torch.Tensor
    absorbed_by: Dict[str, torch.Tensor]
    blocks: List[BlockConservation]
    preset: str

    @property
    def error(self) -> torch.Tensor:
        """Relative end-to-end error per sample: |injected - input - absorbed| / |injected|."""
        return (self.injected - self.input - self.absorbed).abs() / self.injected.abs().clamp_min(1e-12)

    def __repr__(self) -> str:
        rows = [f"Conservation(preset='{self.preset}', per sample)",
                f"  injected {self.injected.tolist()}", f"  input    {self.input.tolist()}",
                f"  absorbed {self.absorbed.tolist()}", f"  rel. err {self.error.tolist()}"]
        return "\n".join(rows)


@dataclasses.dataclass
class Trace:  # noqa: E302
    """Everything one forward + reverse walk produced."""

    outputs: Any
    logits: Optional[torch.Tensor]
    target: Optional[torch.Tensor]
    target_scores: torch.Tensor
    blocks: List[BlockRecord]
    input_relevance: Optional[torch.Tensor]
    input_gradient: Optional[torch.Tensor]
    conservation: Optional[Conservation]
    modality: str
    grid: Optional[tuple]
    batch_size: int
    session: Any = None
    token_mask: Optional[torch.Tensor] = None  # [batch, tokens] True at real (non-padding) tokens
    #: window attention (Swin): token counts per block and the merge matrices between stages
    #: (relprop.graph.windows.Stages); None for models whose blocks share one token sequence
    stages: Any = None


def _fit(rel: torch.Tensor, shape) -> torch.Tensor:
    """Reduce a relevance tensor computed in a broadcast shape onto the operand's shape."""
    if tuple(rel.shape) == tuple(shape):
        return rel
    while rel.dim() > len(shape):
        rel = rel.sum(0)
    return rel.sum_to_size(shape)


def check_rules(captured: Captured, preset: str, unsupported: str) -> None:
    """Raise :class:`UnsupportedOperation` for the first relevant op with no rule in ``preset``."""
    registry.get_preset(preset)
    if unsupported not in ("error", "z_rule"):
        raise ValueError(f"unsupported must be 'error' or 'z_rule', not {unsupported!r}")
    a = captured.analysis
    out_node = next(n for n in captured.graph.nodes if n.op == "output")
    stack = [n for n in pytree.tree_leaves(out_node.args[0]) if isinstance(n, torch.fx.Node) and n in a.live]
    seen = set()
    while stack:  # follow only the argument positions that rules can give relevance to
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
        if fn is None and unsupported == "error":
            raise UnsupportedOperation(node.target, module_path(node), module_type(node), preset)
        blocked = getattr(fn, "no_relevance_to", ())
        for i, arg in enumerate(node.args):
            if i in blocked:
                continue
            for m in pytree.tree_leaves(arg):
                if isinstance(m, torch.fx.Node) and m in a.live:
                    stack.append(m)


def bind_values(captured: Captured, model: torch.nn.Module, kwargs: Dict[str, Any]) -> Dict[torch.fx.Node, Any]:
    """Placeholder values: the model's *current* parameters and buffers (detached), the program's
    lifted constants and the user's inputs."""
    env = {}
    for node, kind, target in captured.bindings:
        if kind == "param":
            env[node] = model.get_parameter(target).detach()
        elif kind == "buffer":
            env[node] = model.get_buffer(target).detach()
        elif kind == "constant":
            env[node] = captured.program.constants[target]
        else:
            v = kwargs[target]
            env[node] = v.detach() if torch.is_tensor(v) else v
    return env


def run(captured: Captured, model: torch.nn.Module, kwargs: Dict[str, Any],
        score_fn: Callable[[Any], torch.Tensor], *, preset: str = "chefer2021",
        relevance: bool = True, eps: float = DEFAULT_EPS, unsupported: str = "error",
        target_of: Optional[Callable[[Any], Optional[torch.Tensor]]] = None, memory: str = "default") -> Trace:
    """Forward once, take the gradients of the target score, and (if ``relevance``) walk the graph
    back under ``preset``. ``score_fn(outputs)`` returns the [batch] target scores.

    ``memory="low"`` keeps only the values that cross segment boundaries (one segment per
    attention block) from a forward pass without autograd, then recomputes each segment, from the
    output back, for its gradients and its part of the walk (:func:`_run_low`); same results."""
    a = captured.analysis
    check_memory(memory)
    if relevance:
        check_rules(captured, preset, unsupported)
    if memory == "low" and a.windows:
        warnings.warn("memory='low' does not segment window attention (Swin): its window bookkeeping reads "
                      "every block's forward values. Explaining with memory='default'.", stacklevel=3)
        memory = "default"
    out_nodes = _out_nodes(captured)
    wrt = out_nodes + [b.attention for b in a.blocks] + [b.hidden for b in a.blocks if b.hidden is not None] \
        + [b.features for b in a.blocks if b.features is not None] + list(a.sources)
    wrt = list(dict.fromkeys(wrt))
    remat = _rematerializable(captured)
    if memory == "low":
        env, outputs, scores, target, grad, rel_at, conservation, input_rel = _run_low(
            captured, model, kwargs, score_fn, target_of, out_nodes, wrt, remat, relevance, preset, eps, unsupported)
        return _trace(captured, model, kwargs, score_fn, env, outputs, scores, target, grad, rel_at, conservation,
                      input_rel, None)
    with torch.enable_grad():
        env, outputs = forward(captured, model, kwargs, discard=remat)
        scores = score_fn(outputs)
        target = target_of(outputs) if target_of is not None else None
        if not scores.requires_grad:
            raise RuntimeError("the target score does not depend on the input; nothing to explain")
        grads = torch.autograd.grad(scores.sum(), [env[n] for n in wrt], allow_unused=True)
        scores = scores.detach()
    grad = {n: (g if g is not None else torch.zeros_like(env[n])) for n, g in zip(wrt, grads)}
    del grads
    batch = scores.shape[0]

    rel_at: Dict[torch.fx.Node, torch.Tensor] = {}
    conservation = None
    input_rel = None
    from .windows import locate_windows
    windows = locate_windows(a, env, batch)  # window attention: read before the walk frees values
    if relevance:
        with torch.no_grad():
            seed = {**grad, **_output_seed(captured, env, score_fn, out_nodes)}
            rel_at, conservation, input_rel = _walk(captured, env, seed, out_nodes, preset, eps, unsupported, batch,
                                                    captured.weight_cache if memory == "high" else None,
                                                    remat)
    return _trace(captured, model, kwargs, score_fn, env, outputs, scores, target, grad, rel_at, conservation,
                  input_rel, windows)


def _trace(captured, model, kwargs, score_fn, env, outputs, scores, target, grad, rel_at, conservation, input_rel,
           windows) -> Trace:
    """The block records and the Trace, from the values the walk kept (:func:`_read_after_walk`)."""
    a = captured.analysis
    batch = scores.shape[0]
    blocks = []
    for b in a.blocks:
        blocks.append(BlockRecord(
            index=b.index, name=b.name, layer=b.layer,
            attention=env[b.attention].detach().float(), gradient=grad[b.attention].detach().float(),
            relevance=rel_at.get(b.attention),
            hidden=env[b.hidden].detach().float() if b.hidden is not None else None,
            hidden_gradient=grad[b.hidden].detach().float() if b.hidden is not None else None,
            hidden_relevance=rel_at.get(b.hidden) if b.hidden is not None else None,
            value=env[b.value].detach().float() if b.value is not None else None,
            features=env[b.features].detach().float() if b.features is not None else None,
            features_gradient=grad[b.features].detach().float() if b.features is not None else None,
            out_proj_weight=env[b.out_proj].detach().float() if b.out_proj is not None else None,
        ))
    from .windows import globalize
    blocks, stages = globalize(windows, blocks, batch)
    input_grad = None
    if a.sources:
        g = [grad[s] for s in a.sources]
        input_grad = g[0].detach().float() if len(g) == 1 else torch.stack(g).sum(0).detach().float()
    logits = _logits(outputs)
    fixed = target if target is not None else None
    session = Session(captured, model, kwargs, score_fn if fixed is None else _fixed_scores(fixed), env[a.sources[0]].detach()
                      if a.sources else None)
    am = kwargs.get("attention_mask")
    n_tok = blocks[0].attention.shape[-1] if blocks else None
    if torch.is_tensor(am) and am.dim() == 2 and n_tok == am.shape[1]:
        token_mask = am.to(scores.device) != 0
    else:
        token_mask = torch.ones(batch, n_tok, dtype=torch.bool, device=scores.device) if n_tok else None
    return Trace(session=session, token_mask=token_mask, outputs=pytree.tree_map(lambda t: t.detach() if torch.is_tensor(t) else t, outputs),
                 logits=logits.detach() if logits is not None else None, target=target,
                 target_scores=scores.detach(), blocks=blocks, input_relevance=input_rel, input_gradient=input_grad,
                 conservation=conservation, modality=a.modality, grid=a.grid, batch_size=batch, stages=stages)


#: the values of ``explain(..., memory=...)``
MEMORY_MODES = ("default", "low", "high")


def check_memory(memory) -> None:
    if memory not in MEMORY_MODES:
        raise ValueError(f"memory={memory!r} is not a choice here. Choices: {list(MEMORY_MODES)}")


def _segments(captured) -> List[List[torch.fx.Node]]:
    """The graph's nodes (the output node aside) cut into contiguous runs, one per attention block:
    a run starts at the first node of a block's layer (the prefix before block 1, the embeddings
    and mask building, joins block 0; the head joins the last block). Any cut of a topological
    order is valid; cutting at the blocks bounds what one run holds to about one layer."""
    plans = captured.plans
    if "segments" not in plans:
        nodes = [n for n in captured.graph.nodes if n.op != "output"]
        first = {}
        for i, n in enumerate(nodes):
            for b in captured.analysis.blocks:
                if b.layer and b.layer not in first and b.layer in module_paths(n):
                    first[b.layer] = i
        cuts, last = [], 0
        for b in captured.analysis.blocks[1:]:
            i = first.get(b.layer)
            if i is not None and i > last:
                cuts.append(i)
                last = i
        bounds = [0] + cuts + [len(nodes)]
        plans["segments"] = [nodes[i:j] for i, j in zip(bounds[:-1], bounds[1:]) if j > i]
    return plans["segments"]


def _crossing(captured) -> frozenset:
    """Nodes whose values a later segment (or the output) reads: what the forward pass of
    ``memory="low"`` keeps."""
    plans = captured.plans
    if "crossing" not in plans:
        seg_of = {n: i for i, seg in enumerate(_segments(captured)) for n in seg}
        out = set()
        for n, i in seg_of.items():
            if any(u.op == "output" or seg_of.get(u, i) != i for u in n.users):
                out.add(n)
        plans["crossing"] = frozenset(out)
    return plans["crossing"]


def _run_low(captured, model, kwargs, score_fn, target_of, out_nodes, wrt, remat, relevance, preset, eps,
             unsupported):
    """``memory="low"``: gradient checkpointing at the attention blocks, for the walk as well.

    1. A forward pass without autograd keeps only the values that cross segments
       (:func:`_segments`, :func:`_crossing`): the hidden states between blocks, the masks the
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
    """
    a = captured.analysis
    sources = set(a.sources)
    crossing = _crossing(captured)
    keep = crossing | sources | {a.primary}
    discard = {n for n in captured.graph.nodes if n.op == "call_function" and n not in keep}
    with torch.no_grad():
        env, outputs = forward(captured, model, kwargs, discard=discard)
    scores, seed = _output_seed(captured, env, score_fn, out_nodes, with_scores=True)
    with torch.no_grad():
        target = target_of(outputs) if target_of is not None else None
    batch = scores.shape[0]
    grad_nodes = set(wrt) - set(out_nodes)
    gbuf: Dict[torch.fx.Node, torch.Tensor] = dict(seed)  # gradient arriving at each crossing value
    grad: Dict[torch.fx.Node, torch.Tensor] = {}
    walker = None
    if relevance:
        walker = _Walker(captured, env, {**seed}, out_nodes, preset, eps, unsupported, batch, remat,
                         weight_cache=None)  # no memo of 2x every weight here (memory="high" only)
    needed_later = _read_after_walk(a)
    last = _last_uses(captured)
    for seg in reversed(_segments(captured)):
        _backward_segment(captured, env, seg, gbuf, grad, grad_nodes, crossing, remat, last)
        if walker is not None:
            with torch.no_grad():
                for node in reversed(seg):
                    walker.visit(node)
        else:
            for node in seg:
                if node not in needed_later:
                    env.pop(node, None)
    for n in grad_nodes:  # placeholders (pixels, inputs_embeds): the sum over the segments reading them
        if n not in grad:
            g = gbuf.get(n)
            grad[n] = g if g is not None else torch.zeros_like(env[n])
    rel_at, conservation, input_rel = walker.finish() if walker is not None else ({}, None, None)
    return env, outputs, scores, target, grad, rel_at, conservation, input_rel


def _backward_segment(captured, env, seg, gbuf, grad, grad_nodes, crossing, remat, last):
    """Recompute one segment with autograd from its inputs in ``env``, propagate the gradients in
    ``gbuf`` (at its outgoing values) back to its incoming values (added to ``gbuf``) and to the
    nodes of ``grad_nodes`` it holds (into ``grad``); leave its values, detached, in ``env``."""
    a = captured.analysis
    sources = set(a.sources)
    senv: Dict[torch.fx.Node, Any] = {}
    leaves: List[torch.fx.Node] = []

    def val(n):
        if n in senv:
            return senv[n]
        v = env[n]
        if n in a.live and torch.is_tensor(v) and v.is_floating_point():
            v = v.detach().requires_grad_(True)
            leaves.append(n)
        senv[n] = v
        return v

    fn_nodes = [n for n in seg if n.op == "call_function"]
    inside = set(fn_nodes)
    with torch.enable_grad():
        for node in fn_nodes:
            args, kw = torch.fx.node.map_arg((node.args, node.kwargs), val)
            out = node.target(*args, **kw)
            if node in sources:
                out = out.detach().requires_grad_(True)
            senv[node] = out
            for m in last.get(node, ()):
                if m in inside and m in remat and m not in crossing:
                    senv.pop(m, None)  # the walk computes it again (autograd keeps what it saved)
        roots = [n for n in fn_nodes if n in gbuf and torch.is_tensor(senv.get(n)) and senv[n].requires_grad]
        targets = list(leaves) + [n for n in fn_nodes if n in grad_nodes and n in senv and senv[n].requires_grad]
        targets = list(dict.fromkeys(targets))
        if roots and targets:
            gs = torch.autograd.grad([senv[n] for n in roots], [senv[n] for n in targets],
                                     grad_outputs=[gbuf[n] for n in roots], allow_unused=True)
        else:
            gs = [None] * len(targets)
    for n in roots:
        del gbuf[n]
    for n, g in zip(targets, gs):
        if n in inside:
            grad[n] = g if g is not None else torch.zeros_like(senv[n])
        elif g is not None:
            gbuf[n] = gbuf[n] + g if n in gbuf else g
    del gs
    for n in grad_nodes & inside:
        if n not in grad:
            grad[n] = torch.zeros_like(senv[n])
    for n in fn_nodes:
        if n in senv:
            v = senv[n]
            env[n] = v.detach() if torch.is_tensor(v) else v
    senv.clear()


#: counters the tests read: how many times the captured graph was evaluated (all or in part);
#: the only module-level state of the interpreter, updated under a lock (threads may explain at once)
STATS = {"forward": 0}
_STATS_LOCK = threading.Lock()


def forward(captured: Captured, model, kwargs, perturb: Optional[Callable] = None,
            overrides: Optional[Dict[torch.fx.Node, torch.Tensor]] = None, env: Optional[dict] = None,
            only: Optional[set] = None, discard: Optional[set] = None):
    """Evaluate the captured graph. ``perturb(value)`` replaces the value of the relevance source
    (pixels, or the word embeddings) before it is used; ``overrides`` replaces node values;
    with ``env`` and ``only`` given, only the nodes in ``only`` are re-evaluated (the rest are
    read from ``env``). The values of the nodes in ``discard`` leave ``env`` after their last use
    (autograd keeps what it saved of them; :func:`_rematerializable`). Sources are made leaves
    that require grad. Returns (env, outputs)."""
    a = captured.analysis
    with _STATS_LOCK:
        STATS["forward"] += 1
    sources = set(a.sources)
    overrides = overrides or {}
    if env is None:
        env = bind_values(captured, model, kwargs)
        if a.primary in sources:
            v = env[a.primary]
            if perturb is not None:
                v = perturb(v)
            env[a.primary] = v.detach().requires_grad_(True)
    else:
        env = dict(env)
    last = _last_uses(captured) if discard else {}
    for node in captured.graph.nodes:
        if node.op != "call_function":
            continue
        if node in overrides:
            env[node] = overrides[node]
            continue
        if only is not None and node not in only:
            continue
        args, kw = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: env[n])
        out = node.target(*args, **kw)
        if node in sources:
            if perturb is not None:
                out = perturb(out)
            out = out.detach().requires_grad_(True)
        env[node] = out
        for m in last.get(node, ()):
            if m in discard:
                env.pop(m, None)
    out_node = next(n for n in captured.graph.nodes if n.op == "output")
    flat_nodes = pytree.tree_leaves(out_node.args[0])
    flat_vals = [env[n] if isinstance(n, torch.fx.Node) else n for n in flat_nodes]
    return env, pytree.tree_unflatten(flat_vals, captured.out_spec)


def _fixed_scores(target: torch.Tensor):
    from ..targets import logits_of

    def score(outputs):
        return logits_of(outputs).gather(1, target[:, None].to(logits_of(outputs).device)).squeeze(1)
    return score


class Session:
    """A handle on one explained batch that methods use to re-run the captured graph: with the
    source perturbed (SmoothGrad, Integrated Gradients), with other inputs (ViT-CX masks), or with
    one block re-evaluated under an override (value zeroing). The target stays the one explained."""

    def __init__(self, captured, model, kwargs, score_fn, source_value):
        self.captured = captured
        self.model = model
        self.kwargs = kwargs
        self.score_fn = score_fn
        self.source_value = source_value  # pixels [B,C,H,W] or word embeddings [B,S,C]

    @property
    def modality(self):
        return self.captured.analysis.modality

    def source_gradient(self, perturb: Optional[Callable] = None):
        """(source value, d score / d source) with the source replaced by ``perturb(source)``."""
        with torch.enable_grad():
            env, outputs = forward(self.captured, self.model, self.kwargs, perturb=perturb)
            scores = self.score_fn(outputs)
            srcs = self.captured.analysis.sources
            grads = torch.autograd.grad(scores.sum(), [env[s] for s in srcs], allow_unused=True)
        g = [torch.zeros_like(env[s]) if gr is None else gr for s, gr in zip(srcs, grads)]
        return env[srcs[0]].detach().float(), sum(g).detach().float()

    def target_scores(self, **replace) -> torch.Tensor:
        """Target scores with some model inputs replaced (e.g. ``pixel_values=masked``)."""
        kwargs = dict(self.kwargs)
        for k, v in replace.items():
            if k == "primary":
                k = self.captured.primary
            old = kwargs.get(k)
            if torch.is_tensor(v) and torch.is_tensor(old) and v.is_floating_point() and old.is_floating_point():
                v = v.to(old.dtype)  # e.g. float32 masks applied to a half-precision model's pixels
            kwargs[k] = v
        with torch.no_grad():
            _, outputs = forward(self.captured, self.model, kwargs)
            return self.score_fn(outputs).detach().float()

    def block_output_with_value_scaled(self, base_env: dict, block_index: int, scale: torch.Tensor) -> torch.Tensor:
        """Re-evaluate block ``block_index`` with its values V multiplied by ``scale`` (broadcast
        to V, e.g. zero for one token) and return the block's output hidden states."""
        b = self.captured.analysis.blocks[block_index]
        scope = self._scope(block_index)
        v = base_env[b.value]
        with torch.no_grad():
            env, _ = forward(self.captured, self.model, self.kwargs, overrides={b.value: v * scale.to(v.dtype)},
                             env=base_env, only=scope)
        return env[b.output].detach().float()

    def base_env(self) -> dict:
        with torch.no_grad():
            env, _ = forward(self.captured, self.model, self.kwargs)
        return env

    def _scope(self, block_index):
        cache = self.__dict__.setdefault("_scopes", {})
        if block_index not in cache:
            b = self.captured.analysis.blocks[block_index]
            order = {n: i for i, n in enumerate(self.captured.graph.nodes)}
            start = order[b.value]
            cache[block_index] = {n for n in self.captured.graph.nodes
                                  if order[n] > start and b.layer in module_paths(n) and n.op == "call_function"}
        return cache[block_index]


def _logits(outputs):
    if torch.is_tensor(outputs):
        return outputs
    if hasattr(outputs, "logits") and torch.is_tensor(getattr(outputs, "logits")):
        return outputs.logits
    if isinstance(outputs, (tuple, list)) and outputs and torch.is_tensor(outputs[0]):
        return outputs[0]
    return None


def _walk(captured, env, grad, out_nodes, preset, eps, unsupported, batch, weight_cache, remat=frozenset()):
    walker = _Walker(captured, env, grad, out_nodes, preset, eps, unsupported, batch, remat, weight_cache=weight_cache)
    for node in reversed(captured.graph.nodes):
        walker.visit(node)
    return walker.finish()


class _Walker:
    """The reverse walk, one node at a time (:meth:`visit` in reverse topological order, then
    :meth:`finish`). ``env`` holds the forward values; the value of a node in ``remat`` that is
    missing from it is recomputed from its arguments when a rule reads it (:func:`_rematerializable`).
    """

    def __init__(self, captured, env, grad, out_nodes, preset, eps, unsupported, batch, remat=frozenset(),
                 needed_later=None, weight_cache=None):
        a = captured.analysis
        self.captured, self.a, self.env, self.preset, self.eps = captured, a, env, preset, eps
        self.unsupported, self.batch, self.remat = unsupported, batch, remat
        self.sources = set(a.sources)
        self.bdim = a.batch_dim
        self.placeholders = {n: (kind, tgt) for n, kind, tgt in captured.bindings}
        self.keep = {b.attention for b in a.blocks} | {b.hidden for b in a.blocks if b.hidden is not None}
        self.block_out = {b.output: b for b in a.blocks if b.output is not None}
        self.block_hidden = {}
        for b in a.blocks:
            if b.hidden is not None:
                self.block_hidden.setdefault(b.hidden, []).append(b)
        self.layers = [b.layer for b in a.blocks]
        self.per_block_in = {}
        self.per_block_out = {}
        self.absorbed_by: Dict[str, torch.Tensor] = {}
        self.rel_at: Dict[torch.fx.Node, torch.Tensor] = {}
        self.options = {"reads_pixels": a.pixel_convs,
                        "weight_cache": weight_cache}
        self.R: Dict[torch.fx.Node, Any] = {}
        self.dev = dev = grad[out_nodes[0]].device if out_nodes else torch.device("cpu")
        self.per_block_absorbed = {b.layer: torch.zeros(batch, device=dev) for b in a.blocks}
        for n in out_nodes:
            self.R[n] = grad[n].detach().float()
        self.injected = torch.zeros(batch, device=dev)
        for n in out_nodes:
            self.injected = self.injected + _sample_sum(self.R[n], self.bdim.get(n), batch)
        self.input_parts = []
        self.needed_later = _read_after_walk(a) if needed_later is None else needed_later
        self.done = None

    def value(self, n):
        """The forward value of node ``n`` (recomputed, without autograd, if it was discarded)."""
        env = self.env
        if n in env:
            return env[n]
        if n not in self.remat:
            raise KeyError(f"the value of node {n.name} was freed before the reverse walk read it")
        args, kw = torch.fx.node.map_arg((n.args, n.kwargs), self.value)
        with torch.no_grad():
            v = n.target(*args, **kw)
        env[n] = v  # freed when the walk passes n
        return v

    def absorb(self, label, rel, consumer, arg_bdim):
        batch = self.batch
        out_val = self.env[consumer]
        ob = self.bdim.get(consumer)
        if torch.is_tensor(out_val) and ob is not None and rel.dim() == out_val.dim() and rel.shape[ob] % batch == 0:
            s = _sample_sum(rel, ob, batch)
        elif arg_bdim is not None and rel.dim() > arg_bdim and rel.shape[arg_bdim] == batch:
            s = _sample_sum(rel, arg_bdim, batch)
        elif rel.dim() > 0 and rel.shape[0] == batch:
            s = _sample_sum(rel, 0, batch)
        else:  # a constant with no per-sample structure: only possible for batch 1
            s = rel.sum().reshape(1).expand(batch) / batch
        self.absorbed_by[label] = self.absorbed_by.get(label, 0) + s
        paths = module_paths(consumer)
        for layer in self.layers:
            if layer in paths:
                self.per_block_absorbed[layer] = self.per_block_absorbed[layer] + s

    def visit(self, node):
        a, env, R, batch, bdim = self.a, self.env, self.R, self.batch, self.bdim
        # last-use freeing: the walk reads a node's value only at that node and at its consumers,
        # all visited before it, so a visited node's value is dead (unless read after the walk)
        if self.done is not None and self.done not in self.needed_later:
            env.pop(self.done, None)
        self.done = node
        if node not in R:
            return
        r = R.pop(node)
        if node in self.keep:
            self.rel_at[node] = r
        if node in self.block_out:
            self.per_block_in[self.block_out[node].layer] = _sample_sum(r, bdim.get(node), batch)
        if node in self.block_hidden:
            for b in self.block_hidden[node]:
                self.per_block_out[b.layer] = _sample_sum(r, bdim.get(node), batch)
        if node in self.sources:
            self.input_parts.append((node, r))
            return
        if node.op != "call_function":
            return
        if node.target is operator.getitem:
            src, idx = node.args[0], node.args[1]
            slots = R.setdefault(src, {})
            slots[idx] = slots[idx] + r if idx in slots else r
            return
        out_val = self.value(node)
        if isinstance(out_val, (list, tuple)):
            r = [r.get(i, torch.zeros(v.shape, dtype=torch.float32, device=v.device)) if isinstance(r, dict) else r[i]
                 for i, v in enumerate(out_val)]
        preset = self.preset
        fn = registry.lookup(preset, node.target)
        if fn is None:
            if self.unsupported == "error":
                raise UnsupportedOperation(node.target, module_path(node), module_type(node), preset)
            fn = gradient_times_input
        # rules compute in float32 at least: half-precision activations are upcast (DESIGN §2)
        value = self.value
        args, kw = torch.fx.node.map_arg((node.args, node.kwargs),
                                         lambda n: _f32(value(n)) if n in a.live else value(n))
        live = tuple(_liveness(x, a.live) for x in node.args)
        ctx = RuleContext(node=node, args=tuple(args), kwargs=kw, out=pytree.tree_map(_f32, out_val), live=live,
                          batch_dim=bdim.get(node), batch_size=batch, eps=self.eps, preset=preset,
                          options=self.options)
        shares = fn(ctx, r)
        del ctx, args, kw, r
        if shares is None:
            raise UnsupportedOperation(node.target, module_path(node), module_type(node), preset,
                                       detail="Its rule does not apply to these operands.")
        for i, arg in enumerate(node.args):
            share = shares[i] if i < len(shares) else None
            if share is None:
                continue
            if isinstance(arg, (list, tuple)):
                for el, sh in zip(arg, share):
                    if sh is not None:
                        self.deliver(el, sh, node)
            else:
                self.deliver(arg, share, node)

    def deliver(self, arg, share, consumer):
        if isinstance(arg, torch.fx.Node) and arg in self.a.live:
            val = self.value(arg)
            share = _fit(share.float(), val.shape)
            R = self.R
            R[arg] = R[arg] + share if arg in R else share
            return
        if not torch.is_tensor(share):
            return
        if isinstance(arg, torch.fx.Node):
            label = _constant_label(arg, self.placeholders, consumer)
            self.absorb(label, share.float(), consumer, self.bdim.get(arg))
        else:
            self.absorb(f"{module_path(consumer) or 'model'}:{consumer.name}:const", share.float(), consumer, None)

    def finish(self):
        a, batch, dev = self.a, self.batch, self.dev
        input_rel = None
        reached = torch.zeros(batch, device=dev)
        for node, r in self.input_parts:
            reached = reached + _sample_sum(r, self.bdim.get(node), batch)
            if a.modality == "text":
                r = r.sum(-1)
            input_rel = r if input_rel is None else input_rel + r
        absorbed = sum(self.absorbed_by.values(), torch.zeros(batch, device=dev))
        blocks = []
        for b in a.blocks:
            if b.layer in self.per_block_in:
                blocks.append(BlockConservation(b.name, self.per_block_in[b.layer],
                                                self.per_block_out.get(b.layer, torch.zeros(batch, device=dev)),
                                                self.per_block_absorbed[b.layer]))
        cons = Conservation(self.injected, reached, absorbed, self.absorbed_by, blocks, self.preset)
        return self.rel_at, cons, input_rel


def _output_seed(captured, env, score_fn, out_nodes, with_scores=False):
    """The relevance seed at each output: the partial derivative of the target score with respect to
    that output, the other outputs held fixed (CVPR 2021 §3.3: the one-hot of the target logit).

    It differs from the gradient at the output node when one output is computed from another
    (CLIP returns the image and text embeddings and the similarity logits computed from them):
    seeding the total gradient there would inject the relevance of the logits twice.
    """
    out_node = next(n for n in captured.graph.nodes if n.op == "output")
    flat_nodes = pytree.tree_leaves(out_node.args[0])
    leaves, values = [], []
    for n in flat_nodes:
        v = env[n] if isinstance(n, torch.fx.Node) else n
        if isinstance(n, torch.fx.Node) and n in out_nodes and torch.is_tensor(v) and v.is_floating_point():
            v = v.detach().requires_grad_(True)
            leaves.append((n, v))
        values.append(v)
    if not leaves and not with_scores:
        return {}
    with torch.enable_grad():
        scores = score_fn(pytree.tree_unflatten(values, captured.out_spec))
        if with_scores and not scores.requires_grad:
            raise RuntimeError("the target score does not depend on the input; nothing to explain")
        grads = torch.autograd.grad(scores.sum(), [v for _, v in leaves], allow_unused=True)
    seed: Dict[torch.fx.Node, torch.Tensor] = {}
    for (n, v), g in zip(leaves, grads):
        g = torch.zeros_like(v) if g is None else g
        seed[n] = seed[n] + g if n in seed else g
    return (scores.detach(), seed) if with_scores else seed


def _out_nodes(captured) -> List[torch.fx.Node]:
    """The live graph nodes the program returns, without repeats."""
    a = captured.analysis
    out_node = next(n for n in captured.graph.nodes if n.op == "output")
    flat_nodes = pytree.tree_leaves(out_node.args[0])
    return list(dict.fromkeys(n for n in flat_nodes if isinstance(n, torch.fx.Node) and n in a.live))


def _last_uses(captured) -> Dict[torch.fx.Node, List[torch.fx.Node]]:
    """node -> the nodes whose last reader (in graph order) it is (a node nobody reads: itself)."""
    plans = captured.plans
    if "last_uses" not in plans:
        last = {}
        for node in captured.graph.nodes:
            for m in node.all_input_nodes:
                last[m] = node
            if not node.users:
                last[node] = node
        out: Dict[torch.fx.Node, List[torch.fx.Node]] = {}
        for m, node in last.items():
            out.setdefault(node, []).append(m)
        plans["last_uses"] = out
    return plans["last_uses"]


#: ops cheap enough to run again during the reverse walk rather than keep their output from the
#: forward pass: shape-only ops, element-wise arithmetic and comparisons (mask building, scaling,
#: the addition of the attention mask), constant fills, softmax, and the attention products when
#: both operands are activations (Q·Kᵀ and A·V; a product with a weight is a linear layer and is
#: kept). Deterministic ops only: a value computed again equals the first one bit for bit.
REMAT_OPS = {
    aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default,
    aten.permute.default, aten.transpose.int, aten.t.default, aten.unsqueeze.default, aten.squeeze.dim,
    aten.squeeze.dims, aten.squeeze.default, aten.alias.default, aten.slice.Tensor, aten.select.int,
    aten.clone.default, aten.contiguous.default, aten._to_copy.default, aten.flatten.using_ints,
    aten.unflatten.int,
    aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar, aten.mul.Tensor, aten.mul.Scalar,
    aten.div.Tensor, aten.div.Scalar, aten.neg.default, aten.where.self, aten.masked_fill.Scalar,
    aten.masked_fill.Tensor,
    aten.eq.Scalar, aten.eq.Tensor, aten.ne.Scalar, aten.ne.Tensor, aten.lt.Scalar, aten.lt.Tensor,
    aten.le.Scalar, aten.le.Tensor, aten.gt.Scalar, aten.gt.Tensor, aten.ge.Scalar, aten.ge.Tensor,
    aten.logical_not.default, aten.logical_and.default, aten.logical_or.default,
    aten.bitwise_and.Tensor, aten.bitwise_or.Tensor, aten.bitwise_not.default,
    aten.any.dim, aten.all.dim,
    aten.full_like.default, aten.zeros_like.default, aten.ones_like.default, aten.scalar_tensor.default,
    aten.full.default, aten.zeros.default, aten.ones.default, aten.new_zeros.default, aten.new_ones.default,
    aten.new_full.default,
    aten.softmax.int, aten._softmax.default, aten._safe_softmax.default,
}
_PRODUCTS = {aten.matmul.default, aten.bmm.default}


def _rematerializable(captured) -> frozenset:
    """Nodes whose values the forward pass frees after their last forward use, and the reverse
    walk computes again when a rule reads them (issue 7: memory).

    The attention scores, the masked scores, the softmax and the masks built from them are each as
    large as an attention map (heads × tokens² per sample) and several of them exist per block;
    keeping them all from the forward pass is what made the peak memory several times that of a
    forward+backward pass. Computing them again costs one Q·Kᵀ product and a few element-wise
    passes per block. Values read after the walk (block records, sources, outputs) are never in
    this set.
    """
    plans = captured.plans
    if "remat" not in plans:
        a = captured.analysis
        keep = _read_after_walk(a) | set(_out_nodes(captured)) | set(a.sources)
        out = set()
        for node in captured.graph.nodes:
            if node.op != "call_function" or node in keep or not isinstance(node.meta.get("val"), torch.Tensor):
                continue
            if node.target in REMAT_OPS or (node.target in _PRODUCTS and all(
                    isinstance(x, torch.fx.Node) and x in a.live for x in node.args[:2])):
                out.add(node)
        plans["remat"] = frozenset(out)
    return plans["remat"]


def _read_after_walk(a) -> set:
    """Nodes whose forward values are read after the reverse walk (block records, sources, the
    nodes that map window attention onto the token grid); the walk frees every other value."""
    keep = set(a.sources) | {a.primary}
    for b in a.blocks:
        keep |= {n for n in (b.attention, b.hidden, b.value, b.features, b.out_proj, b.output) if n is not None}
    for wm in (getattr(a, "windows", None) or {}).values():
        for n in [getattr(wm, "start", None), getattr(wm, "end", None)] + list(getattr(wm, "nodes", ())):
            if isinstance(n, torch.fx.Node):
                keep.add(n)
                keep.update(n.all_input_nodes)
    return keep


def _f32(v):
    """A float16/bfloat16 tensor as float32 (anything else unchanged)."""
    if torch.is_tensor(v) and v.dtype in (torch.float16, torch.bfloat16):
        return v.float()
    return v


def _liveness(x, live):
    if isinstance(x, torch.fx.Node):
        return x in live
    if isinstance(x, (list, tuple)):
        return [(_liveness(e, live)) for e in x]
    return False


def _sample_sum(t: torch.Tensor, d: Optional[int], batch: int) -> torch.Tensor:
    if d is None:
        if t.dim() > 0 and t.shape[0] == batch:
            d = 0
        else:
            return t.sum().reshape(1).expand(batch) / batch
    t = t.movedim(d, 0)  # [batch, ...] or [batch·k, ...] (k groups per sample, batch-major)
    return t.reshape(batch, -1).sum(1).float()


def _constant_label(arg, placeholders, consumer) -> str:
    """Name a constant by the parameter/buffer it was derived from (through shape-only ops), e.g.
    'cls_token' for the expanded class token, else by the module that consumed it."""
    from .analysis import INDEX_ROUTING
    n, hops = arg, 0
    while isinstance(n, torch.fx.Node) and hops < 8:
        if n in placeholders:
            return str(placeholders[n][1])
        if n.op != "call_function" or n.target not in INDEX_ROUTING:
            break
        n, hops = n.args[0], hops + 1
    return f"{module_path(consumer) or 'model'}:{arg.name}"
