"""Decompose an exported program node by node, instead of tracing the whole program again.

``ExportedProgram.run_decompositions`` re-traces every node of the program through functionalization
and the decomposition table, although on a transformer almost every node is kept whole (linear,
layer norm, views, additions: :data:`relprop.graph.export.KEEP_WHOLE` and the ops that have no
decomposition). On BERT-base that re-trace costs about twice the export itself. Here only the nodes
whose op the table (or the op's CompositeImplicitAutograd kernel) would rewrite are traced, one
small ``make_fx`` per distinct call (op, argument shapes, strides, dtypes and plain values: the 12
attention calls of BERT-base are one trace), and the traced pieces are spliced into the graph in
place of their node. The pieces are what ``run_decompositions`` makes of the same call with the same
table (scaled-dot-product attention becomes matmul → scale → mask → softmax → matmul; ``transpose``
a ``permute``; ``reshape`` a ``view`` or a ``clone`` and a view), so the graph is the same op for op.

It applies to a program that mutates nothing and holds only ATen ops; anything else (a custom or
higher-order op, a mutated buffer or input, an in-place op, a piece that needs a constant) returns
False before the graph is touched, and the caller runs the whole-program pass.
"""
from __future__ import annotations

import operator
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch.fx.experimental.proxy_tensor import make_fx

#: node meta entries that describe the value (made again for each piece); the rest (the module
#: stack, the source line) is copied from the decomposed node to every node of its piece
_VALUE_META = ("val", "tensor_meta", "example_value", "unbacked_bindings")


def _torch_internals():
    """The pieces of torch.export's own decomposition pass this module reuses (private API: ``None``
    where this torch has no such functions, and the caller runs the whole-program pass)."""
    try:
        from torch._export.utils import _collect_all_valid_cia_ops_for_aten_namespace
        from torch.export.exported_program import (_is_preservable_cia_op, _override_composite_implicit_decomp,
                                                   _special_op_to_preserve_cia)
    except ImportError:
        return None
    return (_override_composite_implicit_decomp, _special_op_to_preserve_cia, _is_preservable_cia_op,
            _collect_all_valid_cia_ops_for_aten_namespace)


def decompose_nodes(ep, table) -> bool:
    """Rewrite ``ep``'s graph in place as ``ep.run_decompositions(table)`` would, tracing only the
    nodes that change. ``table`` is a decomposition table of ``torch.export.default_decompositions()``
    kind (its ATen part is read without materializing other namespaces). Returns False, with the
    graph untouched, when the program is outside what this pass handles (see the module docstring)."""
    internals = _torch_internals()
    aten_table = getattr(table, "decomp_table", table)  # CustomDecompTable keeps its ATen entries there
    if internals is None or not isinstance(aten_table, dict):
        return False
    override, preserve, preservable, aten_cia_ops = internals
    sig = ep.graph_signature
    if getattr(sig, "buffers_to_mutate", None) or getattr(sig, "user_inputs_to_mutate", None):
        return False
    graph = ep.graph
    present = {n.target for n in graph.nodes if n.op == "call_function" and not _size_arithmetic(n)}
    if any(not isinstance(op, torch._ops.OpOverload) or op.namespace != "aten" for op in present):
        return False  # a custom or higher-order op: the whole-program pass knows its table entries
    # as run_decompositions: a CompositeImplicitAutograd op the table leaves out is kept whole, one it
    # names is decomposed with its entry (overriding every one of torch's ~500 costs more than the pass)
    cia = {op: preserve for op in aten_cia_ops() if op not in aten_table}
    cia.update({op: aten_table[op] for op in present if op in aten_table and preservable(op)})
    python_table = {op: fn for op, fn in aten_table.items() if op not in cia}
    plans: List[Tuple[torch.fx.Node, torch.fx.GraphModule]] = []
    traced: Dict[tuple, Optional[torch.fx.GraphModule]] = {}
    with override(cia):
        for node in graph.nodes:
            if node.op in ("placeholder", "output", "get_attr"):
                continue
            if node.op != "call_function":
                return False
            if _size_arithmetic(node):
                continue
            op = node.target
            if op._schema.is_mutable:
                return False
            if not _traceable(node):
                return False
            if not _may_change(op, cia, python_table, preserve):
                continue
            key = _call_key(node)
            if key is None:
                return False
            if key not in traced:
                traced[key] = _trace(node, python_table, cia)
            piece = traced[key]
            if piece is None:
                return False
            if _unchanged(piece, op):
                continue
            if not isinstance(piece_output(piece), torch.fx.Node) and \
                    any(u.target is not operator.getitem for u in node.users):
                return False
            plans.append((node, piece))
    for node, piece in plans:
        _splice(graph, node, piece)
    _merge_sizes(graph)
    graph.eliminate_dead_code()
    graph.lint()
    _rename_outputs(ep)
    ep.graph_module.recompile()
    return True


def _rename_outputs(ep) -> None:
    """The signature's output names after a decomposed node was an output (the output node now
    names the last node of its piece)."""
    outputs = pytree.tree_leaves(next(n for n in ep.graph.nodes if n.op == "output").args[0])
    specs = ep.graph_signature.output_specs
    if len(outputs) != len(specs):
        return
    for spec, out in zip(specs, outputs):
        if isinstance(out, torch.fx.Node) and hasattr(spec.arg, "name") and spec.arg.name != out.name:
            spec.arg.name = out.name


def _size_arithmetic(node: torch.fx.Node) -> bool:
    """An item of a node of several outputs, or arithmetic on sizes (``operator.floordiv`` of a
    ``sym_size``, Swin's window count): nothing to decompose."""
    if node.target is operator.getitem:
        return True
    if isinstance(node.target, torch._ops.OpOverload):
        return False
    return isinstance(node.meta.get("val"), (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool))


def _may_change(op, cia: dict, python_table: dict, preserve) -> bool:
    """Whether decomposition can rewrite ``op``: a table entry, or a CompositeImplicitAutograd kernel
    that the table does not preserve."""
    if op in python_table:
        return True
    entry = cia.get(op)
    if entry is not None:
        return entry is not preserve
    return torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd")


def _traceable(node: torch.fx.Node) -> bool:
    """Every tensor the node reads has a fake value from the export (the trace runs on those)."""
    for a in pytree.tree_leaves((node.args, node.kwargs)):
        if isinstance(a, torch.fx.Node):
            val = a.meta.get("val")
            if not isinstance(val, (torch.Tensor, torch.SymInt)):
                return False
        elif isinstance(a, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return False
    return True


def _call_key(node: torch.fx.Node) -> Optional[tuple]:
    """What decides the traced piece of a call: the op, its plain arguments and, per tensor argument,
    shape, strides, offset, dtype and device (``None`` for an argument this pass cannot key)."""
    leaves, spec = pytree.tree_flatten((node.args, node.kwargs))
    parts = []
    for a in leaves:
        if isinstance(a, torch.fx.Node):
            v = a.meta["val"]
            if isinstance(v, torch.SymInt):
                parts.append(("s", str(v)))
            else:
                parts.append(("t", tuple(map(str, v.shape)), tuple(map(str, v.stride())), str(v.storage_offset()),
                              v.dtype, str(v.device), v.requires_grad))
        elif a is None or isinstance(a, (bool, int, float, str, torch.dtype, torch.device, torch.layout,
                                         torch.memory_format)):
            parts.append(("c", type(a).__name__, repr(a)))
        else:
            return None
    return (node.target, str(spec), tuple(parts))


def _trace(node: torch.fx.Node, python_table: dict, cia: dict) -> Optional[torch.fx.GraphModule]:
    """The decomposed piece of one call, traced on the export's fake values of its arguments (their
    sizes symbolic where the program's are: a size the piece reads becomes a ``sym_size`` of its input)."""
    leaves, spec = pytree.tree_flatten((node.args, node.kwargs))
    where = [i for i, a in enumerate(leaves) if isinstance(a, torch.fx.Node)]
    fakes = [leaves[i].meta["val"] for i in where]  # the export's fake values (symbolic sizes and all)
    op = node.target

    def call(*tensors):
        filled = list(leaves)
        for i, t in zip(where, tensors):
            filled[i] = t
        args, kwargs = pytree.tree_unflatten(filled, spec)
        return op(*args, **kwargs)

    gm = _make_fx(call, fakes, python_table)
    # a piece that writes in place (adaptive pooling's decomposition restrides with as_strided_) or
    # holds a constant (get_attr) is left to the whole-program pass, which functionalizes and lifts them
    if gm is None or _mutates(gm) or any(n.op == "get_attr" or (_python_composite(n.target) and n.target not in cia)
                                         for n in gm.graph.nodes):
        return None
    return gm


def _python_composite(op) -> bool:
    """An op torch gives a Python CompositeImplicitAutograd kernel (``native_batch_norm``, which the
    whole-program pass rewrites as ``_native_batch_norm_legit``): left to that pass."""
    return isinstance(op, torch._ops.OpOverload) and torch._C.DispatchKey.CompositeImplicitAutograd in op.py_kernels


def _make_fx(fn, fakes, python_table) -> Optional[torch.fx.GraphModule]:
    try:
        return make_fx(fn, decomposition_table=python_table, tracing_mode="fake", _allow_non_fake_inputs=False)(*fakes)
    except Exception:  # noqa: BLE001 - any failure: the whole-program pass decides
        return None


def _mutates(gm: torch.fx.GraphModule) -> bool:
    return any(n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable
               for n in gm.graph.nodes)


def piece_output(piece: torch.fx.GraphModule):
    """The output argument of a traced piece (a node, or a tuple of them for an op of several outputs)."""
    return next(n for n in piece.graph.nodes if n.op == "output").args[0]


def _unchanged(piece: torch.fx.GraphModule, op) -> bool:
    """The piece is the call itself (one node of the same op on the same inputs)."""
    calls = [n for n in piece.graph.nodes if n.op == "call_function"]
    return len(calls) == 1 and calls[0].target is op


def _merge_sizes(graph: torch.fx.Graph) -> None:
    """One ``sym_size`` node per (tensor, axis): each piece reads the sizes it needs itself, where the
    whole-program pass reads each once."""
    seen: Dict[tuple, torch.fx.Node] = {}
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is torch.ops.aten.sym_size.int:
            key = (node.args, tuple(sorted(node.kwargs.items())))
            first = seen.setdefault(key, node)
            if first is not node:
                node.replace_all_uses_with(first)
                graph.erase_node(node)


def _splice(graph: torch.fx.Graph, node: torch.fx.Node, piece: torch.fx.GraphModule) -> None:
    """Put ``piece``'s nodes in place of ``node``: its placeholders bound to the node's tensor
    arguments in order, its output standing for the node's value (or, for an op of several
    outputs, for each ``getitem`` of it)."""
    leaves = [a for a in pytree.tree_leaves((node.args, node.kwargs)) if isinstance(a, torch.fx.Node)]
    inherited = {k: v for k, v in node.meta.items() if k not in _VALUE_META}
    env: Dict[torch.fx.Node, Any] = {}
    inputs = iter(leaves)
    out = None
    with graph.inserting_before(node):
        for p in piece.graph.nodes:
            if p.op == "placeholder":
                env[p] = next(inputs)
            elif p.op == "output":
                out = pytree.tree_map(lambda a: env[a] if isinstance(a, torch.fx.Node) else a, p.args[0])
            else:
                new = graph.node_copy(p, lambda a: env[a])
                new.meta = {**inherited, **{k: v for k, v in p.meta.items() if k in ("val", "tensor_meta")}}
                env[p] = new
    if isinstance(out, torch.fx.Node):
        node.replace_all_uses_with(out)
    else:
        for user in list(node.users):
            user.replace_all_uses_with(out[user.args[1]])
            graph.erase_node(user)
    graph.erase_node(node)
