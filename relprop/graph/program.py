"""A captured program: one decomposed ``torch.export`` graph and the inputs it accepts.

One export serves every input whose shapes fit its **pattern**: the batch axis is a named dynamic
dimension (``torch.export.Dim``) and every other axis of every input is exported with
``Dim.AUTO`` — dynamic where the model allows it (sequence lengths, image sizes of models that
take several), a fixed size where the model's code requires one (hidden sizes, colour channels,
the 224×224 of a ViT with fixed position embeddings). The program records, per user input, each
axis as a fixed size or a symbolic expression, and each symbol's valid range; :meth:`Program.match`
binds the symbols of a new input's shapes (the same symbol must get the same size everywhere,
within its range) or says that the input does not fit.

Node values (``node.meta["val"]``) are kept as plain descriptions (:class:`TensorMeta`: dtype,
device and a shape of ints and sympy expressions), not as fake tensors: they are what a
specialization (:mod:`relprop.graph.specialize`) turns into concrete shapes, and what the disk cache
(:mod:`relprop.graph.serialize`) writes. Nothing here holds a weight: parameters and buffers are read
from the model by name at each call.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Tuple

import sympy
import torch
import torch.fx
import torch.utils._pytree as pytree

#: the kinds of graph inputs a program binds (torch.export's InputKind, by name)
INPUT_KINDS = ("param", "buffer", "constant", "user")


@dataclasses.dataclass(frozen=True)
class TensorMeta:
    """What a node's value looks like: dtype, device and shape (ints and sympy expressions)."""

    dtype: torch.dtype
    device: str
    shape: Tuple[Any, ...]

    @property
    def symbols(self) -> set:
        return set().union(*(d.free_symbols for d in self.shape if isinstance(d, sympy.Expr)))


def describe(value: Any) -> Any:
    """The plain description of a node's ``meta["val"]``: a :class:`TensorMeta` for a (fake)
    tensor, a sympy expression for a symbolic int/float/bool, plain values as they are, lists and
    tuples element-wise."""
    if isinstance(value, torch.Tensor):
        return TensorMeta(value.dtype, str(value.device), tuple(_dim(s) for s in value.shape))
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return value.node.expr
    if isinstance(value, (list, tuple)):
        return type(value)(describe(v) for v in value)
    return value


def _dim(s) -> Any:
    if isinstance(s, torch.SymInt):
        expr = s.node.expr
        return int(expr) if expr.is_Integer else expr
    return int(s)


@dataclasses.dataclass
class InputPattern:
    """One user input of a program: a tensor (dtype, device type, axes) or a plain value."""

    tensor: bool
    dtype: Optional[torch.dtype] = None
    device: Optional[str] = None
    dims: Tuple[Any, ...] = ()  # int, or a sympy expression of the program's symbols
    value: Any = None  # repr of a plain value (None, a bool flag, a string)

    @classmethod
    def of(cls, value: Any, meta: Any) -> "InputPattern":
        if torch.is_tensor(value):
            return cls(True, value.dtype, value.device.type, tuple(meta.shape) if meta is not None else ())
        return cls(False, value=_plain(value))


def _plain(v: Any) -> str:
    """What a program records of a non-tensor input, which torch.export fixes as a constant: the value of
    a number, string, None, or list/tuple of them (LLaVA-NeXT's image_sizes as ints), so that equal
    values match; the identity of anything else."""
    if isinstance(v, (int, float, bool, str, type(None))):
        return repr(v)
    if type(v) in (list, tuple):
        items = [_plain(e) for e in v]
        if not any(i.startswith("<") for i in items):
            return f"{type(v).__name__}({', '.join(items)})"
    return f"<{type(v).__name__} {id(v)}>"


@dataclasses.dataclass
class Program:
    """A decomposed exported graph, what it binds, and the input shapes it accepts.

    ``graph`` holds the nodes with their module provenance (``nn_module_stack``); their values are
    described in ``metas`` (node name -> :func:`describe` of its value). ``specs`` lists the
    placeholders in order as (node name, kind, target): kind is one of :data:`INPUT_KINDS`, target
    the parameter/buffer/constant name or the forward's keyword. ``constants`` holds the tensors the
    model's code creates (lifted by torch.export), never parameters or buffers.
    """

    graph: torch.fx.Graph
    metas: Dict[str, Any]
    specs: List[Tuple[str, str, str]]
    constants: Dict[str, torch.Tensor]
    out_spec: Any
    primary: str
    patterns: Dict[str, InputPattern]
    #: symbol name -> (lowest, highest) size it may take (None: unbounded above)
    ranges: Dict[str, Tuple[int, Optional[int]]]
    #: the symbol of the batch axis (None: the batch is fixed, a static capture)
    batch_symbol: Optional[str]
    #: the size the batch symbol stood for during export (analyses evaluate guards with it)
    batch_hint: int = 2
    #: the model's parameter dtypes and devices when it was captured
    state: tuple = ()
    #: captured from a model dispatched by accelerate with offloaded weights
    #: (:mod:`relprop.graph.dispatch`): its weights are read on demand, and it never goes to disk
    offloaded: bool = False
    #: the export attempt that made it (:data:`relprop.graph.export.ATTEMPTS`, or
    #: :data:`relprop.graph.export.FIRST_CALL_SIZES`; "" when not known, e.g. an older disk cache file)
    exported_as: str = ""

    @property
    def user_names(self) -> List[str]:
        return [t for _, kind, t in self.specs if kind == "user"]

    @property
    def batch_dynamic(self) -> bool:
        return self.batch_symbol is not None

    def symbols(self) -> List[str]:
        """Every symbol of the user inputs' axes, the batch excepted, sorted by name."""
        names = set()
        for p in self.patterns.values():
            for d in p.dims:
                if isinstance(d, sympy.Expr):
                    names |= {s.name for s in d.free_symbols}
        names.discard(self.batch_symbol)
        return sorted(names)

    def dynamic_axes(self) -> Dict[str, List[int]]:
        """Input name -> its axes that are not fixed (the batch included), e.g. ``{"input_ids": [0, 1]}``."""
        return {k: [i for i, d in enumerate(p.dims) if isinstance(d, sympy.Expr)]
                for k, p in self.patterns.items() if p.tensor}

    def same_structure(self, kwargs: Dict[str, Any], primary: str, state: tuple) -> bool:
        """Whether ``kwargs`` explained onto ``primary`` are inputs of this program's kind whatever their
        sizes: the same names, tensors and plain values, dtypes, devices, ranks and parameter state."""
        if primary != self.primary or state != self.state or set(kwargs) != set(self.patterns):
            return False
        for name, pattern in self.patterns.items():
            v = kwargs[name]
            if pattern.tensor != torch.is_tensor(v):
                return False
            if not pattern.tensor:
                if _plain(v) != pattern.value:
                    return False
            elif v.dtype != pattern.dtype or v.device.type != pattern.device or v.dim() != len(pattern.dims):
                return False
        return True

    def match(self, kwargs: Dict[str, Any], primary: str, state: tuple) -> Optional[Dict[str, int]]:
        """The size of each symbol for inputs ``kwargs`` explained onto ``primary`` (the batch's
        included), or None when this program does not take them: other input names, dtypes,
        devices, ranks, plain values or parameter state; a fixed axis of another size; a symbol
        that would need two sizes or a size outside its range."""
        if not self.same_structure(kwargs, primary, state):
            return None
        sizes: Dict[sympy.Symbol, int] = {}
        compound = []
        for name, pattern in self.patterns.items():
            if not pattern.tensor:
                continue
            for d, s in zip(pattern.dims, kwargs[name].shape):
                if isinstance(d, int):
                    if d != s:
                        return None
                elif isinstance(d, sympy.Symbol):
                    if sizes.setdefault(d, int(s)) != s:
                        return None
                else:
                    compound.append((d, int(s)))
        bound = {k: sympy.Integer(v) for k, v in sizes.items()}
        for d, s in compound:  # e.g. an axis exported as 2*s0: checked once its symbols are known
            if not d.free_symbols <= set(sizes) or int(d.xreplace(bound)) != s:
                return None
        out = {}
        for sym, s in sizes.items():
            lo, hi = self.ranges.get(sym.name, (0, None))
            if s < lo or (hi is not None and s > hi):
                return None
            out[sym.name] = s
        return out

    def flat_outputs(self, values: list) -> Any:
        """The program's output structure from its flat output values."""
        return pytree.tree_unflatten(values, self.out_spec)


def _bound(v, default):
    """A finite integer bound of a value range, else ``default`` (torch writes unbounded as ±oo)."""
    try:
        return int(v) if bool(v.is_Integer) else default
    except (TypeError, ValueError, OverflowError):
        return default


def symbol_ranges(range_constraints: dict) -> Dict[str, Tuple[int, Optional[int]]]:
    """``ExportedProgram.range_constraints`` as symbol name -> (lower, upper or None)."""
    out = {}
    for sym, vr in range_constraints.items():
        if not isinstance(sym, sympy.Symbol):
            continue
        out[sym.name] = (_bound(vr.lower, 0), _bound(vr.upper, None))
    return out
