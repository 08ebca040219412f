"""Every argument of :func:`relprop.explain` and :func:`relprop.coverage` checked before any work,
each bad value answered by a :class:`relprop.RelpropError` that names the choices; the methods of a
call checked into :class:`Job` objects (:func:`check_jobs`)."""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from ..engine import Tuning, check_options as check_engine_options
from ..errors import MethodError, OptionError
from ..methods import MethodInfo, get_method
from ..methods.aggregation import HEAD_FUSIONS, LAYER_AGGREGATIONS
from ..methods.identity import IDENTITY_CHOICES
from ..rules import Preset, get_preset, presets

#: the values of ``explain(..., fast_path=...)``
FAST_PATH_CHOICES = (None, True, False)
#: preset of the methods that do not name their own, when explain() is given none
DEFAULT_PRESET = "chefer2021"


@dataclasses.dataclass(frozen=True)
class Job:
    """One method of a checked call.

    Attributes
    ----------
    info : the method (:class:`relprop.methods.MethodInfo`).
    options : the options it is given, checked (:func:`method_options`).
    preset : the :class:`relprop.rules.Preset` whose relevance it reads: the call's preset when
        one is given, else the method's own (``@method(preset=...)``), else :data:`DEFAULT_PRESET`;
        None for a method that reads no relevance.
    """

    info: MethodInfo
    options: Mapping[str, Any]
    preset: Optional[Preset]


def check_jobs(pairs: Sequence[Tuple[MethodInfo, Mapping[str, Any]]], preset: Optional[Preset]) -> Tuple[Job, ...]:
    """The :class:`Job` of each (method, checked options) pair under the call's ``preset`` (None:
    each method's own). Every method's own preset is resolved here, also for a method that reads no
    relevance (an unknown name is an error before any work); nothing below looks a preset up again."""
    own = {info.name: get_preset(info.preset) for info, _ in pairs if info.preset}
    default = get_preset(DEFAULT_PRESET)
    return tuple(Job(info, options, (preset if preset is not None else own.get(info.name, default))
                     if info.needs_relevance else None)
                 for info, options in pairs)


def check_methods(method: Any) -> Tuple[List[MethodInfo], bool]:
    """The methods asked for (a name or a list of names) and whether a list was given."""
    many = isinstance(method, (list, tuple))
    names = list(method) if many else [method]
    if not names:
        raise MethodError("method=[] names no method. Choices: relprop.methods()")
    infos = [get_method(m) for m in names]
    if len({i.name for i in infos}) != len(infos):
        raise MethodError(f"method={list(names)} names a method twice")
    return infos, many


def check_preset(preset: Any) -> Optional[Preset]:
    """The :class:`relprop.rules.Preset` asked for, by name or as the object (None: each method's own).
    The one place a call's preset is resolved: what comes back flows down to the engine unchanged."""
    if preset is None:
        return None
    if not isinstance(preset, (str, Preset)):
        raise OptionError(f"preset must be a preset's name or a relprop.Preset, not {type(preset).__name__}. "
                          f"Choices: {sorted(presets())}")
    return get_preset(preset)


def check_fast_path(fast_path: Any) -> None:
    """``fast_path`` is None, True or False."""
    if fast_path not in FAST_PATH_CHOICES or not isinstance(fast_path, (bool, type(None))):
        raise OptionError(f"fast_path={fast_path!r} is not a choice here. Choices: {list(FAST_PATH_CHOICES)} "
                          "(None: take the one-backward fast path when the preset allows it; True: the same, and "
                          "warn when it is not taken; False: always walk the graph rule by rule)")


def check_special_tokens_mask(mask: Any) -> Optional[torch.Tensor]:
    """None, or the mask as a bool tensor (its shape is checked against the scores later)."""
    if mask is None:
        return None
    try:
        t = torch.as_tensor(mask)
    except (TypeError, ValueError, RuntimeError):
        raise OptionError(f"special_tokens_mask must be a [batch, positions] bool tensor (True at positions to leave "
                          f"out), not {type(mask).__name__}") from None
    if t.dtype.is_floating_point or t.dim() != 2:
        raise OptionError(f"special_tokens_mask must be a [batch, positions] bool tensor (True at positions to leave "
                          f"out); got dtype {t.dtype}, shape {tuple(t.shape)}")
    return t.bool()


def check_progress(progress: Any) -> None:
    """``progress`` is None (:func:`relprop.graph.progress_line.wanted` decides), True or False."""
    if progress is not None and not isinstance(progress, bool):
        raise OptionError(f"progress={progress!r} is not a choice here. Choices: [None, True, False] (None: a progress "
                          "line on stderr when RELPROP_PROGRESS=1 or stderr is a terminal; True: always; False: never)")


#: the values of ``explain(..., keep_blocks=...)``
KEEP_BLOCKS_CHOICES = (None, True, False)


def check_keep_blocks(keep_blocks: Any) -> None:
    """``keep_blocks`` is None, True or False."""
    if keep_blocks is not None and not isinstance(keep_blocks, bool):
        raise OptionError(f"keep_blocks={keep_blocks!r} is not a choice here. Choices: {list(KEEP_BLOCKS_CHOICES)} "
                          "(None: keep the records unless they would exceed records_budget; True: keep every "
                          "block's A, dA, R_A in exp.blocks and the aggregated exp.matrix; False: rollout-style "
                          "methods fold each block into their scores during the reverse walk and keep neither)")


def check_records_budget(records_budget: Any) -> None:
    """``records_budget`` is None or a number of bytes >= 0."""
    ok = records_budget is None or (isinstance(records_budget, (int, float)) and not isinstance(records_budget, bool)
                                    and math.isfinite(records_budget) and records_budget >= 0)
    if not ok:
        raise OptionError(f"records_budget={records_budget!r} is not a choice here: give a number of bytes >= 0 "
                          "(e.g. 2 * 2**30) or None (1 GiB, or a quarter of the memory available on the model's "
                          "device when that is less)")


def check_arguments(*, eps: Any, unsupported: Any, memory: Any, fast_path: Any, keep_blocks: Any = True,
                    precision: Any = "float32", records_budget: Any = None, tuning: Any = None) -> None:
    """The engine options of :func:`relprop.explain` (OptionError naming the choices)."""
    check_engine_options(eps=eps, unsupported=unsupported, memory=memory, precision=precision)
    check_fast_path(fast_path)
    check_keep_blocks(keep_blocks)
    check_records_budget(records_budget)
    check_tuning(tuning)


def with_compile(tuning: Any, compile: Any):
    """``tuning`` (checked) with ``compile`` set where ``explain(..., compile=True)`` asks for it."""
    check_tuning(tuning)
    if not isinstance(compile, bool):
        raise OptionError(f"compile={compile!r} is not a choice here: True or False")
    if not compile:
        return tuning
    return dataclasses.replace(tuning or Tuning(), compile=True)


def check_tuning(tuning: Any) -> None:
    """``explain(..., tuning=...)``: None or a :class:`relprop.Tuning` (OptionError otherwise)."""
    if tuning is not None and not isinstance(tuning, Tuning):
        raise OptionError(f"tuning={tuning!r} is not a choice here: None, or a relprop.Tuning "
                          "(e.g. relprop.Tuning(chunks=relprop.RowChunks(rows=128)))")


def method_options(infos: Sequence[MethodInfo], options: Dict[str, Any], many: bool) -> Dict[str, Dict[str, Any]]:
    """Per method name, the options it takes. With one method an option it does not take is an
    error; with several, an option that none of them takes is."""
    for key in options:
        takers = [i for i in infos if key in i.options]
        if takers:
            continue
        if not many:
            info = infos[0]
            raise MethodError(f"'{key}' is not an option of method '{info.name}'. "
                              f"Options: {sorted(info.options) or 'none'}")
        listed = "; ".join(f"{i.name}: {sorted(i.options) or 'none'}" for i in infos)
        raise MethodError(f"'{key}' is not an option of any of the methods {[i.name for i in infos]}. "
                          f"Options: {listed}")
    per_method = {i.name: {k: v for k, v in options.items() if k in i.options} for i in infos}
    for info in infos:
        check_aggregation(info, per_method[info.name])
    return per_method


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_aggregation(info: MethodInfo, options: Dict[str, Any]) -> None:
    """The aggregation options of a rollout-style method ``info`` (:mod:`relprop.methods.aggregation`;
    the head fusions it declares, ``@method(head_fusions=...)``): an :class:`OptionError` naming the
    valid choices for a value it does not take. The block range is checked against the model's
    blocks when the method runs."""
    def bad(key, why):
        raise OptionError(f"{info.name}: {key}={options[key]!r} is not a choice. {why}")
    if "head_fusion" in options:
        fusions = info.head_fusions if info.head_fusions is not None else HEAD_FUSIONS
        if options["head_fusion"] not in fusions:
            bad("head_fusion", f"Choices: {list(fusions)}")
    if "layers" in options and options["layers"] not in LAYER_AGGREGATIONS:
        bad("layers", f"Choices: {list(LAYER_AGGREGATIONS)}")
    for key in ("positive", "normalize_rows", "normalize_self"):
        if key in options and not isinstance(options[key], bool):
            bad(key, "Choices: [True, False]")
    if "discard_ratio" in options:
        r = options["discard_ratio"]
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 <= r < 1:
            bad("discard_ratio", "Choices: a number in [0, 1) (the fraction of each fused map set to 0)")
    if "last_k" in options and (not _is_int(options["last_k"]) or options["last_k"] < 1):
        bad("last_k", "Choices: an int >= 1 (how many blocks, from the end of the range, layers='last' averages)")
    for key in ("start_block", "end_block", "block"):
        if key in options and not _is_int(options[key]) and not (key == "end_block" and options[key] is None):
            bad(key, "Choices: an int (blocks counted from the input, 0-based; negative values count from the output)"
                + ("; or None (through the last block)" if key == "end_block" else ""))
    if "query" in options and options["query"] not in ("cls", "mean"):
        bad("query", "Choices: ['cls', 'mean']")
    if "identity" in options and options["identity"] not in IDENTITY_CHOICES:
        bad("identity", f"Choices: {list(IDENTITY_CHOICES)} (what a rollout's scores keep of each query row's identity "
                        "share; see relprop.methods.identity)")
