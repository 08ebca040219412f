"""Export an unmodified model once for every input size it can take.

* ``torch.export.export(model, (), kwargs, strict=False, dynamic_shapes=...)`` of the model in eval
  mode (the flags are restored afterwards, see :mod:`relprop.graph.state`); nothing of the model is
  patched.
* **Dynamic axes.** The batch axis of every input that shares the explained input's batch is one
  named dimension (``Dim("batch")``); every other axis of an integer input (token ids, masks) is
  ``Dim.AUTO``, and of a floating-point input when the model takes several sizes (a timm model with
  ``dynamic_img_size=True``, an HF ViT called with ``interpolate_pos_encoding=True``;
  :func:`_sizes_may_vary`): torch keeps it dynamic where the model's code allows (the sequence
  length of a text model, the image size) and fixes it where the code needs one size (hidden sizes,
  colour channels, a ViT's 224×224), without an error either way. torch specializes sizes 0 and 1,
  so an input of batch 1 is exported as a batch of copies. If that export fails, the batch alone is
  made dynamic, then nothing (:data:`ATTEMPTS`); :class:`relprop.graph.program.Program` records
  which axes came out dynamic. A module whose ``static_sizes_only`` is True (it holds constants made
  for one input size, e.g. ``relprop.models.qwen_images.QwenImage``) is exported at its sizes only.
* torch's default decompositions *minus* the ops the rules treat as units (:data:`KEEP_WHOLE`),
  applied node by node (:mod:`relprop.graph.node_decompose`: only the nodes they rewrite are
  traced; a program that pass does not take gets ``run_decompositions``, which traces it whole):
  fused scaled-dot-product attention becomes matmul → scale → mask → softmax → matmul, so the
  attention probabilities are a node of the graph. Masks built by HuggingFace are large finite
  negatives, never ``-inf``; where a model does use ``-inf``, it is
  replaced by the dtype's most negative finite value (:func:`finite_masks`).
"""
from __future__ import annotations

import time
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch.export import Dim
from torch.export.graph_signature import InputKind

from ..errors import CaptureError
from .decompositions import extra_decompositions
from .id_lookups import commute_lookups
from .complex_values import realify_complex
from . import progress_line
from .inputs import batch_size_of
from .node_decompose import decompose_nodes
from .program import InputPattern, Program, describe, symbol_ranges
from .state import eval_mode

aten = torch.ops.aten

#: ops kept whole by the decomposition because the rules treat them as units
KEEP_WHOLE = [
    aten.linear.default, aten.layer_norm.default, aten.softmax.int, aten._softmax.default,
    aten.gelu.default, aten.silu.default, aten.matmul.default, aten.dropout.default,
    aten.rms_norm.default, aten.tanh.default, aten.linalg_vector_norm.default,
    # activations of hybrid models (LeViT, EfficientViT, MobileNet blocks): one element-wise function
    # each, which the rules give the identity rule, instead of a clamp-and-product decomposition
    aten.hardswish.default, aten.hardsigmoid.default, aten.mish.default,
]

#: export attempts in order: (label, batch axis dynamic, other axes dynamic)
ATTEMPTS = (("dynamic sizes", True, True), ("dynamic batch", True, False), ("static", False, False))
#: the attempt of a first capture (:class:`relprop.graph.capture.CaptureCache`'s ``first_export``): the
#: call's own sizes, a third of a dynamic export's time; the first call of other sizes exports again
#: with :data:`ATTEMPTS`
FIRST_CALL_SIZES = ("the first call's sizes", False, False)

_KINDS = {InputKind.PARAMETER: "param", InputKind.BUFFER: "buffer", InputKind.CONSTANT_TENSOR: "constant",
          InputKind.USER_INPUT: "user"}


def decomposition_table() -> dict:
    """torch's default decompositions minus :data:`KEEP_WHOLE`, plus relprop's own."""
    table = torch.export.default_decompositions()
    for op in KEEP_WHOLE:
        table.pop(op, None)
    table.update(extra_decompositions())
    return table


def export_program(model: torch.nn.Module, kwargs: Dict[str, Any], primary: str, state: tuple,
                   timings: Dict[str, float], attempts=ATTEMPTS, failed: Optional[List[str]] = None,
                   decompose: str = "nodes") -> Program:
    """Export ``model`` called with ``kwargs`` (explained onto ``primary``) with the most dynamic
    axes it allows (the first of ``attempts`` that succeeds, :data:`ATTEMPTS`), decompose it, and
    describe it as a :class:`Program`. ``timings`` receives the seconds spent in ``"export"`` and
    ``"decompose"`` (``"decompose (whole program)"`` where the node-by-node pass did not take the
    program, or ``decompose="whole"`` asks for torch's pass); ``failed``, when given, the labels of
    the attempts that failed."""
    errors = []
    table = decomposition_table()
    if getattr(model, "static_sizes_only", False) is True:  # constants of one input size (api/qwen_images.py)
        attempts = [a for a in attempts if not (a[1] or a[2])]
    with eval_mode(model), torch.no_grad():
        for label, dynamic_batch, dynamic_rest in attempts:
            t0 = time.perf_counter()
            try:
                with progress_line.step(f"torch.export of {type(model).__name__} ({label})"):
                    ep, names, hint = _export(model, kwargs, primary, dynamic_batch, dynamic_rest)
                t1 = time.perf_counter()
                timings["export"] = timings.get("export", 0.0) + t1 - t0
                stage = "decompose"
                with progress_line.step("decomposing the graph into the ops relprop has rules for"):
                    if decompose != "nodes" or not decompose_nodes(ep, table):  # else torch's whole-program pass
                        ep = ep.run_decompositions(table)
                        stage = "decompose (whole program)"
                timings[stage] = timings.get(stage, 0.0) + time.perf_counter() - t1
                break
            except Exception as e:  # noqa: BLE001 - torch raises many kinds; we report them all
                timings["export"] = timings.get("export", 0.0) + time.perf_counter() - t0
                ep = None
                errors.append(f"{label}: {type(e).__name__}: {str(e)[:800]}")
                if failed is not None:
                    failed.append(label)
    if ep is None:
        raise CaptureError(
            f"torch.export could not capture {type(model).__name__}:\n  " + "\n  ".join(errors)
            + "\nrelprop needs a model that torch.export.export(model, (), inputs, strict=False) can trace."
        )
    finite_masks(ep.graph)
    commute_lookups(ep.graph, _user_placeholder(ep, names, primary))
    realify_complex(ep.graph)
    program = _program(ep, names, primary, hint if dynamic_batch else None, state, kwargs)
    program.exported_as = label
    return program


def _user_placeholder(ep, names: List[str], name: str) -> Optional[torch.fx.Node]:
    """The placeholder of user input ``name`` in ``ep``'s graph (``names``: the user inputs in order)."""
    kinds = {s.arg.name: s.kind for s in ep.graph_signature.input_specs}
    users = [n for n in ep.graph.nodes if n.op == "placeholder" and _KINDS.get(kinds.get(n.name)) == "user"]
    return dict(zip(names, users)).get(name)


def _export(model, kwargs, primary: str, dynamic_batch: bool, dynamic_rest: bool):
    """One ``torch.export`` call; returns the program, the user inputs' names and the batch the
    export saw."""
    b = batch_size_of(kwargs, primary)
    tensors = {k: v for k, v in kwargs.items() if v is not None}
    if not (dynamic_batch or dynamic_rest):
        return torch.export.export(model, (), tensors, strict=False), leaf_names(tensors), b
    # the inputs that share the explained input's batch (decided before any copy, so that an input
    # of another batch, e.g. the 2 texts CLIP compares 1 image with, keeps its own)
    keys = {k for k, v in tensors.items() if torch.is_tensor(v) and v.dim() > 0 and v.shape[0] == b}
    hint = b
    if b == 1 and dynamic_batch:
        # torch specializes size-1 axes: export on k copies, k >= 2 and unlike the batch of any other
        # input (CLIP's 2 images beside 1 text), so that no size is tied to another by chance
        others = {v.shape[0] for k, v in tensors.items() if k not in keys and torch.is_tensor(v) and v.dim() > 0}
        hint = next(n for n in range(2, 2 + len(others) + 1) if n not in others)
        tensors = {k: (torch.cat([v] * hint) if k in keys else v) for k, v in tensors.items()}
    batch = Dim("batch", min=1, max=1 << 20)
    shapes = {}
    for k, v in tensors.items():
        if not torch.is_tensor(v) or v.dim() == 0:
            shapes[k] = None
            continue
        rest = dynamic_rest and _sizes_may_vary(model, kwargs, v)
        axes = {i: Dim.AUTO for i in range(1 if k in keys else 0, v.dim())} if rest else {}
        if k in keys and dynamic_batch:
            axes[0] = batch
        shapes[k] = axes or None
    return torch.export.export(model, (), tensors, strict=False, dynamic_shapes=shapes), leaf_names(tensors), hint


def leaf_names(kwargs: Dict[str, Any]) -> List[str]:
    """The input name of each graph input torch.export makes from ``kwargs``, in order: one per
    pytree leaf (a tensor, a flag: one; a list of ints such as LLaVA-NeXT's ``image_sizes``: one per
    int, each specialized into the graph as a constant). An input that holds several tensors is
    refused: each of its graph inputs would be bound to the whole container."""
    names = []
    for k, v in kwargs.items():
        leaves = pytree.tree_leaves(v)
        if len(leaves) > 1 and any(torch.is_tensor(x) for x in leaves):
            raise CaptureError(f"input {k!r} is a container of tensors ({type(v).__name__}); relprop binds one tensor "
                               "per input: pass its tensors as separate inputs")
        names.extend([k] * len(leaves))
    return names


def _sizes_may_vary(model, kwargs, value: torch.Tensor) -> bool:
    """Whether the axes past the batch of one input are exported as ``Dim.AUTO``: always for
    integer inputs (token ids, masks, positions: texts come in every length); for floating-point
    inputs (pixels, features) only when the model says it takes several sizes (timm's
    ``dynamic_img_size=True``, HF's ``interpolate_pos_encoding=True``). Image processors resize to
    one size, and a symbolic image size costs minutes of torch's shape reasoning on windowed models
    (Swin's padding and window partition), so their size is fixed and a new size is a new capture,
    which ``exp.notes`` then reports."""
    if not value.dtype.is_floating_point:
        return True
    return getattr(model, "dynamic_img_size", False) is True or kwargs.get("interpolate_pos_encoding") is True


def _program(ep, names: List[str], primary: str, batch_hint, state: tuple, kwargs: Dict[str, Any]) -> Program:
    """The :class:`Program` of a decomposed exported program."""
    graph = ep.graph
    specs = {s.arg.name: s for s in ep.graph_signature.input_specs}
    user_names = iter(names)
    bindings: List[Tuple[str, str, str]] = []
    constant_names = set()
    for node in graph.nodes:
        if node.op != "placeholder":
            continue
        spec = specs[node.name]
        kind = _KINDS.get(spec.kind)
        if kind is None:
            raise CaptureError(f"unsupported graph input {node.name} of kind {spec.kind}")
        target = next(user_names) if kind == "user" else spec.target
        bindings.append((node.name, kind, target))
        if kind == "constant":
            constant_names.add(target)
    metas = {n.name: describe(n.meta.get("val")) for n in graph.nodes}
    placeholders = {n.name: n for n in graph.nodes if n.op == "placeholder"}
    patterns = {}
    for name, kind, target in bindings:
        if kind == "user":
            patterns[target] = InputPattern.of(kwargs[target], metas[name])
    for name, v in kwargs.items():  # inputs left out of the export (None)
        patterns.setdefault(name, InputPattern.of(v, None))
    batch_symbol = None
    if batch_hint is not None:
        first = patterns[primary].dims[0] if patterns[primary].dims else None
        batch_symbol = first.name if hasattr(first, "name") else None
    for n in graph.nodes:  # the fake values are described in `metas`; drop them (and their shape env)
        n.meta.pop("val", None)
        n.meta.pop("tensor_meta", None)
    del placeholders
    constants = {k: v for k, v in ep.constants.items() if k in constant_names}
    return Program(graph, metas, bindings, constants, ep.call_spec.out_spec, primary, patterns,
                   symbol_ranges(ep.range_constraints), batch_symbol,
                   batch_hint if batch_hint is not None else batch_size_of(kwargs, primary), state)


def finite_masks(graph: torch.fx.Graph) -> int:
    """Replace every ``-inf`` constant in the graph by the most negative finite value of its dtype.

    SDPA with a boolean mask decomposes into ``scores + where(mask, 0, -inf)``. A relevance rule
    that divides by ``scores + mask`` would compute ``-inf · 0 = NaN`` there. With a finite mask the
    softmax is the same (exp underflows to exactly 0), the fully-masked-row check ``eq(x, -inf)``
    becomes ``eq(x, min)`` which still holds for those rows, and every share stays finite.
    Returns the number of arguments rewritten.
    """
    count = 0
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        val = node.meta.get("val")
        dtype = val.dtype if isinstance(val, torch.Tensor) and val.is_floating_point() else torch.float32
        if node.target in (aten.eq.Scalar, aten.ne.Scalar):
            x = node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else None
            dtype = x.dtype if isinstance(x, torch.Tensor) and x.is_floating_point() else dtype
        low = torch.finfo(dtype).min

        def fix(a):
            nonlocal count
            if isinstance(a, float) and a == float("-inf"):
                count += 1
                return low
            if isinstance(a, (list, tuple)):
                return type(a)(fix(x) for x in a)
            return a

        new_args = tuple(fix(a) for a in node.args)
        new_kwargs = {k: fix(v) for k, v in node.kwargs.items()}
        if new_args != node.args or new_kwargs != node.kwargs:
            node.args, node.kwargs = new_args, new_kwargs
    if count:
        graph.owning_module.recompile() if graph.owning_module is not None else None
    return count
