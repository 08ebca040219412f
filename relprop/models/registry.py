"""The registry of family adapters (:mod:`relprop.models.adapter`): the first adapter whose ``matches(model)``
is True explains the model; a model no family claims takes the plain, no-op adapter.

Adding a family is one module with its adapter plus one row of :data:`ADAPTERS` (or, from outside relprop,
:func:`register`): ``docs/extending.md`` shows one, tested in ``tests/test_model_adapters.py``.
"""
from __future__ import annotations

import threading
from typing import Any, List

from .adapter import PLAIN, ModelAdapter
from .families import ANYRES_VLM, IMAGE_TOKEN_VLM, QWEN_VL, TILED_VLM, UNKNOWN_VLM

#: the adapters, asked in order: the specific families before the generic vision-language one
ADAPTERS: List[ModelAdapter] = [QWEN_VL, TILED_VLM, ANYRES_VLM, IMAGE_TOKEN_VLM, UNKNOWN_VLM]
_LOCK = threading.Lock()


def adapter_for(model: Any) -> ModelAdapter:
    """The adapter of ``model``: the first of :data:`ADAPTERS` that matches, else the plain one."""
    for a in list(ADAPTERS):
        if a.matches(model):
            return a
    return PLAIN


def register(adapter: ModelAdapter, first: bool = True) -> ModelAdapter:
    """Add ``adapter`` to the registry (before the built-in families when ``first``, so that it may claim a
    model one of them would; after them otherwise) and return it; registering it again moves it."""
    if not isinstance(adapter, ModelAdapter):
        raise TypeError(f"register() takes a relprop.models.ModelAdapter, not {type(adapter).__name__}")
    with _LOCK:
        if adapter in ADAPTERS:
            ADAPTERS.remove(adapter)
        ADAPTERS.insert(0, adapter) if first else ADAPTERS.append(adapter)
    return adapter


def unregister(adapter: ModelAdapter) -> None:
    """Remove ``adapter`` from the registry (nothing when it is not there)."""
    with _LOCK:
        if adapter in ADAPTERS:
            ADAPTERS.remove(adapter)
