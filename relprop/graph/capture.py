"""Capture the compute graph of an unmodified model with ``torch.export``.

* ``torch.export.export(model, (), kwargs, strict=False)`` of the model in eval mode (the flags are
  restored afterwards, see :mod:`relprop.graph.state`); nothing of the model is patched.
* ``run_decompositions`` with torch's default table *minus* the ops we have rules for as a whole
  (linear, layer_norm, softmax, gelu, silu, matmul, dropout, hardswish, ...): fused scaled-dot-product attention
  becomes matmul → scale → mask → softmax → matmul, so the attention probabilities are a node of
  the graph. Masks built by HuggingFace are large finite negatives, never ``-inf``; where a model
  does use ``-inf``, the rules give zero relevance there instead of ``-inf · 0 = NaN``.
* The batch dimension is exported as dynamic when the model allows it (an input of batch 1 is
  exported as a batch of 2 copies, because torch specializes sizes 0 and 1), so one captured
  program serves every batch size; otherwise the capture is static and keyed by the exact shapes.
* Captured programs are cached per model (weakly: the cache dies with the model) and input
  signature, as an LRU of :data:`CACHE_SIZE` entries per model.
"""
from __future__ import annotations

import collections
import dataclasses
import threading
import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.fx
from torch.export import Dim
from torch.export.graph_signature import InputKind

from ..errors import CaptureError
from .analysis import GraphAnalysis, analyze
from .decompositions import extra_decompositions
from .inputs import batch_size_of, primary_input, signature
from .parameters import model_tensor
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

#: captured programs kept per model (least recently used dropped first)
CACHE_SIZE = 8


@dataclasses.dataclass
class Captured:
    """A decomposed exported program and what relprop learned about it."""

    program: torch.export.ExportedProgram
    graph: torch.fx.Graph
    bindings: List[Tuple[torch.fx.Node, str, Any]]  # (placeholder, kind, target or kwarg name)
    kwarg_names: List[str]
    batch_dynamic: bool
    analysis: GraphAnalysis
    primary: str
    #: memo of the weights' |W| used by the linear rules under ``explain(..., memory="high")``
    #: (see relprop.rules.linear.weight_abs); one dict per model, shared by all its captures
    weight_cache: dict = dataclasses.field(default_factory=dict)
    #: memo of the engine's plans for this graph (last uses, rematerializable nodes, segments,
    #: modified-gradient replacements), filled by the engine on first use
    plans: dict = dataclasses.field(default_factory=dict)

    @property
    def out_spec(self):
        return self.program.call_spec.out_spec

    def bind(self, model: torch.nn.Module, kwargs: Dict[str, Any]) -> Dict[torch.fx.Node, Any]:
        """Placeholder values: the model's *current* parameters and buffers (detached, read by name
        at each call, so a fine-tuned model is explained with its current weights), the program's
        lifted constants and the user's inputs."""
        env = {}
        for node, kind, target in self.bindings:
            if kind in ("param", "buffer"):  # (a piece of a quantized weight: relprop.graph.parameters)
                env[node] = model_tensor(model, target, kind).detach()
            elif kind == "constant":
                env[node] = self.program.constants[target]
            else:
                v = kwargs[target]
                env[node] = v.detach() if torch.is_tensor(v) else v
        return env


class CaptureCache:
    """Per-model LRU of captured programs, safe to use from several threads."""

    def __init__(self, size: int = CACHE_SIZE):
        self.size = size
        self._by_model: "weakref.WeakKeyDictionary[torch.nn.Module, collections.OrderedDict]" = \
            weakref.WeakKeyDictionary()
        self._memos: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()
        self._lock = threading.RLock()
        self.traces = 0  # number of exports performed (tests read it)

    def get(self, model: torch.nn.Module, kwargs: Dict[str, Any], primary: Optional[str] = None) -> Captured:
        """The captured program of ``model`` on inputs like ``kwargs`` explained onto ``primary``
        (default: :func:`relprop.graph.inputs.primary_input`), captured on the first call."""
        primary = primary if primary is not None else primary_input(kwargs)
        with self._lock:
            per_model = self._by_model.setdefault(model, collections.OrderedDict())
            state = _parameter_state(model)
            for dynamic in (True, False):
                key = (signature(kwargs, dynamic, primary), state)
                hit = per_model.get(key)
                if hit is not None and hit.batch_dynamic == dynamic:
                    per_model.move_to_end(key)
                    return hit
            captured = capture(model, kwargs, primary)
            captured.weight_cache = self._memos.setdefault(model, {})  # one memo per model, not per shape
            self.traces += 1
            per_model[(signature(kwargs, captured.batch_dynamic, primary), state)] = captured
            while len(per_model) > self.size:
                per_model.popitem(last=False)
            return captured

    def clear(self, model: Optional[torch.nn.Module] = None) -> None:
        with self._lock:
            if model is None:
                self._by_model.clear()
                self._memos.clear()
            else:
                self._by_model.pop(model, None)
                self._memos.pop(model, None)


def _parameter_state(model: torch.nn.Module) -> tuple:
    """The dtypes and devices of the model's parameters and buffers: a program captured before
    ``model.double()`` (or ``.to(device)``) may hold casts and constants of the old ones."""
    return tuple(sorted({(str(t.dtype), str(t.device)) for t in (*model.parameters(), *model.buffers())}))


CACHE = CaptureCache()


def clear_cache(model: Optional[torch.nn.Module] = None) -> None:
    """Forget captured programs (of ``model``, or of every model). Needed only if a model's
    structure (not its weights) was changed after it was explained."""
    CACHE.clear(model)


def _export(model, kwargs, dynamic: bool, primary: str):
    b = batch_size_of(kwargs, primary)
    tensors = {k: v for k, v in kwargs.items() if v is not None}
    shapes = None
    if dynamic:
        # the inputs that share the explained input's batch (decided before any copy, so that an
        # input of another batch, e.g. the 2 texts CLIP compares 1 image with, stays static)
        keys = {k for k, v in tensors.items() if torch.is_tensor(v) and v.dim() > 0 and v.shape[0] == b}
        if b == 1:
            # torch specializes size-1 dims: export on k copies, k >= 2 and unlike the batch of any
            # other input (CLIP's 2 images beside 1 text), so that no size is tied to another by chance
            others = {v.shape[0] for k, v in tensors.items() if k not in keys and torch.is_tensor(v) and v.dim() > 0}
            k_copies = next(n for n in range(2, 2 + len(others) + 1) if n not in others)
            tensors = {k: (torch.cat([v] * k_copies) if k in keys else v) for k, v in tensors.items()}
        batch = Dim("batch", min=1, max=1 << 20)
        shapes = {k: ({0: batch} if k in keys else None) for k, v in tensors.items()}
    return torch.export.export(model, (), tensors, strict=False, dynamic_shapes=shapes), list(tensors)


def capture(model: torch.nn.Module, kwargs: Dict[str, Any], primary: str) -> Captured:
    """Export ``model`` called with ``kwargs`` and decompose it so attention probabilities are nodes;
    ``primary`` names the input relevance is explained onto."""
    errors = []
    ep = names = None
    dynamic = False
    table = torch.export.default_decompositions()
    for op in KEEP_WHOLE:
        table.pop(op, None)
    table.update(extra_decompositions())
    with eval_mode(model), torch.no_grad():
        for dynamic in (True, False):
            try:
                ep, names = _export(model, kwargs, dynamic, primary)
                ep = ep.run_decompositions(table)
                break
            except Exception as e:  # noqa: BLE001 - torch raises many kinds; we report them all
                ep = None
                errors.append(f"{'dynamic' if dynamic else 'static'} batch: {type(e).__name__}: {str(e)[:800]}")
    if ep is None:
        raise CaptureError(
            f"torch.export could not capture {type(model).__name__}:\n  " + "\n  ".join(errors)
            + "\nrelprop needs a model that torch.export.export(model, (), inputs, strict=False) can trace."
        )
    graph = ep.graph
    _finite_masks(graph)
    specs = {s.arg.name: s for s in ep.graph_signature.input_specs}
    user_names = iter(names)
    bindings = []
    for node in graph.nodes:
        if node.op != "placeholder":
            continue
        spec = specs[node.name]
        if spec.kind == InputKind.PARAMETER:
            bindings.append((node, "param", spec.target))
        elif spec.kind == InputKind.BUFFER:
            bindings.append((node, "buffer", spec.target))
        elif spec.kind == InputKind.CONSTANT_TENSOR:
            bindings.append((node, "constant", spec.target))
        elif spec.kind == InputKind.USER_INPUT:
            bindings.append((node, "user", next(user_names)))
        else:
            raise CaptureError(f"unsupported graph input {node.name} of kind {spec.kind}")
    analysis = analyze(ep, graph, bindings, primary, batch_size_of(kwargs, primary) if not dynamic else None)
    return Captured(ep, graph, bindings, names, dynamic, analysis, primary)


def _finite_masks(graph: torch.fx.Graph) -> int:
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
