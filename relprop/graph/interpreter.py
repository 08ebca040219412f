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
class Trace:
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
    for node in captured.graph.nodes:
        if node not in a.relevant or node in a.sources or node.op != "call_function":
            continue
        if node.target is operator.getitem:
            continue
        if registry.lookup(preset, node.target) is None and unsupported == "error":
            raise UnsupportedOperation(node.target, module_path(node), module_type(node), preset)


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
        target_of: Optional[Callable[[Any], Optional[torch.Tensor]]] = None) -> Trace:
    """Forward once, take the gradients of the target score, and (if ``relevance``) walk the graph
    back under ``preset``. ``score_fn(outputs)`` returns the [batch] target scores."""
    a = captured.analysis
    graph = captured.graph
    if relevance:
        check_rules(captured, preset, unsupported)
    env = bind_values(captured, model, kwargs)
    sources = set(a.sources)
    with torch.enable_grad():
        if a.primary in sources:
            env[a.primary] = env[a.primary].detach().requires_grad_(True)
        for node in graph.nodes:
            if node.op != "call_function":
                continue
            args, kw = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: env[n])
            out = node.target(*args, **kw)
            if node in sources:
                out = out.detach().requires_grad_(True)
            env[node] = out
        out_node = next(n for n in graph.nodes if n.op == "output")
        flat_nodes = pytree.tree_leaves(out_node.args[0])
        flat_vals = [env[n] if isinstance(n, torch.fx.Node) else n for n in flat_nodes]
        outputs = pytree.tree_unflatten(flat_vals, captured.out_spec)
        scores = score_fn(outputs)
        target = target_of(outputs) if target_of is not None else None

        out_nodes = [n for n in flat_nodes if isinstance(n, torch.fx.Node) and n in a.live]
        out_nodes = list(dict.fromkeys(out_nodes))
        wrt = out_nodes + [b.attention for b in a.blocks] + [b.hidden for b in a.blocks if b.hidden is not None] \
            + list(a.sources)
        wrt = list(dict.fromkeys(wrt))
        if not scores.requires_grad:
            raise RuntimeError("the target score does not depend on the input; nothing to explain")
        grads = torch.autograd.grad(scores.sum(), [env[n] for n in wrt], allow_unused=True)
    grad = {n: (g if g is not None else torch.zeros_like(env[n])) for n, g in zip(wrt, grads)}
    batch = scores.shape[0]

    rel_at: Dict[torch.fx.Node, torch.Tensor] = {}
    conservation = None
    input_rel = None
    if relevance:
        with torch.no_grad():
            rel_at, conservation, input_rel = _walk(captured, env, grad, out_nodes, preset, eps, unsupported, batch)

    blocks = []
    for b in a.blocks:
        blocks.append(BlockRecord(
            index=b.index, name=b.name, layer=b.layer,
            attention=env[b.attention].detach().float(), gradient=grad[b.attention].detach().float(),
            relevance=rel_at.get(b.attention),
            hidden=env[b.hidden].detach().float() if b.hidden is not None else None,
            hidden_gradient=grad[b.hidden].detach().float() if b.hidden is not None else None,
            hidden_relevance=rel_at.get(b.hidden) if b.hidden is not None else None,
        ))
    input_grad = None
    if a.sources:
        g = [grad[s] for s in a.sources]
        input_grad = g[0].detach().float() if len(g) == 1 else torch.stack(g).sum(0).detach().float()
    logits = _logits(outputs)
    return Trace(outputs=pytree.tree_map(lambda t: t.detach() if torch.is_tensor(t) else t, outputs),
                 logits=logits.detach() if logits is not None else None, target=target,
                 target_scores=scores.detach(), blocks=blocks, input_relevance=input_rel, input_gradient=input_grad,
                 conservation=conservation, modality=a.modality, grid=a.grid, batch_size=batch)


def _logits(outputs):
    if torch.is_tensor(outputs):
        return outputs
    if hasattr(outputs, "logits") and torch.is_tensor(getattr(outputs, "logits")):
        return outputs.logits
    if isinstance(outputs, (tuple, list)) and outputs and torch.is_tensor(outputs[0]):
        return outputs[0]
    return None


def _walk(captured, env, grad, out_nodes, preset, eps, unsupported, batch):
    a = captured.analysis
    graph = captured.graph
    sources = set(a.sources)
    bdim = a.batch_dim
    placeholders = {n: (kind, tgt) for n, kind, tgt in captured.bindings}
    keep = {b.attention for b in a.blocks} | {b.hidden for b in a.blocks if b.hidden is not None}
    block_out = {b.output: b for b in a.blocks if b.output is not None}
    block_hidden = {}
    for b in a.blocks:
        if b.hidden is not None:
            block_hidden.setdefault(b.hidden, []).append(b)
    layers = [b.layer for b in a.blocks]
    per_block_in = {}
    per_block_out = {}
    per_block_absorbed = None
    absorbed_by: Dict[str, torch.Tensor] = {}
    rel_at: Dict[torch.fx.Node, torch.Tensor] = {}
    options = {"reads_pixels": a.pixel_convs, "weight_cache": captured.weight_cache}

    R: Dict[torch.fx.Node, Any] = {}
    dev = grad[out_nodes[0]].device if out_nodes else torch.device("cpu")
    per_block_absorbed = {b.layer: torch.zeros(batch, device=dev) for b in a.blocks}
    for n in out_nodes:
        R[n] = grad[n].detach().float()
    injected = torch.zeros(batch, device=dev)
    for n in out_nodes:
        injected = injected + _sample_sum(R[n], bdim.get(n), batch)

    def absorb(label, rel, consumer, arg_val, arg_bdim):
        out_val = env[consumer]
        ob = bdim.get(consumer)
        if torch.is_tensor(out_val) and ob is not None and rel.dim() == out_val.dim() and rel.shape[ob] == batch:
            s = _sample_sum(rel, ob, batch)
        elif arg_bdim is not None and rel.dim() > arg_bdim and rel.shape[arg_bdim] == batch:
            s = _sample_sum(rel, arg_bdim, batch)
        elif rel.dim() > 0 and rel.shape[0] == batch:
            s = _sample_sum(rel, 0, batch)
        else:  # a constant with no per-sample structure: only possible for batch 1
            s = rel.sum().reshape(1).expand(batch) / batch
        absorbed_by[label] = absorbed_by.get(label, 0) + s
        paths = module_paths(consumer)
        for layer in layers:
            if layer in paths:
                per_block_absorbed[layer] = per_block_absorbed[layer] + s

    input_parts = []
    for node in reversed(graph.nodes):
        if node not in R:
            continue
        r = R.pop(node)
        if node in keep:
            rel_at[node] = r
        if node in block_out:
            per_block_in[block_out[node].layer] = _sample_sum(r, bdim.get(node), batch)
        if node in block_hidden:
            for b in block_hidden[node]:
                per_block_out[b.layer] = _sample_sum(r, bdim.get(node), batch)
        if node in sources:
            input_parts.append((node, r))
            continue
        if node.op != "call_function":
            continue
        if node.target is operator.getitem:
            src, idx = node.args[0], node.args[1]
            slots = R.setdefault(src, {})
            slots[idx] = slots[idx] + r if idx in slots else r
            continue
        out_val = env[node]
        if isinstance(out_val, (list, tuple)):
            r = [r.get(i, torch.zeros(v.shape, dtype=torch.float32, device=v.device)) if isinstance(r, dict) else r[i]
                 for i, v in enumerate(out_val)]
        fn = registry.lookup(preset, node.target)
        if fn is None:
            fn = gradient_times_input
        args, kw = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: env[n])
        live = tuple(_liveness(x, a.live) for x in node.args)
        ctx = RuleContext(node=node, args=tuple(args), kwargs=kw, out=out_val, live=live,
                          batch_dim=bdim.get(node), batch_size=batch, eps=eps, preset=preset, options=options)
        shares = fn(ctx, r)
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
                        _deliver(el, sh, R, env, a, placeholders, node, absorb, bdim)
            else:
                _deliver(arg, share, R, env, a, placeholders, node, absorb, bdim)

    input_rel = None
    reached = torch.zeros(batch, device=dev)
    for node, r in input_parts:
        reached = reached + _sample_sum(r, bdim.get(node), batch)
        if a.modality == "text":
            r = r.sum(-1)
        input_rel = r if input_rel is None else input_rel + r
    absorbed = sum(absorbed_by.values(), torch.zeros(batch, device=dev))
    blocks = []
    for b in a.blocks:
        if b.layer in per_block_in:
            blocks.append(BlockConservation(b.name, per_block_in[b.layer],
                                            per_block_out.get(b.layer, torch.zeros(batch, device=dev)),
                                            per_block_absorbed[b.layer]))
    cons = Conservation(injected, reached, absorbed, absorbed_by, blocks, preset)
    return rel_at, cons, input_rel


def _liveness(x, live):
    if isinstance(x, torch.fx.Node):
        return x in live
    if isinstance(x, (list, tuple)):
        return [(_liveness(e, live)) for e in x]
    return False


def _deliver(arg, share, R, env, a, placeholders, consumer, absorb, bdim):
    if isinstance(arg, torch.fx.Node) and arg in a.live:
        val = env[arg]
        share = _fit(share.float(), val.shape)
        R[arg] = R[arg] + share if arg in R else share
        return
    if not torch.is_tensor(share):
        return
    if isinstance(arg, torch.fx.Node):
        label = _constant_label(arg, placeholders, consumer)
        absorb(label, share.float(), consumer, env[arg], bdim.get(arg))
    else:
        absorb(f"{module_path(consumer) or 'model'}:{consumer.name}:const", share.float(), consumer, None, None)


def _sample_sum(t: torch.Tensor, d: Optional[int], batch: int) -> torch.Tensor:
    if d is None:
        if t.dim() > 0 and t.shape[0] == batch:
            d = 0
        else:
            return t.sum().reshape(1).expand(batch) / batch
    t = t.movedim(d, 0)
    return t.reshape(t.shape[0], -1).sum(1).float()


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
