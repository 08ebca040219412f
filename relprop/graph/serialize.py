"""A :class:`~relprop.graph.program.Program` as bytes and back, without a weight and without code.

torch's own serializer (``torch.export.save``) writes the weights and takes several seconds to load
a BERT-base graph (it rebuilds fake tensors with symbolic shapes for every node). relprop needs
less: the nodes (op, arguments, module provenance), the symbolic description of each node's value,
the placeholders, the output structure, the tensors the model's code creates, and the input
pattern. This module writes exactly that as plain data (strings, numbers, lists, tensors), read back
with ``torch.load(weights_only=True)``, which executes nothing. Ops are resolved by name from
``torch.ops``; the few Python functions a graph calls (``operator.getitem``, ``operator.mul``, ...)
only from :data:`PY_MODULES`; size expressions are rebuilt from a small tree of sympy and torch's
size functions (:data:`SIZE_FUNCTIONS`). Anything else makes :func:`dumps` raise
:class:`NotSerializable`, and the program is then simply not cached on disk.
"""
from __future__ import annotations

import importlib
import io
from typing import Any, Dict, List

import sympy
import torch
import torch.fx
import torch.utils._pytree as pytree
import torch.utils._sympy.functions as size_functions

from .program import InputPattern, Program, TensorMeta

#: the version of this format; a file of another version is not read
FORMAT = 1
#: modules whose functions a graph node may call by name (shape arithmetic, tuple indexing)
PY_MODULES = ("_operator", "operator", "math", "builtins", "torch", "torch.fx.experimental.sym_node")
#: sympy classes and torch's size functions an axis' size may be built of
SIZE_FUNCTIONS = {name: getattr(size_functions, name) for name in dir(size_functions)
                  if isinstance(getattr(size_functions, name), type)
                  and issubclass(getattr(size_functions, name), sympy.Basic)}
SIZE_FUNCTIONS.update({"Max": sympy.Max, "Min": sympy.Min, "Mod": sympy.Mod, "floor": sympy.floor,
                       "ceiling": sympy.ceiling, "Abs": sympy.Abs})


class NotSerializable(Exception):
    """The program holds something this format does not write (it is then not cached on disk)."""


# ------------------------------------------------------------------------------------------ writing

def dumps(program: Program, key: Any) -> bytes:
    """``program`` as bytes, with ``key`` (plain data: what the program was made for) kept beside it
    so that a reader can check it got the file it asked for."""
    nodes = []
    for n in program.graph.nodes:
        stack = n.meta.get("nn_module_stack") or {}
        nodes.append({
            "name": n.name, "op": n.op, "target": _target(n),
            "args": _value(n.args), "kwargs": _value(dict(n.kwargs)),
            "stack": [(k, p, t if isinstance(t, str) else getattr(t, "__qualname__", str(t)))
                      for k, (p, t) in stack.items()],
            "meta": _meta(program.metas.get(n.name)),
        })
    try:
        out_spec = pytree.treespec_dumps(program.out_spec)
    except Exception as e:  # noqa: BLE001 - an output type pytree cannot name
        raise NotSerializable(f"output structure: {e}") from None
    data = {
        "format": FORMAT, "key": key, "nodes": nodes, "specs": [list(s) for s in program.specs],
        "constants": dict(program.constants), "out_spec": out_spec, "primary": program.primary,
        "patterns": {k: _pattern(p) for k, p in program.patterns.items()},
        "ranges": {k: list(v) for k, v in program.ranges.items()},
        "batch_symbol": program.batch_symbol, "batch_hint": program.batch_hint,
        "exported_as": program.exported_as,
        "state": [list(s) for s in program.state],
    }
    buf = io.BytesIO()
    torch.save(data, buf)
    return buf.getvalue()


def _target(n: torch.fx.Node):
    t = n.target
    if n.op in ("placeholder", "output", "get_attr"):
        if n.op == "get_attr":
            raise NotSerializable(f"get_attr node {n.name}")
        return ["str", t]
    if isinstance(t, torch._ops.OpOverload):
        return ["op", t.namespace, t._opname, t._overloadname]
    module = getattr(t, "__module__", None)
    name = getattr(t, "__qualname__", None) or getattr(t, "__name__", None)
    if module in PY_MODULES and name and "<" not in name:
        return ["py", module, name]
    raise NotSerializable(f"node {n.name} calls {t!r}")


def _value(v: Any):
    if isinstance(v, torch.fx.Node):
        return ["node", v.name]
    if isinstance(v, (bool, int, float, str)) or v is None:
        return v
    if isinstance(v, (list, tuple)):
        return ["list" if isinstance(v, list) else "tuple", [_value(x) for x in v]]
    if isinstance(v, dict):
        return ["dict", {str(k): _value(x) for k, x in v.items()}]
    if isinstance(v, torch.dtype):
        return ["dtype", str(v).replace("torch.", "")]
    if isinstance(v, torch.device):
        return ["device", str(v)]
    if isinstance(v, torch.layout):
        return ["layout", str(v).replace("torch.", "")]
    if isinstance(v, torch.memory_format):
        return ["memory_format", str(v).replace("torch.", "")]
    raise NotSerializable(f"argument {v!r} of type {type(v).__name__}")


def _meta(m: Any):
    if isinstance(m, TensorMeta):
        return ["tensor", str(m.dtype).replace("torch.", ""), m.device, [_size(d) for d in m.shape]]
    if isinstance(m, sympy.logic.boolalg.Boolean):
        return ["condition"]
    if isinstance(m, sympy.Expr):
        return ["size", _size(m)]
    if isinstance(m, (list, tuple)):
        return ["list" if isinstance(m, list) else "tuple", [_meta(x) for x in m]]
    if isinstance(m, (bool, int, float, str)) or m is None:
        return m
    if isinstance(m, torch.dtype):
        return ["dtype", str(m).replace("torch.", "")]
    raise NotSerializable(f"node value {m!r} of type {type(m).__name__}")


def _size(e: Any):
    """A size expression as a tree: ``["s", name]``, ``["i", int]``, ``["q", p, q]``, ``["f", float]``,
    ``["+", [...]]``, ``["*", [...]]``, ``["^", base, exp]``, ``["fn", name, [...]]``."""
    if isinstance(e, int):
        return ["i", int(e)]
    if isinstance(e, sympy.Symbol):
        return ["s", e.name]
    if isinstance(e, sympy.Integer):
        return ["i", int(e)]
    if isinstance(e, sympy.Rational):
        return ["q", int(e.p), int(e.q)]
    if isinstance(e, sympy.Float):
        return ["f", float(e)]
    if isinstance(e, sympy.Add):
        return ["+", [_size(a) for a in e.args]]
    if isinstance(e, sympy.Mul):
        return ["*", [_size(a) for a in e.args]]
    if isinstance(e, sympy.Pow):
        return ["^", _size(e.base), _size(e.exp)]
    name = type(e).__name__
    if SIZE_FUNCTIONS.get(name) is type(e):
        return ["fn", name, [_size(a) for a in e.args]]
    raise NotSerializable(f"size expression {e} ({name})")


def _pattern(p: InputPattern):
    return [p.tensor, str(p.dtype).replace("torch.", "") if p.dtype is not None else None, p.device,
            [_size(d) for d in p.dims], p.value]


# ------------------------------------------------------------------------------------------ reading

def loads(data: bytes) -> tuple:
    """``(key, program)`` from bytes written by :func:`dumps`. Raises on any malformed content."""
    raw = torch.load(io.BytesIO(data), weights_only=True)
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise ValueError("not a relprop program of this format")
    symbols: Dict[str, sympy.Symbol] = {}
    graph = torch.fx.Graph()
    made: Dict[str, torch.fx.Node] = {}
    renamed: Dict[str, str] = {}
    metas = {}
    for rec in raw["nodes"]:
        args = _read_value(rec["args"], made)
        kwargs = _read_value(rec["kwargs"], made)
        target = _read_target(rec["target"])
        if rec["op"] == "output":
            node = graph.output(args[0])
        else:
            node = graph.create_node(rec["op"], target, tuple(args), kwargs, name=rec["name"])
        renamed[rec["name"]] = node.name  # fx may rename (it avoids builtins such as `input`)
        if rec["stack"]:
            node.meta["nn_module_stack"] = {k: (p, t) for k, p, t in rec["stack"]}
        metas[node.name] = _read_meta(rec["meta"], symbols)
        made[rec["name"]] = node
    patterns = {}
    for k, (tensor, dtype, device, dims, value) in raw["patterns"].items():
        patterns[k] = InputPattern(bool(tensor), _dtype(dtype) if dtype is not None else None, device,
                                   tuple(_read_dim(d, symbols) for d in dims), value)
    program = Program(
        graph, metas, [(renamed.get(s[0], s[0]),) + tuple(s[1:]) for s in raw["specs"]], dict(raw["constants"]),
        pytree.treespec_loads(raw["out_spec"]), raw["primary"], patterns,
        {k: (v[0], v[1]) for k, v in raw["ranges"].items()}, raw["batch_symbol"], int(raw["batch_hint"]),
        tuple(tuple(s) for s in raw["state"]), exported_as=raw.get("exported_as", ""))
    return raw["key"], program


def _read_target(t: List):
    kind = t[0]
    if kind == "str":
        return t[1]
    if kind == "op":
        _, namespace, name, overload = t
        return getattr(getattr(getattr(torch.ops, namespace), name), overload)
    if kind == "py":
        _, module, qualname = t
        if module not in PY_MODULES:
            raise ValueError(f"function of module {module} refused")
        obj = importlib.import_module(PY_MODULES[PY_MODULES.index(module)])  # only these modules
        for part in qualname.split("."):
            obj = getattr(obj, part)
        if not callable(obj):
            raise ValueError(f"{module}.{qualname} is not callable")
        return obj
    raise ValueError(f"unknown target kind {kind!r}")


def _read_value(v: Any, made: Dict[str, torch.fx.Node]):
    if not isinstance(v, list):
        return v
    kind = v[0]
    if kind == "node":
        return made[v[1]]
    if kind == "list":
        return [_read_value(x, made) for x in v[1]]
    if kind == "tuple":
        return tuple(_read_value(x, made) for x in v[1])
    if kind == "dict":
        return {k: _read_value(x, made) for k, x in v[1].items()}
    if kind == "dtype":
        return _dtype(v[1])
    if kind == "device":
        return torch.device(v[1])
    if kind == "layout":
        return _attr(v[1], torch.layout)
    if kind == "memory_format":
        return _attr(v[1], torch.memory_format)
    raise ValueError(f"unknown argument kind {kind!r}")


def _dtype(name: str) -> torch.dtype:
    return _attr(name, torch.dtype)


def _attr(name: str, kind: type):
    v = getattr(torch, name)
    if not isinstance(v, kind):
        raise ValueError(f"torch.{name} is not a {kind.__name__}")
    return v


def _read_meta(m: Any, symbols: Dict[str, sympy.Symbol]):
    if not isinstance(m, list):
        return m
    kind = m[0]
    if kind == "tensor":
        return TensorMeta(_dtype(m[1]), m[2], tuple(_read_dim(d, symbols) for d in m[3]))
    if kind == "condition":
        return sympy.true
    if kind == "size":
        return _read_size(m[1], symbols)
    if kind == "list":
        return [_read_meta(x, symbols) for x in m[1]]
    if kind == "tuple":
        return tuple(_read_meta(x, symbols) for x in m[1])
    if kind == "dtype":
        return _dtype(m[1])
    raise ValueError(f"unknown value kind {kind!r}")


def _read_dim(d: List, symbols: Dict[str, sympy.Symbol]):
    e = _read_size(d, symbols)
    return int(e) if e.is_Integer else e


def _read_size(t: List, symbols: Dict[str, sympy.Symbol]) -> sympy.Expr:
    kind = t[0]
    if kind == "s":
        if t[1] not in symbols:
            symbols[t[1]] = sympy.Symbol(t[1], integer=True, positive=True)
        return symbols[t[1]]
    if kind == "i":
        return sympy.Integer(int(t[1]))
    if kind == "q":
        return sympy.Rational(int(t[1]), int(t[2]))
    if kind == "f":
        return sympy.Float(float(t[1]))
    if kind == "+":
        return sympy.Add(*(_read_size(a, symbols) for a in t[1]))
    if kind == "*":
        return sympy.Mul(*(_read_size(a, symbols) for a in t[1]))
    if kind == "^":
        return sympy.Pow(_read_size(t[1], symbols), _read_size(t[2], symbols))
    if kind == "fn":
        fn = SIZE_FUNCTIONS.get(t[1])
        if fn is None:
            raise ValueError(f"size function {t[1]!r} refused")
        return fn(*(_read_size(a, symbols) for a in t[2]))
    raise ValueError(f"unknown size kind {kind!r}")
