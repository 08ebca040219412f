"""``explain(..., compile=True)``: the relevance walk of a whole run as one program per input size,
traced once into an aten graph and compiled by ``torch.compile``.

The walk (:mod:`relprop.engine.walk`) is a function of the forward values and the seed: which rule runs at
which node, on which shapes, is fixed by the captured graph at its input size, the preset and the target's
row bound. Within a call that reads nothing on the host until its end (:mod:`relprop.graph.host_reads`)
it takes no decision from a value, so ``torch.fx.experimental.proxy_tensor.make_fx`` records it as a flat
graph of aten ops (``make_fx`` refuses a host read), which ``torch.compile`` fuses (inductor: element-wise
chains into one kernel; a C++ compiler on the CPU, Triton on a GPU). The first call at a size pays the trace
and the compilation (``exp.notes`` gives the seconds); later calls run the compiled program on their own
forward values, the same numbers as the eager walk to float32 rounding (fused kernels reassociate).

Nothing the program reads may come from outside its inputs: a traced graph that holds a tensor constant
(a value the walk read from somewhere other than the forward values and the seed, which a later call would
not see) is not used, and the walk runs eagerly, with a note saying why. What the walk hands over to the
call's one read (its assumptions) is an output of the program, handed over again at each call.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.fx
import torch.utils._pytree as pytree

from ..graph import host_reads
from ..rules import rule_registry as registry
from .trace import BlockConservation, Conservation
from .walk import WalkResult, Walker, walk

#: why a program is not used, kept with the specialization instead of a program
_EAGER = "eager"


@dataclasses.dataclass
class _Program:
    """A compiled walk: the callable, the env nodes it takes (in order), the env nodes the walk frees, how
    its flat outputs become a :class:`WalkResult`, the kinds and payloads of what it hands to the call's
    read, and the seconds the trace and the compilation took."""

    fn: Any
    inputs: List[torch.fx.Node]
    freed: List[torch.fx.Node]
    layout: Any
    reads: List[Tuple[str, Any]]
    seconds: float


def _key(request, batch: int, rows) -> tuple:
    preset = request.preset
    return (preset.name, id(preset), registry.state(preset), request.eps, request.unsupported, batch, rows,
            request.compute, request.captured.analysis.modality)


def compiled_walk(request, env: Dict, seed: Dict, out_nodes, batch: int, remat) -> Tuple[WalkResult, Optional[str]]:
    """The whole run's walk (as ``walk(Walker(request, env, seed, out_nodes, batch, remat), graph)``) by the
    program of this input size, traced and compiled at the first call (module docstring); ``(result, note)``
    with a note on the first call (the seconds it took) or where the walk ran eagerly (why)."""
    captured = request.captured
    programs = captured.plans.setdefault("compiled_walks", {})
    key = _key(request, batch, request.target.rows)
    prog = programs.get(key)
    reads = host_reads.scope()
    if reads is None:
        return _eager(request, env, seed, out_nodes, batch, remat), (
            "compile=True: the walk ran eagerly: the call reads values on the host where they decide "
            "(Tuning(host_reads='as_needed')), which a traced program cannot")
    if isinstance(prog, tuple) and prog[0] == _EAGER:
        return _eager(request, env, seed, out_nodes, batch, remat), prog[1]
    if prog is None:
        prog, result, why = _compile(request, env, seed, out_nodes, batch, remat, reads)
        programs[key] = prog if why is None else (_EAGER, why)
        if why is not None:
            return result, why
        return result, (f"compile=True: the relevance walk was traced and compiled for this input size in "
                        f"{prog.seconds:.1f} s (once per input size; later calls reuse it)")
    return _run(prog, env, seed, out_nodes, reads), None


def _eager(request, env, seed, out_nodes, batch, remat) -> WalkResult:
    return walk(Walker(request, env, seed, out_nodes, batch, remat), request.captured.graph)


def _compile(request, env, seed, out_nodes, batch, remat, reads):
    """(program, the first call's result, None), or (None, the eager result, why not) where no program
    can be used."""
    from torch.fx.experimental.proxy_tensor import make_fx
    t0 = time.perf_counter()
    nodes, leaves, specs = _env_leaves(env)
    side: Dict[str, Any] = {}

    def traced(*values):
        e = _env_from(nodes, specs, values[:len(leaves)])
        s = dict(zip(out_nodes, values[len(leaves):]))
        before = len(reads.items)
        res = walk(Walker(request, e, s, out_nodes, batch, remat), request.captured.graph)
        handed = reads.items[before:]
        del reads.items[before:]  # (handed over again from the program's outputs, below)
        flat, layout = _flatten(res)
        side.update(layout=layout, reads=[(kind, payload) for _, kind, payload in handed],
                    freed=[n for n in nodes if n not in e], n_out=len(flat))
        return flat + [t for t, _, _ in handed]

    values = leaves + [seed[n] for n in out_nodes]
    try:
        # (functionalized: no in-place op, out= op or view left, which a compiler lays out its own way)
        graph = make_fx(torch.func.functionalize(traced, remove="mutations_and_views"), tracing_mode="real")(*values)
    except Exception as e:  # noqa: BLE001 - any failure to trace: the walk runs eagerly, with the reason
        why = (f"compile=True: the walk ran eagerly: it could not be traced ({type(e).__name__}: "
               f"{str(e).splitlines()[0][:200]})")
        return None, _eager(request, env, seed, out_nodes, batch, remat), why
    constants = [n.target for n in graph.graph.nodes if n.op == "get_attr"]
    if constants:
        why = (f"compile=True: the walk ran eagerly: its trace holds {len(constants)} tensor(s) that are not forward "
               "values or the seed (a rule that reads a tensor of its own), which a later call would not see")
        return None, _eager(request, env, seed, out_nodes, batch, remat), why
    _views_as_reshapes(graph)
    fn = torch.compile(graph, dynamic=False)
    prog = _Program(fn, nodes, side["freed"], side["layout"], side["reads"], 0.0)
    try:
        result = _run(prog, env, seed, out_nodes, reads)  # (the compilation happens in this first call)
    except Exception as e:  # noqa: BLE001 - a compiler that fails: the walk runs eagerly, with the reason
        why = (f"compile=True: the walk ran eagerly: torch.compile failed on its program ({type(e).__name__}: "
               f"{str(e).splitlines()[0][:200]})")
        return None, _eager(request, env, seed, out_nodes, batch, remat), why
    prog.seconds = time.perf_counter() - t0
    return prog, result, None


def _views_as_reshapes(graph: torch.fx.GraphModule) -> None:
    """``aten.view`` nodes of the traced program as ``aten.reshape``: the trace recorded views of the eager
    run's strides, which a compiler that lays out intermediate tensors its own way need not keep (a reshape
    is the view where the strides allow it, a copy elsewhere: the same values)."""
    aten = torch.ops.aten
    for node in graph.graph.nodes:
        if node.op == "call_function" and node.target in (aten.view.default, aten._unsafe_view.default):
            node.target = aten.reshape.default
    graph.recompile()


def _run(prog: _Program, env, seed, out_nodes, reads) -> WalkResult:
    """Run ``prog`` on this call's forward values and seed; free what the walk frees, hand over what it
    hands over."""
    leaves = [t for n in prog.inputs for t in _tensors(env[n])]
    with torch.no_grad():
        out = prog.fn(*leaves, *[seed[n] for n in out_nodes])
    n_out = len(out) - len(prog.reads)
    for t, (kind, payload) in zip(out[n_out:], prog.reads):
        reads.items.append((t, kind, payload))
    for n in prog.freed:
        env.pop(n, None)
    return _unflatten(prog.layout, list(out[:n_out]))


def _tensors(value) -> List[torch.Tensor]:
    return [t for t in pytree.tree_leaves(value) if torch.is_tensor(t)]


def _env_leaves(env: Dict) -> tuple:
    """(the env's nodes, the tensors of their values in order, each value's structure with its tensors
    marked): a value that is a tuple of tensors (a node with several outputs) gives each tensor."""
    nodes, leaves, specs = [], [], []
    for n, v in env.items():
        flat, spec = pytree.tree_flatten(v)
        nodes.append(n)
        specs.append((spec, [torch.is_tensor(t) for t in flat], [None if torch.is_tensor(t) else t for t in flat]))
        leaves.extend(t for t in flat if torch.is_tensor(t))
    return nodes, leaves, specs


def _env_from(nodes, specs, values) -> Dict:
    """The env of :func:`_env_leaves` with its tensors replaced by ``values``, in order."""
    it = iter(values)
    env = {}
    for n, (spec, is_tensor, others) in zip(nodes, specs):
        env[n] = pytree.tree_unflatten([next(it) if t else o for t, o in zip(is_tensor, others)], spec)
    return env


def _flatten(res: WalkResult) -> Tuple[List[torch.Tensor], Any]:
    """The tensors of a :class:`WalkResult` in order, and what puts them back."""
    flat: List[torch.Tensor] = []

    def put(t):
        if t is None:
            return None
        flat.append(t)
        return len(flat) - 1
    c = res.conservation
    layout = {
        "relevance_at": [(n, put(t)) for n, t in res.relevance_at.items()],
        "input": put(res.input_relevance),
        "streams": [(k, put(t)) for k, t in res.stream_relevance.items()],
        "conservation": None if c is None else {
            "injected": put(c.injected), "input": put(c.input), "absorbed": put(c.absorbed),
            "absorbed_by": [(k, put(t)) for k, t in c.absorbed_by.items()],
            "blocks": [(b.name, put(b.relevance_in), put(b.relevance_out), put(b.absorbed)) for b in c.blocks],
            "preset": c.preset},
    }
    return flat, layout


def _unflatten(layout, flat: List[torch.Tensor]) -> WalkResult:
    def get(i):
        return None if i is None else flat[i]
    c = layout["conservation"]
    conservation = None if c is None else Conservation(
        injected=get(c["injected"]), input=get(c["input"]), absorbed=get(c["absorbed"]),
        absorbed_by={k: get(i) for k, i in c["absorbed_by"]},
        blocks=[BlockConservation(name, get(a), get(b), get(d)) for name, a, b, d in c["blocks"]], preset=c["preset"])
    return WalkResult({n: get(i) for n, i in layout["relevance_at"]}, conservation, get(layout["input"]),
                      {k: get(i) for k, i in layout["streams"]})
