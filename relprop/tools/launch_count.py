"""How many kernels and host round trips a call costs: every aten op it dispatches, counted.

On an accelerator every kernel is a launch (several microseconds each, whatever its size) and every
op whose result the host must read (a *host sync*: ``.item()``, ``bool(t)``, ``nonzero``, ...) stalls
the queue until the device has caught up. Both are properties of the program, not of the device, so
they are counted deterministically on the CPU: :func:`count` runs a function under a
:class:`torch.utils._python_dispatch.TorchDispatchMode` and counts each aten op it dispatches,
leaving out the ops that launch nothing: those that only make an alias (views, ``detach``,
``as_strided``, ``_unsafe_view``), only read or assert metadata (sizes, strides, ``promote_types``,
``_assert_tensor_metadata``) or only allocate (``empty``). A :class:`torch.overrides.TorchFunctionMode`
counts the host reads that dispatch no aten op (``Tensor.tolist``, ``Tensor.numpy``) as syncs too.

    >>> from relprop.tools.launch_count import count
    >>> c = count(lambda: relprop.explain(model, x))
    >>> c.kernels, c.syncs, c.by_op.most_common(5)
"""
from __future__ import annotations

import collections
import dataclasses
import traceback
from typing import Callable, Counter, Dict, List, Optional

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

#: aten ops whose result the host reads before the next op can be issued (their overload packets)
SYNC_OPS = frozenset({
    torch.ops.aten._local_scalar_dense, torch.ops.aten.nonzero, torch.ops.aten.masked_select,
    torch.ops.aten._unique, torch.ops.aten._unique2, torch.ops.aten.unique_dim, torch.ops.aten.unique_consecutive,
    torch.ops.aten.equal, torch.ops.aten.is_nonzero,
})

#: aten ops that launch no kernel: metadata reads and assertions, views that carry no alias
#: information in their schema, allocations without a fill
NO_LAUNCH = frozenset({
    torch.ops.aten.sym_size, torch.ops.aten.sym_stride, torch.ops.aten.sym_numel, torch.ops.aten.sym_storage_offset,
    torch.ops.aten.size, torch.ops.aten.stride, torch.ops.aten.dim, torch.ops.aten.is_same_size,
    torch.ops.prim.device, torch.ops.prim.layout, torch.ops.aten.promote_types, torch.ops.aten.result_type,
    torch.ops.aten._assert_tensor_metadata, torch.ops.aten.sym_constrain_range_for_size,
    torch.ops.aten._unsafe_view, torch.ops.aten.empty, torch.ops.aten.empty_like, torch.ops.aten.empty_strided,
    torch.ops.aten.new_empty, torch.ops.aten.new_empty_strided,
})
#: Tensor methods that copy a tensor's data to the host without an aten op of their own
HOST_READS = frozenset({torch.Tensor.tolist, torch.Tensor.numpy})


def is_alias(func) -> bool:
    """Whether aten op ``func`` only returns an alias of an input (a view, ``detach``): its returns
    carry alias information that is not a write (in-place and ``out=`` ops write and do launch)."""
    returns = func._schema.returns
    if not returns:
        return False
    return all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


@dataclasses.dataclass
class Counts:
    """What :func:`count` saw.

    Attributes
    ----------
    kernels : the aten ops dispatched that compute (aliasing and metadata ops left out), syncs included.
    syncs : the ops among them whose result the host waits for (:data:`SYNC_OPS`, :data:`HOST_READS`).
    by_op : kernels per op (``"mul.Tensor"``).
    sync_sites : with ``where=True``: for each sync, the innermost relprop frames that issued it
        (``"relprop/engine/walk.py:212 visit"``), counted.
    """

    kernels: int = 0
    syncs: int = 0
    by_op: Counter = dataclasses.field(default_factory=collections.Counter)
    sync_sites: Counter = dataclasses.field(default_factory=collections.Counter)

    def ratio(self, other: "Counts") -> float:
        """Kernels of this call per kernel of ``other`` (e.g. one forward+backward pass)."""
        return self.kernels / max(1, other.kernels)


class _Counting(TorchDispatchMode):
    def __init__(self, counts: Counts, where: bool, frames: int):
        super().__init__()
        self.counts, self.where, self.frames = counts, where, frames

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        packet = func.overloadpacket
        if packet not in NO_LAUNCH and not is_alias(func):
            c = self.counts
            c.kernels += 1
            c.by_op[f"{packet.__name__}.{func._overloadname}"] += 1
            if packet in SYNC_OPS:
                c.syncs += 1
                if self.where:
                    c.sync_sites[_site(self.frames)] += 1
        return func(*args, **(kwargs or {}))


class _HostReads(TorchFunctionMode):
    def __init__(self, counting: _Counting):
        super().__init__()
        self.counting = counting

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in HOST_READS:
            c = self.counting.counts
            c.kernels += 1
            c.syncs += 1
            c.by_op[f"Tensor.{func.__name__}"] += 1
            if self.counting.where:
                c.sync_sites[_site(self.counting.frames)] += 1
        return func(*args, **(kwargs or {}))


def _site(frames: int) -> str:
    """The innermost ``frames`` frames of relprop's own code on the stack (else the innermost frames)."""
    stack = [f for f in traceback.extract_stack() if "launch_count" not in f.filename]
    own = [f for f in stack if "/relprop/" in f.filename.replace("\\", "/")]
    picked = (own or stack)[-frames:]
    return " < ".join(f"{_short(f.filename)}:{f.lineno} {f.name}" for f in reversed(picked))


def _short(path: str) -> str:
    path = path.replace("\\", "/")
    i = path.rfind("/relprop/")
    return path[i + 1:] if i >= 0 else path.rsplit("/", 2)[-1]


def count(fn: Callable[[], object], where: bool = False, frames: int = 2) -> Counts:
    """Run ``fn()`` once and count the kernels and host syncs it dispatches (module docstring).
    ``where``: also record, per sync, the ``frames`` innermost frames of relprop that issued it
    (:attr:`Counts.sync_sites`)."""
    counts = Counts()
    counting = _Counting(counts, where, frames)
    with counting, _HostReads(counting):
        fn()
    return counts


def table(rows: Dict[str, Counts], unit: Optional[str] = None, peer: Optional[str] = None) -> List[str]:
    """Markdown rows ``| call | kernels | syncs | × unit | × peer |`` for ``rows`` (name -> counts);
    ``unit`` and ``peer`` name rows the ratios are taken against."""
    out = ["| call | kernels | host syncs | × " + (unit or "first") + " |" + (f" × {peer} |" if peer else ""),
           "|---|---:|---:|---:|" + ("---:|" if peer else "")]
    base = rows.get(unit) if unit else next(iter(rows.values()))
    ref = rows.get(peer) if peer else None
    for name, c in rows.items():
        line = f"| {name} | {c.kernels} | {c.syncs} | {c.ratio(base):.2f} |"
        if peer:
            line += f" {c.ratio(ref):.2f} |" if ref is not None else " — |"
        out.append(line)
    return out
