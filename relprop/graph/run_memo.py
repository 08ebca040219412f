"""Facts about values that one engine run reads once, though many nodes ask.

A decoder's blocks share one boolean attention mask: each block turns it into its own additive float
mask (``where(mask, 0, min)``, as an exported SDPA decomposes) and reads it again when its segment is
recomputed (``memory="low"``). Two facts about it are read by every block: whether the boolean mask
selects one operand everywhere (:func:`relprop.graph.torch_fixes.selects_everywhere`, two passes
over heads × tokens² booleans) and how many keys each chunk of query rows attends to
(:func:`relprop.graph.key_bounds.key_bounds`, a pass over the float mask). Within
:func:`once_per_run` each is read once.

Two kinds of memo, both dropped when the run ends:

* :func:`about_tensor`: a fact about one tensor object, valid while that object lives and is not
  written to (its version counter). The memo holds the tensor weakly: it keeps no memory alive.
* :func:`remembered`: a fact about a graph value under a key the caller makes canonical (two nodes
  that compute the same value from the same node give the same key).

Outside :func:`once_per_run` nothing is remembered: each call computes.
"""
from __future__ import annotations

import contextlib
import contextvars
import weakref
from typing import Any, Callable, Hashable

import torch

_RUN: contextvars.ContextVar = contextvars.ContextVar("relprop_run_memo", default=None)


@contextlib.contextmanager
def once_per_run():
    """The scope of one engine run: the memos below are kept until it ends. Nested, the outer run's
    memo is used (a value's facts do not change inside a run)."""
    if _RUN.get() is not None:
        yield
        return
    token = _RUN.set({})
    try:
        yield
    finally:
        _RUN.reset(token)


def remembered(key: Hashable, compute: Callable[[], Any]) -> Any:
    """``compute()``, once per run for ``key`` (every call computes outside :func:`once_per_run`)."""
    run = _RUN.get()
    if run is None:
        return compute()
    if key in run:
        return run[key]
    out = run[key] = compute()
    return out


def about_tensor(kind: str, t: torch.Tensor, compute: Callable[[torch.Tensor], Any]) -> Any:
    """``compute(t)``, once per run for the tensor object ``t`` (or, for a view, the same elements of
    its base) while it is alive and unchanged (its version counter, which a view shares with its
    base; the memo holds the object weakly and compares identity, so a new tensor at the same address
    is never taken for it). ``kind`` names the fact."""
    run = _RUN.get()
    if run is None or t.is_inference():  # (an inference-mode tensor has no version counter)
        return compute(t)
    # a view (a recomputed segment's expand of a kept mask is a new object each time) is known by
    # its base and its place in it: the same elements of the same unchanged tensor
    anchor = t._base if t._base is not None else t
    key = ("tensor", kind, id(anchor), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
    hit = run.get(key)
    if hit is not None and hit[0]() is anchor and hit[1] == t._version:
        return hit[2]
    out = compute(t)
    run[key] = (weakref.ref(anchor), t._version, out)
    return out
