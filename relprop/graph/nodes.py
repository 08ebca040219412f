"""Helpers on the nodes of a captured graph, written once for every layer above.

* **provenance** — which module of the model a node came from (``nn_module_stack``);
* **outputs** — the output node and the live nodes the program returns;
* **the relevance path** — the one traversal from the outputs back along the arguments that rules
  give relevance to (the engine checks rules on it, the fast path plans its replacements on it,
  the coverage report labels it);
* **the node evaluator** — computing one node from the values of its arguments.
"""
from __future__ import annotations

import operator
from typing import Any, Callable, Dict, Iterable, List, Optional

import torch
import torch.fx
import torch.utils._pytree as pytree

from .torch_fixes import ELEMENTWISE, any_pending, broadcast_fill, pending_eq, pending_not, safe_target, where_selecting


_aten = torch.ops.aten
#: ops that produce a constant even from live inputs (they only read the input's shape/dtype)
CONSTANT_PRODUCING = frozenset({
    _aten.full_like.default, _aten.zeros_like.default, _aten.ones_like.default, _aten.empty_like.default,
    _aten.new_zeros.default, _aten.new_ones.default, _aten.new_full.default, _aten.new_empty.default,
    _aten.rand_like.default, _aten.randn_like.default, _aten.scalar_tensor.default, _aten.full.default,
    _aten.zeros.default, _aten.ones.default, _aten.arange.default, _aten.arange.start,
    _aten.arange.start_step, _aten.empty.memory_format, _aten.sym_size.int,
})


# ------------------------------------------------------------------------------------------ provenance

def module_path(node: torch.fx.Node) -> str:
    """The innermost ``nn_module_stack`` entry of ``node`` ('' if none), e.g. ``blocks.3.attn.qkv``."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path, _ = list(stack.values())[-1]
    return _clean_path(path)


def module_call(node: torch.fx.Node) -> str:
    """The innermost ``nn_module_stack`` key of ``node`` ('' if none): one call of a module. A module
    called twice (LXMERT's cross-attention, used in both directions) has one path and two keys (the
    second ends in ``@1``)."""
    stack = node.meta.get("nn_module_stack") or {}
    return list(stack.keys())[-1] if stack else ""


def module_type(node: torch.fx.Node) -> str:
    """The class name of the innermost module ``node`` came from (``"top level"`` if none)."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return "top level"
    _, typ = list(stack.values())[-1]
    return typ if isinstance(typ, str) else getattr(typ, "__qualname__", str(typ))


def module_paths(node: torch.fx.Node) -> List[str]:
    """Every enclosing module path of ``node``, outermost first."""
    stack = node.meta.get("nn_module_stack") or {}
    return [_clean_path(p) for p, _ in stack.values()]


def _clean_path(path: str) -> str:
    # non-strict export writes paths like "L['self'].blocks[3].attn" in some versions
    if path.startswith("L['self']"):
        path = path[len("L['self']"):].lstrip(".")
        path = path.replace("[", ".").replace("]", "").replace("'", "")
    return path


# ------------------------------------------------------------------------------------------- outputs

def output_node(graph: torch.fx.Graph) -> torch.fx.Node:
    """The graph's ``output`` node (the last node of an exported graph)."""
    for node in reversed(graph.nodes):
        if node.op == "output":
            return node
    raise ValueError("the graph has no output node")


def output_leaves(graph: torch.fx.Graph) -> list:
    """The flattened entries of the program's output (nodes, and constants such as None)."""
    return pytree.tree_leaves(output_node(graph).args[0])


def live_outputs(graph: torch.fx.Graph, live: Iterable[torch.fx.Node]) -> List[torch.fx.Node]:
    """The input-dependent nodes the program returns, without repeats, in output order."""
    live = live if isinstance(live, (set, frozenset, dict)) else set(live)
    return list(dict.fromkeys(n for n in output_leaves(graph) if isinstance(n, torch.fx.Node) and n in live))


def output_values(graph: torch.fx.Graph, out_spec, value: Callable[[torch.fx.Node], Any]) -> Any:
    """The program's output structure with every node replaced by ``value(node)``."""
    flat = [value(n) if isinstance(n, torch.fx.Node) else n for n in output_leaves(graph)]
    return pytree.tree_unflatten(flat, out_spec)


# ---------------------------------------------------------------------------------- relevance path

def relevance_path(graph: torch.fx.Graph, live, sources, rule_of: Callable[[torch.fx.Node], Optional[Any]],
                   through_missing: bool = False) -> List[torch.fx.Node]:
    """The nodes relevance reaches, in the order a depth-first walk from the outputs visits them.

    From the live outputs back: a source (pixels, an embedding lookup) or a placeholder ends a
    branch; an element of a list output (``getitem``) leads to the list; any other node leads to
    its live arguments except the positions its rule declares in ``no_relevance_to`` (the divisor
    of a normalization), or to the nodes its rule declares in ``operands`` (a rule that explains a
    whole subgraph, e.g. an element-wise function written out op by op, applied to its input).
    ``rule_of(node)`` returns the node's rule (a :class:`relprop.rules.spec.RuleSpec`, whose
    ``no_relevance_to`` and ``operands`` fields are read here), or None when it has none: such a
    node is on the path but the walk does not go past it, unless ``through_missing`` (the coverage
    report), which goes on as if relevance reached every live argument of it, so that the ops
    upstream of a missing one are labelled too.
    """
    sources = set(sources)
    stack = [n for n in output_leaves(graph) if isinstance(n, torch.fx.Node) and n in live]
    seen: Dict[torch.fx.Node, None] = {}
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen[node] = None
        if node in sources or node.op != "call_function":
            continue
        if node.target is operator.getitem:
            stack.append(node.args[0])
            continue
        spec = rule_of(node)
        if spec is None and not through_missing:
            continue
        blocked = spec.no_relevance_to if spec is not None else ()
        operands = spec.operands if spec is not None else None  # a rule applied to other nodes than the arguments
        for i, arg in enumerate(node.args if operands is None else operands):
            if i in blocked:
                continue
            stack.extend(m for m in pytree.tree_leaves(arg) if isinstance(m, torch.fx.Node) and m in live)
    return list(seen)


# --------------------------------------------------------------------------------------- evaluation

#: the floating dtypes :func:`evaluate` computes in ``compute`` precision instead
HALF_DTYPES = (torch.float16, torch.bfloat16)
#: ops whose flag converts half-precision input to float32 output (meaningless in float32 precision)
_HALF_TO_FLOAT = {torch.ops.aten._softmax.default: 2, torch.ops.aten._log_softmax.default: 2}


def evaluate(node: torch.fx.Node, value: Callable[[torch.fx.Node], Any], fn: Optional[Callable] = None,
             compute: Optional[torch.dtype] = None) -> Any:
    """The value of ``node`` computed from ``value(arg)`` of each argument node, by ``node.target``
    (or by ``fn``, a replacement that takes the same arguments). The op runs through
    :func:`~relprop.graph.torch_fixes.safe_target`; a ``full_like`` or ``where`` of the decomposed
    safe softmax runs without its copy, and its row test without boolean copies, where the node's
    users allow it (:data:`_BY_USE`). With ``compute`` (float32), a model in half precision is
    evaluated in that precision: its half-precision tensors (parameters, buffers, inputs) are cast
    for the op and the half dtypes the graph names (casts, created tensors, dtype checks) become
    ``compute``."""
    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), value)
    if compute is not None:
        args, kwargs = pytree.tree_map(lambda v: _in_precision(v, compute), (args, kwargs))
        flag = _HALF_TO_FLOAT.get(node.target)
        if flag is not None and len(args) > flag and args[flag] is True:
            args = args[:flag] + (False,) + args[flag + 1:]
    if fn is None and node.target in _BY_USE:
        fn = _BY_USE[node.target](node)
    return (fn or safe_target(node.target))(*args, **kwargs)


def _in_precision(v: Any, compute: torch.dtype) -> Any:
    if torch.is_tensor(v):
        return v.to(compute) if v.dtype in HALF_DTYPES else v
    if isinstance(v, torch.dtype) and v in HALF_DTYPES:
        return compute
    return v


#: ops of the safe softmax that an exported SDPA decomposes into (``where(row all masked,
#: full_like(A, 0), A)``, the rows tested by ``any(logical_not(eq(scores, c)), -1)``) evaluated
#: without their attention-sized copies when the graph around the node allows it (on long inputs
#: each copy is fresh memory the kernel faults in page by page)
_FULL_LIKE, _WHERE = torch.ops.aten.full_like.default, torch.ops.aten.where.self


def _memo(node: torch.fx.Node, key: str, test: Callable[[torch.fx.Node], bool]) -> bool:
    flag = node.meta.get(key)
    if flag is None:
        flag = node.meta[key] = bool(test(node))
    return flag


def _fill_read_elementwise(node: torch.fx.Node) -> bool:
    """Every user of the ``full_like`` node is an element-wise op of
    :data:`~relprop.graph.torch_fixes.ELEMENTWISE` (so a broadcast scalar reads the same)."""
    return bool(node.users) and all(u.op == "call_function" and u.target in ELEMENTWISE for u in node.users)


def _no_other_gradient(node: torch.fx.Node) -> bool:
    """Each operand of the ``where`` node is computed by the graph and feeds no other op whose
    output is differentiable (only constant producers and boolean tests): the ``where`` may then be the
    operand it selects, also under autograd."""
    for operand in node.args[1:3]:
        if not isinstance(operand, torch.fx.Node) or operand.op != "call_function":
            return False
        for u in operand.users:
            if u is node or u.target in CONSTANT_PRODUCING:
                continue
            v = u.meta.get("val")
            if not (torch.is_tensor(v) and not v.is_floating_point() and not v.is_complex()):
                return False
    return True


_EQ, _NOT, _ANY = torch.ops.aten.eq.Scalar, torch.ops.aten.logical_not.default, torch.ops.aten.any.dim


def _only_user(node: torch.fx.Node, target) -> Optional[torch.fx.Node]:
    users = list(node.users)
    return users[0] if len(users) == 1 and users[0].op == "call_function" and users[0].target is target else None


def _row_test(node: torch.fx.Node) -> bool:
    """``node`` is the ``eq`` of the safe softmax's row test ``any(logical_not(eq(x, c)), dim)``,
    read by nothing else: its value and the ``logical_not``'s may be deferred to the ``any``
    (:func:`~relprop.graph.torch_fixes.any_pending`)."""
    negated = _only_user(node, _NOT)
    return negated is not None and _only_user(negated, _ANY) is not None


_BY_USE: Dict[Any, Callable[[torch.fx.Node], Optional[Callable]]] = {
    _FULL_LIKE: lambda n: broadcast_fill if _memo(n, "relprop_broadcast_fill", _fill_read_elementwise) else None,
    _WHERE: lambda n: where_selecting if _memo(n, "relprop_where_selects", _no_other_gradient) else None,
    _EQ: lambda n: pending_eq if _memo(n, "relprop_row_test", _row_test) else None,
    # a deferred value reaches these two only through the pattern above; any other value runs the op
    _NOT: lambda n: pending_not,
    _ANY: lambda n: any_pending,
}


def is_live(x, live):
    """Per positional argument: True if it is a live node, False otherwise; lists element-wise."""
    if isinstance(x, torch.fx.Node):
        return x in live
    if isinstance(x, (list, tuple)):
        return [is_live(e, live) for e in x]
    return False


# --------------------------------------------------------------------------------------- reachability

def ancestors(starts: Iterable[torch.fx.Node], within) -> set:
    """``starts`` and every node of ``within`` they depend on through nodes of ``within``."""
    seen = set(starts)
    stack = list(seen)
    while stack:
        for m in stack.pop().all_input_nodes:
            if m in within and m not in seen:
                seen.add(m)
                stack.append(m)
    return seen


def descendants(starts: Iterable[torch.fx.Node], within) -> set:
    """``starts`` and every node of ``within`` that depends on them through nodes of ``within``."""
    seen = set(starts)
    stack = list(seen)
    while stack:
        for u in stack.pop().users:
            if u in within and u not in seen:
                seen.add(u)
                stack.append(u)
    return seen
