"""Sizes that depend on the data: torch's unbacked symbols (``u0``, ``u1``, ...) in a program's tensor shapes.

Some models choose rows by their values before the layers relprop explains: Idefics3 and SmolVLM drop
the all-zero images a batch was padded with (``pixel_values[real_images_inds]``) and split the image
features per sample by counts read with ``.tolist()``. ``torch.export`` keeps such a size as a
symbol no input shape fixes (``u0``: how many images are real), so no specialization of the
program (:mod:`relprop.graph.specialize`) could give its nodes concrete shapes.

:func:`data_sizes` fixes them from the inputs themselves: it evaluates the program's nodes in order
on the actual inputs, up to the last node that defines such a symbol, and reads each symbol's size
where it first appears alone (an axis of a tensor, or a scalar read with ``.item()``). These sizes
become part of the specialization key, so inputs of the same shapes with another count (a padded
image more) get their own specialization, and the graph relprop analyses is always the one the
inputs run through.
"""
from __future__ import annotations

from typing import Any, Dict, List, Set

import sympy
import torch
import torch.fx

from .nodes import evaluate
from .parameters import model_tensor
from .program import Program, TensorMeta


def _unbacked(name: str) -> bool:
    return name.startswith("u") and name[1:].isdigit()


def shape_symbols(program: Program) -> Set[str]:
    """The unbacked symbols that appear in some tensor shape of ``program`` (cached on it)."""
    found = getattr(program, "_data_size_symbols", None)
    if found is not None:
        return found
    found = set()
    for meta in program.metas.values():
        for m in (meta if isinstance(meta, (list, tuple)) else (meta,)):
            if isinstance(m, TensorMeta):
                for d in m.shape:
                    if isinstance(d, sympy.Expr):
                        found |= {s.name for s in d.free_symbols if _unbacked(s.name)}
    object.__setattr__(program, "_data_size_symbols", found)
    return found


def _bare(meta: Any) -> List[tuple]:
    """(path, symbol name) of each axis or scalar of ``meta`` that is one unbacked symbol alone."""
    out = []
    if isinstance(meta, sympy.Symbol) and _unbacked(meta.name):
        out.append(((), meta.name))
    elif isinstance(meta, TensorMeta):
        out.extend(((i,), d.name) for i, d in enumerate(meta.shape) if isinstance(d, sympy.Symbol)
                   and _unbacked(d.name))
    elif isinstance(meta, (list, tuple)):
        for k, m in enumerate(meta):
            out.extend(((k,) + p, name) for p, name in _bare(m))
    return out


def _read(value: Any, path: tuple) -> int:
    if not path:
        return int(value)
    if torch.is_tensor(value):
        return int(value.shape[path[0]])
    return _read(value[path[0]], path[1:])


def data_sizes(program: Program, model: torch.nn.Module, kwargs: Dict[str, Any]) -> Dict[str, int]:
    """The size of every unbacked symbol of ``program``'s tensor shapes on the inputs ``kwargs``
    (module docstring); ``{}`` when it has none. Evaluates the program's nodes up to the last one
    that defines such a symbol."""
    wanted = shape_symbols(program)
    if not wanted:
        return {}
    env: Dict[torch.fx.Node, Any] = {}
    by_name = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    for name, kind, target in program.specs:
        if kind in ("param", "buffer"):
            env[by_name[name]] = model_tensor(model, target, kind).detach()
        elif kind == "constant":
            env[by_name[name]] = program.constants[target]
        else:
            v = kwargs.get(target)
            env[by_name[name]] = v.detach() if torch.is_tensor(v) else v
    sizes: Dict[str, int] = {}
    defined: Set[str] = set()
    with torch.no_grad():
        for node in program.graph.nodes:
            if wanted <= defined:
                break
            if node.op == "placeholder":
                continue
            if node.op != "call_function":
                break
            env[node] = evaluate(node, env.__getitem__)
            for path, name in _bare(program.metas.get(node.name)):
                if name not in defined:
                    defined.add(name)
                    sizes[name] = _read(env[node], path)
    return sizes


def _first_axis(meta: Any):
    return meta.shape[0] if isinstance(meta, TensorMeta) and meta.shape else None


def _data_dependent(d: Any) -> bool:
    return isinstance(d, sympy.Expr) and any(_unbacked(s.name) for s in d.free_symbols)


def _numel(meta: Any) -> Any:
    n = 1
    for d in meta.shape:
        if not isinstance(d, int):
            return None
        n *= d
    return n


def rows_keep_samples(program: Program, sizes: Dict[str, int], batch: int) -> bool:
    """Whether, at ``sizes``, every data-dependent selection of ``program`` keeps the rows of every
    sample in order, so that an axis of data-dependent size holds the samples' rows batch-major: each
    boolean index that defines a size kept every row (its mask is all True: the size is the mask's
    length), and each split into data-dependent sizes cuts ``batch`` equal parts. A static capture
    only (the batch fixed at ``batch``)."""
    if not shape_symbols(program):
        return False
    index, split = torch.ops.aten.index.Tensor, torch.ops.aten.split_with_sizes.default
    seen: Set[str] = set()
    for node in program.graph.nodes:
        if node.op != "call_function":
            continue
        meta = program.metas.get(node.name)
        fresh = {name for _, name in _bare(meta)} - seen
        seen |= fresh
        if node.target is index and isinstance(_first_axis(meta), sympy.Symbol) and _first_axis(meta).name in fresh:
            masks = [m for m in node.args[1] if isinstance(m, torch.fx.Node)]
            mask = program.metas.get(masks[0].name) if len(masks) == 1 else None
            if not isinstance(mask, TensorMeta) or mask.dtype is not torch.bool or len(mask.shape) != 1:
                return False
            d = _first_axis(meta)
            if not isinstance(d, sympy.Symbol) or sizes.get(d.name) != _numel(mask):
                return False
        elif node.target is split and isinstance(node.args[1], (list, tuple)):
            parts = [program.metas.get(a.name) if isinstance(a, torch.fx.Node) else a for a in node.args[1]]
            if any(_data_dependent(p) for p in parts if isinstance(p, sympy.Expr)):
                values = [sizes.get(p.name) if isinstance(p, sympy.Symbol) else p for p in parts]
                if len(values) != batch or len(set(values)) != 1 or values[0] is None:
                    return False
    return True


def static_axes(program: Program, graph: torch.fx.Graph, sizes: Dict[str, int], batch: int):
    """(batch axis, fold) of every node of a static capture at ``sizes`` whose data-dependent
    selections keep the samples' rows (:func:`rows_keep_samples`): axis 0 where the first axis is the
    batch, or has a data-dependent size that is a multiple of it (the rows of each sample, batch-major:
    its fold is that multiple); None elsewhere. None when the rows are not known to be the samples'."""
    if not rows_keep_samples(program, sizes, batch):
        return None
    axes: Dict[torch.fx.Node, Any] = {}
    folds: Dict[torch.fx.Node, int] = {}
    for node in graph.nodes:
        meta = program.metas.get(node.meta.get("program_name", node.name))
        v = node.meta.get("val")
        axes[node] = None
        if not isinstance(v, torch.Tensor) or v.dim() == 0:
            continue
        s = int(v.shape[0])
        if s == batch:
            axes[node] = 0
        elif _data_dependent(_first_axis(meta)) and s % batch == 0:
            axes[node] = 0
            folds[node] = s // batch
    return axes, folds
