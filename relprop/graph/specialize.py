"""One program, specialized to the sizes of one input: a copy of its graph with concrete shapes.

A program exported with dynamic axes (:mod:`relprop.graph.program`) runs on every input that fits
its pattern: its nodes compute their sizes at run time (``sym_size`` nodes). What relprop learns
*about* the graph before running it — the attention blocks and their query and key counts, the
patch grid, where the first block's tokens come from, window layouts (:mod:`relprop.graph.analysis`)
— is decided on the shapes of one input. Deciding it on symbolic sizes would let a comparison such
as "197 tokens?" be answered from the sizes seen during export, for every later input, without a
word. So each new input size gets its own copy of the graph whose nodes carry concrete shapes
(``meta["val"]``: storage-less tensors on the ``meta`` device), and the analysis reads that copy.

The batch axis is the exception: a specialization serves every batch size. Its nodes show the batch
as the size it had during export (``Program.batch_hint``), and which axis of each node indexes
samples — the batch symbol times a constant, e.g. ``[batch·heads, T, T]`` — is read from the
program's symbolic descriptions (:func:`batch_axes`), never from the hint.

A specialization costs a graph copy and the analysis (milliseconds to a few tenths of a second);
the export (seconds) is shared.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import sympy
import torch
import torch.fx

from .program import Program, TensorMeta


class Concretizer:
    """Values of a program's nodes at given sizes: storage-less ``meta`` tensors of concrete shape
    (equal descriptions give the same read-only tensor) and plain ints."""

    def __init__(self, program: Program):
        self.program = program
        self._tensors: Dict[Tuple, torch.Tensor] = {}

    def value(self, meta: Any, sizes: Dict[str, int]) -> Any:
        """The value described by ``meta`` at ``sizes`` (symbol name -> size; the batch symbol at
        the program's batch hint)."""
        if isinstance(meta, TensorMeta):
            shape = tuple(self.size(d, sizes) for d in meta.shape)
            key = (meta.dtype, shape)
            t = self._tensors.get(key)
            if t is None:
                t = self._tensors[key] = torch.empty(shape, dtype=meta.dtype, device="meta")
            return t
        if isinstance(meta, sympy.logic.boolalg.Boolean):
            return None  # a symbolic condition (a runtime assert's argument): not read by the analysis
        if isinstance(meta, sympy.Expr):
            if any(self._unbacked(s.name, sizes) for s in meta.free_symbols):
                return None  # a data-dependent scalar (e.g. a check on how many image placeholders there are)
            return self.size(meta, sizes)
        if isinstance(meta, (list, tuple)):
            return type(meta)(self.value(m, sizes) for m in meta)
        return meta

    def size(self, d: Any, sizes: Dict[str, int]) -> Any:
        """The size of an axis (an int, or an expression of the program's symbols) at ``sizes``."""
        if isinstance(d, int):
            return d
        e = d.xreplace({s: sympy.Integer(self._size_of(s.name, sizes)) for s in d.free_symbols})
        if e.is_Integer:
            return int(e)
        if e.is_Number:
            return float(e)
        raise ValueError(f"size {d} is not fixed by the input sizes {sizes}")

    def _unbacked(self, name: str, sizes: Dict[str, int]) -> bool:
        """Whether ``name`` is a data-dependent symbol (torch's ``u0``, ``u1``, ... from ``.item()``)
        that no input size fixes. Only scalar nodes may have one: a tensor shape with one still fails."""
        return name.startswith("u") and name not in sizes and name != self.program.batch_symbol

    def _size_of(self, name: str, sizes: Dict[str, int]) -> int:
        if name == self.program.batch_symbol:
            return self.program.batch_hint
        if name not in sizes:
            raise ValueError(f"the input sizes {sizes} do not fix the program's size {name}")
        return sizes[name]


def specialize(program: Program, values: Concretizer, sizes: Dict[str, int]
               ) -> Tuple[torch.fx.Graph, List[Tuple[torch.fx.Node, str, str]]]:
    """A copy of ``program.graph`` whose nodes' ``meta["val"]`` have the concrete shapes of
    ``sizes`` (symbol name -> size), and the copy's placeholders as (node, kind, target) bindings."""
    graph = torch.fx.Graph()
    copies: Dict[torch.fx.Node, torch.fx.Node] = {}
    for node in program.graph.nodes:
        new = graph.node_copy(node, copies.__getitem__)
        new.meta = {k: v for k, v in node.meta.items() if not k.startswith("relprop_")}
        new.meta["val"] = values.value(program.metas.get(node.name), sizes)
        new.meta["program_name"] = node.name  # the copy may be renamed (fx avoids builtins such as `input`)
        copies[node] = new
    # by the program's names: a copy may be renamed (fx avoids builtins such as `input`)
    by_name = {n.name: copies[n] for n in program.graph.nodes if n.op == "placeholder"}
    bindings = [(by_name[name], kind, target) for name, kind, target in program.specs]
    return graph, bindings


def batch_axes(program: Program, graph: torch.fx.Graph, sizes: Dict[str, int]
               ) -> Tuple[Dict[torch.fx.Node, Optional[int]], Dict[torch.fx.Node, int]]:
    """For each node of ``graph``, a specialization of ``program`` at ``sizes``: the axis that
    indexes samples (None: none), and, for a node whose first axis folds k > 1 groups per sample
    into the batch (``[batch·k, ...]``, batch-major: the heads of DeBERTa, Swin's windows, a
    flattened ``[batch·tokens, hidden]``), that k at these sizes. Read from the program's symbolic
    shapes: an axis indexes samples when its size is the batch times a factor that does not depend
    on the batch (:func:`batch_factor`)."""
    axes: Dict[torch.fx.Node, Optional[int]] = {n: None for n in graph.nodes}
    folds: Dict[torch.fx.Node, int] = {}
    batch = program.batch_symbol
    if batch is None:
        return axes, folds
    factors: Dict[Any, Optional[int]] = {}
    for node in graph.nodes:
        meta = program.metas.get(node.meta.get("program_name", node.name))
        if not isinstance(meta, TensorMeta):
            continue
        for i, d in enumerate(meta.shape):
            if d not in factors:
                factors[d] = batch_factor(d, batch, sizes)
            k = factors[d]
            if k is None:
                continue
            axes[node] = i
            if i == 0 and k > 1:
                folds[node] = k
            break
    return axes, folds


#: batch sizes at which :func:`batch_factor` evaluates a size
_PROBES = (1, 2, 3, 5, 7)


def batch_factor(d: Any, batch: str, sizes: Dict[str, int]) -> Optional[int]:
    """``k`` when the size ``d`` equals ``k · batch`` at the input sizes ``sizes`` for every batch size
    (``k`` an integer > 0 that does not depend on the batch: 1 for the batch axis itself, the heads or
    windows folded into it, the tokens of a flattened ``[batch·tokens, hidden]``), else None.

    ``d`` is evaluated at the batch sizes :data:`_PROBES` with every other symbol at its size: a size
    that is a product of the batch and other sizes, or of a floor division of them that the batch
    does not enter, is proportional there; sums, powers and divisions of the batch are not. (sympy's
    ``simplify`` would decide the same symbolically, at a cost that grows without bound on the
    nested floor divisions of window attention.)"""
    if not isinstance(d, sympy.Expr) or not any(s.name == batch for s in d.free_symbols):
        return None
    others = {s: sympy.Integer(sizes[s.name]) for s in d.free_symbols if s.name != batch and s.name in sizes}
    b = next(s for s in d.free_symbols if s.name == batch)
    e = d.xreplace(others)
    if e.free_symbols - {b}:
        return None
    values = []
    for n in _PROBES:
        v = e.xreplace({b: sympy.Integer(n)})
        if not v.is_Integer:
            return None
        values.append(int(v))
    k = values[0]
    return k if k > 0 and all(v == k * n for v, n in zip(values, _PROBES)) else None
