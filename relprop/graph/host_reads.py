"""At most one host read per call: the checks, warnings and assumptions of one ``explain()`` read on the
host together, once, at its end.

On an accelerator every op whose result the host reads (``.item()``, ``bool(t)``, ``.tolist()``,
``nonzero``) waits until every kernel queued before it has run: the device idles while the host catches
up, then the host idles while the queue fills again. relprop's checks of the user's inputs (token ids in
the vocabulary, finite values, padding), of its results (finite, not uniform to rounding) and a few
decisions taken from values (a sum that cancels in float32) read values. Within :func:`one_read` (the scope
of one ``explain()`` call) such code hands its tensors over instead of reading them:

* :func:`refuse_if`: a check whose failure is an error, raised at the end of the call (the inputs are
  checked first, so the error names the user's mistake, not what it caused);
* :func:`later`: a callback on the values (a warning, a note), called at the end;
* :func:`expect`: an assumption the call was computed under, verified on the device (e.g. no output of a
  linear rule cancels in float32). Where one fails, the call is computed again in a *careful* scope, where
  no assumption is made and values are read where they are needed (:func:`speculating` is False there);
  the Explanations say so in their notes.

:func:`settle` reads every handed-over tensor in one transfer (one ``.tolist()`` of their concatenation).
Outside a scope (a direct caller of the engine or the methods) everything is read at once, as before.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any, Callable, List, Optional, Tuple

import torch

_SCOPE: contextvars.ContextVar = contextvars.ContextVar("relprop_host_reads", default=None)


class Recompute(Exception):
    """An assumption of the call failed (:func:`expect`): it is computed again, carefully."""

    def __init__(self, reasons: List[str]):
        super().__init__("; ".join(reasons))
        self.reasons = reasons


@dataclasses.dataclass
class Reads:
    """One call's handed-over reads: (tensor, kind, payload) in order; ``speculate``: assumptions allowed.
    A backward pass that autograd may run on a thread of its own (CUDA) reads no context: a function whose
    backward assumes something takes the call's ``Reads`` in its forward (:func:`scope`) and calls its
    :meth:`expect` there."""

    speculate: bool = True
    items: List[Tuple[torch.Tensor, str, Any]] = dataclasses.field(default_factory=list)

    def expect(self, violated: torch.Tensor, reason: str) -> None:
        """:func:`expect` in this scope."""
        self.items.append((violated, "expect", reason))


def scope() -> Optional[Reads]:
    """The open call's :class:`Reads` when it speculates (assumptions allowed), else None."""
    reads = _SCOPE.get()
    return reads if reads is not None and reads.speculate else None


def deferring() -> bool:
    """Whether a call's scope is open: checks and warnings are read at its end."""
    return _SCOPE.get() is not None


def speculating() -> bool:
    """Whether the code may compute under an assumption verified at the end (:func:`expect`): inside a
    scope that is not careful."""
    scope = _SCOPE.get()
    return scope is not None and scope.speculate


def later(tensor: torch.Tensor, then: Callable[[list], None]) -> None:
    """``then(values)`` with the values of ``tensor`` (a flat list of Python numbers): at the end of the
    call's scope, or now outside one. ``then`` may warn or add notes; it raises only for a bug."""
    _hand_over(tensor, "later", then)


def refuse_if(flag: torch.Tensor, error: Callable[[list, list], Exception],
              details: Optional[torch.Tensor] = None) -> None:
    """Raise ``error(flags, details)`` (the values of ``flag`` and of ``details``, flat lists) when any
    element of ``flag`` is true: at the end of the call's scope (before any assumption is verified or
    warning given), or now outside one. ``details``: what the message needs (the offending values)."""
    flag = flag.detach().reshape(-1)
    if details is None:
        _hand_over(flag, "refuse", (error, flag.numel()))
        return
    details = details.detach().reshape(-1)
    dtype = torch.promote_types(details.dtype, torch.int64)
    _hand_over(torch.cat([flag.to(dtype), details.to(device=flag.device, dtype=dtype)]), "refuse",
               (error, flag.numel()))


def expect(violated: torch.Tensor, reason: str) -> None:
    """An assumption the call was computed under holds unless some element of ``violated`` is true; where
    it does not, the call is computed again in a careful scope (:class:`Recompute`). Only under
    :func:`speculating`; the caller takes its careful path elsewhere."""
    reads = scope()
    if reads is None:
        raise RuntimeError("relprop bug: an assumption made outside a speculating scope")
    reads.expect(violated, reason)


def _hand_over(tensor: torch.Tensor, kind: str, payload) -> None:
    reads = _SCOPE.get()
    if reads is None:
        _settle([(tensor, kind, payload)])
    else:
        reads.items.append((tensor, kind, payload))


def _values(items) -> List[list]:
    """Every item's tensor as a flat list of Python numbers, from one host transfer."""
    tensors = [t.detach().reshape(-1) for t, _, _ in items]
    if not tensors:
        return []
    dtype = torch.float32 if any(t.device.type == "mps" for t in tensors) else torch.float64
    device = tensors[0].device
    flat = torch.cat([t.to(device=device, dtype=dtype) for t in tensors]).tolist()
    out, at = [], 0
    for t in tensors:
        part = flat[at:at + t.numel()]
        out.append([int(v) for v in part] if not t.is_floating_point() else part)
        at += t.numel()
    return out


def _settle(items) -> None:
    """Read ``items`` once; raise the first refusal, then a :class:`Recompute` for the failed
    assumptions, then call the callbacks."""
    values = _values(items)
    for (_, kind, payload), v in zip(items, values):
        if kind == "refuse" and any(v[:payload[1]]):
            raise payload[0](v[:payload[1]], v[payload[1]:])
    failed = [payload for (_, kind, payload), v in zip(items, values) if kind == "expect" and any(v)]
    if failed:
        raise Recompute(list(dict.fromkeys(failed)))
    for (_, kind, payload), v in zip(items, values):
        if kind == "later":
            payload(v)


@contextlib.contextmanager
def _scope(speculate: bool):
    reads = Reads(speculate=speculate)
    token = _SCOPE.set(reads)
    try:
        try:
            yield reads
        except Recompute:
            raise
        except Exception as e:
            items, reads.items = reads.items, []
            try:  # a refusal of the inputs, or an assumption that failed, is the cause of what failed after it
                _settle([i for i in items if i[1] != "later"])
            except Exception as cause:  # noqa: BLE001 - a refusal's error (or a Recompute) replaces the failure
                raise cause from e
            raise
        items, reads.items = reads.items, []
        _settle(items)
    finally:
        _SCOPE.reset(token)


def one_read(body: Callable[[], Any]) -> Tuple[Any, Optional[List[str]]]:
    """``(body(), None)`` with the host reads of ``body`` deferred to its end and read once; where an
    assumption failed, ``(body(), reasons)`` from a second, careful run. Nested inside another call's
    scope, ``body`` joins it (its reads are settled with the outer call's)."""
    if _SCOPE.get() is not None:
        return body(), None
    try:
        with _scope(speculate=True):
            result = body()
        return result, None
    except Recompute as again:
        reasons = again.reasons
    with _scope(speculate=False):
        return body(), reasons
