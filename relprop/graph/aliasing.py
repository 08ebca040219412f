"""Whether tensors share memory.

The engine, the rules and the methods overwrite a buffer in place only where no other value reads
it (on long inputs each new attention-sized tensor is memory the kernel faults in page by page);
this is the one test they use for "is this the same memory as that".
"""
from __future__ import annotations

import weakref
from typing import Dict, Iterable, Optional

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


class KeptStorages:
    """The storages of values no rule may overwrite, gathered once, as weak references: an address
    counts only while its storage is alive. (A value freed during the walk leaves its address to the
    allocator; a new tensor given that address is not one of the kept values, and plain addresses
    gathered once would take it for one, so that the answer depended on where the allocator put it.)"""

    def __init__(self, values: Iterable):
        self._refs: Dict[int, weakref.ref] = {}
        for t in values:
            ptr = storage_of(t)
            if ptr is not None:
                self._refs[ptr] = weakref.ref(t.untyped_storage())

    def holds(self, t) -> bool:
        """Whether ``t``'s storage is one of the kept values' (alive: the same memory, not its address
        reused)."""
        return self.holds_address(storage_of(t))

    def holds_address(self, ptr: Optional[int]) -> bool:
        """:meth:`holds` for a storage address (:func:`storage_of`) the caller has read already."""
        ref = self._refs.get(ptr) if ptr is not None else None
        return ref is not None and ref() is not None
