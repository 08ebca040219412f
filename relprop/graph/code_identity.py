"""What a model computes, as code: the functions its forward pass reaches, so a captured graph is
never used for a model whose code changed after the capture.

A graph captured by ``torch.export`` is the code that ran at capture time. A user (or a library:
LXT patches ``transformers``' modules, a notebook replaces one block's ``forward``) may change that
code later without changing the model's class or weights. :func:`code_identity` reads, on every
call, the functions the model's modules would run: each module's effective ``forward`` (an instance
attribute first, then its class's) and, followed through their code, the module-level functions
and the functions of imported modules they name (``apply_rotary_pos_emb``, ``nn.functional.softmax``),
the functions their closures hold and the plain values there. Each function counts by its code's
content (bytecode, constants, names), so a function replaced by another that computes the same is
the same, and a patched one is not. The capture cache keys its programs on the result
(:mod:`relprop.graph.capture`), in memory and on disk, and says so when a model is captured again
because its code changed (:func:`changed`).

What this does not see: code chosen by values outside the functions' globals and closures (a
dispatch table filled at run time, e.g. an attention-implementation registry, is read by name and
followed only where it is a function), and code inside torch itself, which is not followed.
"""
from __future__ import annotations

import hashlib
import types
from typing import Dict, Iterable, Tuple

import torch

#: packages whose functions count by identity and are not followed into (their code is the library's)
_OPAQUE = ("torch", "relprop", "builtins", "typing", "functools", "collections", "inspect", "warnings",
           "contextlib", "math", "abc", "enum", "dataclasses", "copy", "numpy")
#: how deep the module attributes named by a function are followed (``nn.functional.softmax``: 2)
_MODULE_DEPTH = 3

_code_digests: Dict[int, Tuple[types.CodeType, str]] = {}


def code_digest(code: types.CodeType) -> str:
    """A digest of what ``code`` computes: its bytecode, names, constants (nested code recursively)
    and qualified name; the same in every process for the same source and Python version."""
    hit = _code_digests.get(id(code))
    if hit is not None and hit[0] is code:
        return hit[1]
    h = hashlib.sha256()
    h.update(code.co_qualname.encode() if hasattr(code, "co_qualname") else code.co_name.encode())
    h.update(code.co_code)
    h.update(repr(code.co_names).encode())
    h.update(repr(code.co_varnames).encode())
    for c in code.co_consts:
        h.update(code_digest(c).encode() if isinstance(c, types.CodeType) else repr(c).encode())
    digest = h.hexdigest()[:24]
    _code_digests[id(code)] = (code, digest)
    return digest


def _names(code: types.CodeType) -> Iterable[str]:
    yield from code.co_names
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            yield from _names(c)


def _opaque(function) -> bool:
    module = getattr(function, "__module__", None) or ""
    return module.split(".")[0] in _OPAQUE


def _label(function) -> str:
    name = getattr(function, "__qualname__", None) or getattr(function, "__name__", "?")
    return f"{getattr(function, '__module__', '?')}.{name}"


class _Walk:
    def __init__(self):
        self.functions: Dict[str, str] = {}
        self._seen: set = set()

    def visit(self, obj) -> None:
        if isinstance(obj, types.MethodType):
            obj = obj.__func__
        key = id(obj)
        if key in self._seen:
            return
        self._seen.add(key)
        wrapped = getattr(obj, "__wrapped__", None) if isinstance(obj, types.FunctionType) else None
        if not isinstance(obj, types.FunctionType):
            return
        code = obj.__code__
        library = _opaque(obj)
        # torch's own code is not followed into, except to names it reads that were patched from outside
        self.functions[_label(obj) if library else _label(obj) + f"@{id(code)}"] = \
            "library" if library else code_digest(code)
        names = set(_names(code))
        g = obj.__globals__
        for n in names:
            v = g.get(n)
            if isinstance(v, types.MethodType):
                v = v.__func__
            if isinstance(v, types.FunctionType):
                if not (library and _opaque(v)):
                    self.visit(v)
            elif isinstance(v, types.ModuleType):
                self._module(v, names, 1, library)
        if library:
            return
        for cell in obj.__closure__ or ():
            try:
                v = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if isinstance(v, (types.FunctionType, types.MethodType)):
                self.visit(v)
            elif isinstance(v, (bool, int, float, str)):
                key = _label(obj) + f"@{id(code)}:closure"
                self.functions[key] = self.functions.get(key, "") + repr(v)
        if wrapped is not None:
            self.visit(wrapped)

    def _module(self, module: types.ModuleType, names: set, depth: int, library: bool) -> None:
        """The functions (and, up to :data:`_MODULE_DEPTH`, submodules) of ``module`` a function names;
        for a function of torch's own (``library``), only those patched from outside."""
        d = getattr(module, "__dict__", {})
        for n in names:
            v = d.get(n)
            if isinstance(v, types.FunctionType):
                if not _opaque(v):
                    self.visit(v)
                elif not library:  # torch.nn.functional.softmax and the like: named, not followed
                    self.functions[f"{module.__name__}.{n}"] = "library"
            elif isinstance(v, types.ModuleType) and depth < _MODULE_DEPTH:
                self._module(v, names, depth + 1, library)


def code_identity(model: torch.nn.Module) -> Dict[str, str]:
    """Every function ``model``'s forward pass reaches (see the module docstring) → a digest of its code
    (``"library"`` for torch's own functions, which are not followed). Keys name the function."""
    walk = _Walk()
    for m in model.modules():
        forward = m.__dict__.get("forward")
        if forward is not None:
            walk.functions[f"instance forward of {type(m).__qualname__}"] = "replaced"
            walk.visit(forward)
        else:
            walk.visit(type(m).forward)
    return walk.functions


def fingerprint(functions: Dict[str, str]) -> str:
    """One digest of :func:`code_identity`'s result, the same in every process (the ids in its keys, which
    tell apart two functions of one name within a process, are left out)."""
    h = hashlib.sha256()
    for k in sorted(functions, key=_stable):
        h.update(_stable(k).encode())
        h.update(functions[k].encode())
    return h.hexdigest()[:32]


def _stable(key: str) -> str:
    return key.split("@")[0] + (":closure" if key.endswith(":closure") else "")


def changed(before: Dict[str, str], now: Dict[str, str]) -> list:
    """The functions of ``now`` whose code is not among ``before``'s under their name (changed or new)."""
    old = {(_stable(k), v) for k, v in before.items()}
    return sorted({_stable(k) for k, v in now.items() if (_stable(k), v) not in old})
