"""The method registry: every explanation method by name, with what it needs and what it is."""
from __future__ import annotations

import dataclasses
import difflib
from typing import Callable, Dict

from ..errors import MethodError


@dataclasses.dataclass(frozen=True)
class MethodInfo:
    name: str
    fn: Callable
    description: str
    class_specific: bool
    signed: bool
    reference: str
    needs_relevance: bool  # needs the relevance walk (else gradients/attention only)
    preset: str = None  # preset forced by the method (e.g. "lrp"); None: the caller's
    needs_blocks: bool = True  # reads per-block attention records


_METHODS: Dict[str, MethodInfo] = {}


def method(name: str, *, description: str, class_specific: bool, signed: bool, reference: str,
           needs_relevance: bool, preset: str = None, needs_blocks: bool = True):
    """Register an explanation method under ``name``."""
    def decorate(fn):
        _METHODS[name] = MethodInfo(name, fn, description, class_specific, signed, reference, needs_relevance, preset,
                                    needs_blocks)
        return fn
    return decorate


def get_method(name: str) -> MethodInfo:
    try:
        return _METHODS[name]
    except KeyError:
        close = difflib.get_close_matches(str(name), list(_METHODS), n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        raise MethodError(f"'{name}' is not a method. Choices: {sorted(_METHODS)}.{hint}") from None


def all_methods() -> Dict[str, MethodInfo]:
    return dict(_METHODS)
