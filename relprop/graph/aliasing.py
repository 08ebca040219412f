"""Whether tensors share memory.

The engine, the rules and the methods overwrite a buffer in place only where no other value reads
it (on long inputs each new attention-sized tensor is memory the kernel faults in page by page);
this is the one test they use for "is this the same memory as that".
"""
from __future__ import annotations

from typing import Optional

import torch


def shares_memory(t, *others) -> bool:
    """Whether the tensor ``t`` has the same storage as any tensor among ``others`` (a view of it,
    the tensor itself, or a tensor it is a view of); anything that is not a tensor shares nothing.
    A tensor without storage of its own to compare (a functional tensor of a program being traced,
    :mod:`relprop.engine.compiled_walk`) may share with any other: True, so nothing is overwritten."""
    if not torch.is_tensor(t):
        return False
    ptr = storage_of(t)
    # (a tensor whose storage_of is None has none to compare, a functional tensor: it may share)
    return any(torch.is_tensor(o) and (ptr is None or storage_of(o) in (ptr, None)) for o in others)


def storage_of(t) -> Optional[int]:
    """The address of ``t``'s storage (None for what is not a tensor with one), for a set of the storages
    of many values that one test is made against (:func:`shares_memory` against each is slower)."""
    if not torch.is_tensor(t):
        return None
    try:
        return t.untyped_storage().data_ptr()
    except RuntimeError:
        return None
