"""Capture the compute graph of an unmodified model, once for every input size it can take.

* A model is exported once per input *structure* (names, dtypes, ranks, plain values, explained
  input) with dynamic axes (:mod:`relprop.graph.export`); the resulting :class:`Program` serves
  every input whose sizes fit it (:meth:`Program.match`): every batch size, and every sequence
  length or image size the model's code leaves dynamic.
* Each new input size gets a cheap **specialization** (:mod:`relprop.graph.specialize`): a copy of
  the graph with concrete shapes and its own analysis (:mod:`relprop.graph.analysis`), the
  :class:`Captured` that the engine runs. Specializations are kept per program (an LRU of
  :data:`SPECIALIZATIONS`), programs per model (an LRU of :data:`CACHE_SIZE`), both weakly per model:
  the cache dies with the model.
* With the disk cache on (:mod:`relprop.graph.disk_cache`), an exported program is also written to
  disk (without the weights) and a later process loads it instead of exporting again.
"""
from __future__ import annotations

import collections
import dataclasses
import threading
import time
import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.fx

from . import progress_line
from ..errors import CaptureError
from . import disk_cache
from .code_identity import changed, code_identity, fingerprint
from .data_sizes import data_sizes, static_axes
from .dispatch import bind_offloaded, export_offloaded, offloaded_weights
from .analysis import GraphAnalysis, analyze
from .export import ATTEMPTS, FIRST_CALL_SIZES, export_program
from .inputs import batch_size_of, primary_input
from .parameters import model_tensor
from .program import Program
from .specialize import Concretizer, batch_axes, specialize

#: captured programs kept per model (least recently used dropped first)
CACHE_SIZE = 8
#: specializations (input sizes) kept per program
SPECIALIZATIONS = 64


@dataclasses.dataclass
class Captured:
    """One program specialized to one input size: the graph the engine runs and its analysis."""

    program: Program
    graph: torch.fx.Graph
    bindings: List[Tuple[torch.fx.Node, str, Any]]  # (placeholder, kind, target or kwarg name)
    analysis: GraphAnalysis
    primary: str
    #: the sizes of the program's symbols this specialization was made for (the batch's excepted)
    sizes: Dict[str, int] = dataclasses.field(default_factory=dict)
    #: memo of the weights' |W| used by the linear rules under ``explain(..., memory="high")``
    #: (see relprop.rules.linear.weight_abs); one dict per model, shared by all its captures
    weight_cache: dict = dataclasses.field(default_factory=dict)
    #: memo of the engine's plans for this graph (last uses, rematerializable nodes, segments,
    #: modified-gradient replacements), filled by the engine on first use
    plans: dict = dataclasses.field(default_factory=dict)

    @property
    def kwarg_names(self) -> List[str]:
        return self.program.user_names

    @property
    def offloaded(self) -> bool:
        """Captured from a model dispatched by accelerate with offloaded weights: its weights are
        read when a node needs them and never memoized (:mod:`relprop.graph.dispatch`)."""
        return self.program.offloaded

    @property
    def batch_dynamic(self) -> bool:
        """True when one graph takes every batch size."""
        return self.program.batch_dynamic

    @property
    def out_spec(self):
        return self.program.out_spec

    def bind(self, model: torch.nn.Module, kwargs: Dict[str, Any]) -> Dict[torch.fx.Node, Any]:
        """Placeholder values: the model's *current* parameters and buffers (detached, read by name
        at each call, so a fine-tuned model is explained with its current weights), the program's
        lifted constants and the user's inputs. For a model dispatched by accelerate with offloaded
        weights, a :class:`relprop.graph.dispatch.LazyEnv` that reads each of them when a node needs it."""
        if self.program.offloaded:
            weights = offloaded_weights(model)
            if weights is not None:
                return bind_offloaded(self.bindings, weights, self.program.constants, model, kwargs)
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


@dataclasses.dataclass
class CaptureEvent:
    """What one :meth:`CaptureCache.get` did: ``"cached"``, ``"specialized"`` (a new input size of a
    known program), ``"loaded"`` (a program read from the disk cache) or ``"exported"``, with the
    seconds each step took and, for an export, which axes came out dynamic."""

    kind: str
    seconds: Dict[str, float] = dataclasses.field(default_factory=dict)
    programs: int = 0  # the model's programs for this input structure after the call
    dynamic_axes: Dict[str, List[int]] = dataclasses.field(default_factory=dict)
    #: the functions whose code changed since the model's last capture on inputs like these (a new capture
    #: because of them; :mod:`relprop.graph.code_identity`)
    code_changed: List[str] = dataclasses.field(default_factory=list)


class _Entry:
    """A program and its specializations."""

    def __init__(self, program: Program, functions: Optional[Dict[str, str]] = None):
        self.program = program
        self.functions = functions or {}  # the model's code when it was captured (code_identity)
        self.values = Concretizer(program)
        self.specializations: "collections.OrderedDict[tuple, Captured]" = collections.OrderedDict()


class CaptureCache:
    """Per-model programs and their specializations, safe to use from several threads."""

    def __init__(self, size: int = CACHE_SIZE, specializations: int = SPECIALIZATIONS, attempts=ATTEMPTS,
                 disk: bool = True, decompose: str = "nodes", first_export: str = "static"):
        self.size = size
        #: how the first program of an input structure is exported: ``"static"`` (the default: at the call's
        #: sizes, a half to a third of a dynamic export's time; the program for every size follows at the first
        #: call of another size, or when a sampling method packs its re-runs, ``get(every_batch=True)``) or
        #: ``"dynamic"`` (the most dynamic of :attr:`attempts` at once). A static program's samples are read from
        #: the axes' provenance where sizes do not show them (relprop.graph.axis_provenance: Swin's windows,
        #: heads folded into the batch, OPT's [B·T, H] rows, Mixtral's router rows); across the zoo every
        #: method gives the dynamic capture's scores bit for bit
        if first_export not in ("static", "dynamic"):
            raise ValueError(f"first_export must be 'static' or 'dynamic', not {first_export!r}")
        self.first_export = first_export
        #: how an export is decomposed: ``"nodes"`` (node by node, :mod:`relprop.graph.node_decompose`,
        #: torch's whole-program pass where it does not apply) or ``"whole"`` (always torch's pass)
        self.decompose = decompose
        #: whether programs are read from and written to the disk cache (when it is on)
        self.disk = disk
        #: the export attempts, most dynamic first (:data:`relprop.graph.export.ATTEMPTS`)
        self.attempts = attempts
        self.specializations_per_program = specializations
        self._by_model: "weakref.WeakKeyDictionary[torch.nn.Module, collections.OrderedDict]" = \
            weakref.WeakKeyDictionary()
        self._memos: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()
        #: per model and input names, the export attempts that failed before (not tried again)
        self._failed: "weakref.WeakKeyDictionary[torch.nn.Module, Dict[frozenset, set]]" = \
            weakref.WeakKeyDictionary()
        self._lock = threading.RLock()
        self.traces = 0  # torch.export calls (tests and benchmarks read the counts)
        self.loads = 0  # programs read from the disk cache
        self.specializations = 0  # specializations made (new input sizes)

    @property
    def captures(self) -> int:
        """Programs made so far: exported by torch.export or read from the disk cache."""
        return self.traces + self.loads

    def get(self, model: torch.nn.Module, kwargs: Dict[str, Any], primary: Optional[str] = None,
            events: Optional[List[CaptureEvent]] = None, every_batch: bool = False) -> Captured:
        """The captured graph of ``model`` on inputs like ``kwargs`` explained onto ``primary``
        (default: :func:`relprop.graph.inputs.primary_input`): a cached specialization, a new one of a
        cached program, or a new program (from the disk cache or a fresh export). ``events``, when
        given, receives a :class:`CaptureEvent` saying which. ``every_batch``: a program that takes
        every batch size (the sampling methods' packed re-runs, :class:`relprop.methods.gradients.Reruns`):
        where the program of these inputs was exported at the first call's sizes, the program for every
        size is exported now, as the first call of another size would; a model whose batch cannot be
        made dynamic keeps its static program (the caller reads :attr:`Captured.batch_dynamic`)."""
        primary = primary if primary is not None else primary_input(kwargs)
        with self._lock:
            entries = self._by_model.setdefault(model, collections.OrderedDict())
            functions = code_identity(model)
            state = _parameter_state(model) + (("code", fingerprint(functions)),)
            every_batch = every_batch and any(a[1] for a in self._attempts(model, kwargs))
            event = None
            for key, entry in reversed(entries.items()):
                sizes = entry.program.match(kwargs, primary, state)
                if sizes is not None and (entry.program.batch_dynamic or not every_batch):
                    entries.move_to_end(key)
                    break
            else:
                entry, sizes, event = self._new_program(model, kwargs, primary, state, entries, functions,
                                                        every_batch)
            sizes = {**sizes, **data_sizes(entry.program, model, kwargs)}  # sizes the data decide (u0, ...)
            batch = entry.program.batch_symbol
            skey = tuple(sorted((k, v) for k, v in sizes.items() if k != batch))
            captured = entry.specializations.get(skey)
            if captured is not None:
                entry.specializations.move_to_end(skey)
                event = event or CaptureEvent("cached")
            else:
                t0 = time.perf_counter()
                with progress_line.step(f"analysing the graph of {type(model).__name__} at these sizes"):
                    captured = self._specialize(model, entry, skey, kwargs, primary)
                event = event or CaptureEvent("specialized")
                event.seconds["analysis"] = time.perf_counter() - t0
            event.programs = sum(1 for e in entries.values() if _same_structure(e.program, entry.program))
            if events is not None:
                events.append(event)
            return captured

    def _first_attempts(self, model, kwargs, primary, state, entries, every_batch: bool = False) -> tuple:
        """The attempts for a new program: a static export first when no program of these inputs'
        structure exists yet (the first call pays the cheapest capture), then :meth:`_attempts`."""
        attempts = self._attempts(model, kwargs)
        if self.first_export != "static" or every_batch or any(e.program.same_structure(kwargs, primary, state)
                                                               for e in entries.values()):
            return attempts
        return (FIRST_CALL_SIZES,) + tuple(a for a in attempts if a[1] or a[2])

    def _attempts(self, model, kwargs) -> tuple:
        """The export attempts for a new program of ``model`` on ``kwargs``: :attr:`attempts` less those
        that failed for this model on inputs of the same names (e.g. a vision-language model, whose
        image-token count check stops every dynamic export: each new prompt length then costs one
        static export, not three). The last attempt is always kept."""
        failed = self._failed.get(model, {}).get(frozenset(kwargs), set())
        kept = tuple(a for a in self.attempts if a[0] not in failed)
        return kept or self.attempts[-1:]

    def _remember_failed(self, model, kwargs, failed: List[str]) -> None:
        if failed:
            self._failed.setdefault(model, {}).setdefault(frozenset(kwargs), set()).update(failed)

    def _new_program(self, model, kwargs, primary, state, entries, functions, every_batch: bool = False):
        timings: Dict[str, float] = {}
        failed: List[str] = []
        t0 = time.perf_counter()
        weights = offloaded_weights(model)  # a model dispatched by accelerate: never on disk
        program = disk_cache.load(model, kwargs, primary, state, every_batch) if self.disk and weights is None \
            else None
        if weights is not None:
            with progress_line.step(f"capturing {type(model).__name__} with torch.export (once per model)"):
                program = export_offloaded(model, weights, kwargs, primary, state, timings,
                                           self._attempts(model, kwargs), failed)
            self._remember_failed(model, kwargs, failed)
            self.traces += 1
            event = CaptureEvent("exported", timings)
        elif program is not None:
            self.loads += 1
            timings["load"] = time.perf_counter() - t0
            event = CaptureEvent("loaded", timings)
        else:
            with progress_line.step(f"capturing {type(model).__name__} (once per model and input structure; later "
                                    "calls reuse it)"):
                program = export_program(model, kwargs, primary, state, timings,
                                         self._first_attempts(model, kwargs, primary, state, entries, every_batch),
                                         failed,
                                         self.decompose)
            self._remember_failed(model, kwargs, failed)
            self.traces += 1
            t1 = time.perf_counter()
            if self.disk:
                disk_cache.store(model, kwargs, program)
            timings["store"] = time.perf_counter() - t1
            event = CaptureEvent("exported", timings)
        event.dynamic_axes = program.dynamic_axes()
        event.code_changed = _code_changes(entries, kwargs, primary, state, functions)
        entry = _Entry(program, functions)
        entries[id(entry)] = entry
        while len(entries) > self.size:
            entries.popitem(last=False)
        sizes = program.match(kwargs, primary, state)
        if sizes is None:  # an export always fits the inputs it was made from
            raise CaptureError(f"relprop: the program captured for {type(model).__name__} does not take the inputs "
                               f"it was captured from (patterns {program.patterns})")
        return entry, sizes, event

    def _specialize(self, model, entry: _Entry, key: tuple, kwargs, primary) -> Captured:
        """A new specialization of ``entry``'s program at the sizes ``key`` (sorted (symbol, size) pairs)."""
        program, sizes = entry.program, dict(key)
        graph, bindings = specialize(program, entry.values, sizes)
        static_batch = None if program.batch_dynamic else batch_size_of(kwargs, primary)
        axes = batch_axes(program, graph, sizes) if program.batch_dynamic else None
        if axes is None and static_batch is not None:  # rows chosen by the data (Idefics3's real images)
            axes = static_axes(program, graph, sizes, static_batch)
        analysis = analyze(graph, bindings, primary, static_batch, axes)
        captured = Captured(program, graph, bindings, analysis, primary, sizes,
                            weight_cache=self._memos.setdefault(model, {}))  # one memo per model
        self.specializations += 1
        entry.specializations[key] = captured
        while len(entry.specializations) > self.specializations_per_program:
            entry.specializations.popitem(last=False)
        return captured

    def programs(self, model: torch.nn.Module) -> List[Program]:
        """The programs cached for ``model``, least recently used first."""
        with self._lock:
            return [e.program for e in self._by_model.get(model, {}).values()]

    def captured(self, model: torch.nn.Module) -> List[Captured]:
        """Every specialization cached for ``model``, program by program."""
        with self._lock:
            return [c for e in self._by_model.get(model, {}).values() for c in e.specializations.values()]

    def clear(self, model: Optional[torch.nn.Module] = None) -> None:
        with self._lock:
            if model is None:
                self._by_model.clear()
                self._memos.clear()
                self._failed.clear()
            else:
                self._by_model.pop(model, None)
                self._memos.pop(model, None)
                self._failed.pop(model, None)


def _same_structure(a: Program, b: Program) -> bool:
    """Two programs of the same inputs (names, kinds, dtypes, ranks) that differ only in sizes."""
    if a.primary != b.primary or set(a.patterns) != set(b.patterns):
        return False
    return all((p.tensor, p.dtype, p.device, len(p.dims), p.value)
               == (q.tensor, q.dtype, q.device, len(q.dims), q.value)
               for p, q in ((a.patterns[k], b.patterns[k]) for k in a.patterns))


def _code_changes(entries, kwargs, primary, state: tuple, functions: Dict[str, str]) -> List[str]:
    """The functions whose code differs from the model's latest program that took inputs like ``kwargs``
    with another code (nothing when no such program exists: a first capture, or other inputs)."""
    for entry in reversed(list(entries.values())):
        old = entry.program.state
        if old != state and old[:-1] == state[:-1] and entry.program.same_structure(kwargs, primary, old):
            return changed(entry.functions, functions) or ["a function relprop does not name"]
    return []


def _parameter_state(model: torch.nn.Module) -> tuple:
    """The dtypes and devices of the model's parameters and buffers: a program captured before
    ``model.double()`` (or ``.to(device)``) may hold casts and constants of the old ones."""
    return tuple(sorted({(str(t.dtype), str(t.device)) for t in (*model.parameters(), *model.buffers())}))


CACHE = CaptureCache()


def capture(model: torch.nn.Module, kwargs: Dict[str, Any], primary: str) -> Captured:
    """Export ``model`` on ``kwargs`` (explained onto ``primary``) and specialize the program to their
    sizes, bypassing every cache (in memory and on disk)."""
    return CaptureCache(disk=False).get(model, kwargs, primary)


def clear_cache(model: Optional[torch.nn.Module] = None) -> None:
    """Forget captured programs (of ``model``, or of every model) in this process. Needed only if a
    model's structure (not its weights) was changed after it was explained; the disk cache is keyed
    by the structure, so it needs no clearing (``relprop.graph.disk_cache.clear`` empties it)."""
    CACHE.clear(model)
