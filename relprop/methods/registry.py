"""The method registry: every explanation method by name, with what it needs and what it is."""
from __future__ import annotations

import dataclasses
import difflib
import inspect
from typing import Callable, Dict, List, Optional

from ..errors import MethodError


@dataclasses.dataclass(frozen=True)
class MethodInfo:
    """One registered method: ``fn(trace, **options) -> dict`` and what it needs and is."""

    name: str
    fn: Callable
    description: str
    class_specific: bool
    signed: bool
    reference: str
    needs_relevance: bool  # needs the relevance walk (else gradients/attention only)
    preset: Optional[str] = None  # preset the method uses unless one is given (e.g. "lrp"); None: the default
    needs_blocks: bool = True  # reads per-block attention records
    needs_input_gradient: bool = False  # reads the gradient at the input (Trace.input_gradient)

    @property
    def options(self) -> List[str]:
        """The names of the method's options (its keyword parameters after ``trace``)."""
        return [p for p in inspect.signature(self.fn).parameters if p != "trace"]


_METHODS: Dict[str, MethodInfo] = {}


def method(name: str, *, description: str, class_specific: bool, signed: bool, reference: str,
           needs_relevance: bool, preset: Optional[str] = None, needs_blocks: bool = True,
           needs_input_gradient: bool = False):
    """Register an explanation method under ``name`` (see :class:`MethodInfo` for the fields)."""
    def decorate(fn):
        _METHODS[name] = MethodInfo(name, fn, description, class_specific, signed, reference, needs_relevance, preset,
                                    needs_blocks, needs_input_gradient)
        return fn
    return decorate


def get_method(name: str) -> MethodInfo:
    """The method called ``name``; an unknown name is an error that lists the known ones."""
    try:
        return _METHODS[name]
    except (KeyError, TypeError):
        close = difflib.get_close_matches(str(name), list(_METHODS), n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        raise MethodError(f"'{name}' is not a method. Choices: {sorted(_METHODS)}.{hint}") from None


def all_methods() -> Dict[str, MethodInfo]:
    """Every registered method by name."""
    return dict(_METHODS)


def table() -> Dict[str, dict]:
    """Every method name with its description, class-specificity, sign and reference
    (``relprop.methods()``)."""
    return {name: {"description": m.description, "class_specific": m.class_specific, "signed": m.signed,
                   "reference": m.reference}
            for name, m in _METHODS.items()}
