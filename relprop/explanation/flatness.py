"""No silent uniform picture: a map whose spread is below what its dtype can resolve is a warning.

Every picture relprop draws scales a sample's scores by their largest magnitude. When the scores of
the positions shown differ by no more than a few units in the last place of that magnitude, the
differences are float rounding, and the picture is one colour however the method ranks them. That
happens for a reason worth knowing (a rollout that keeps the identity share of a pooled query,
:mod:`relprop.methods.identity`; a target that does not depend on the input), so :func:`check`
raises a :class:`relprop.RelpropWarning` naming the method, the samples, the spread and the cause
the method gave (``"flat_cause"`` in its output), and says the same in ``exp.notes``.
"""
from __future__ import annotations

from typing import Any, List, Optional

import torch

from ..errors import warn
from ..graph.host_reads import later

#: a sample's shown scores are uniform when max − min ≤ FLAT_ULPS · eps(dtype) · max |score|
FLAT_ULPS = 8


def flat_flags(scores: torch.Tensor, mask: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """[3, batch] on the scores' device: per sample whether its shown scores (``mask`` True; every position
    without a mask) are equal to the dtype's resolution (max − min ≤ FLAT_ULPS ulps of the largest |score|,
    all zero included; samples with fewer than two shown positions or a non-finite score are not flat),
    their largest |score| and their spread. None for anything but floating [batch, positions] scores."""
    if not torch.is_tensor(scores) or scores.dim() != 2 or not scores.is_floating_point():
        return None
    s = scores.detach()
    shown = mask.to(s.device) if mask is not None and tuple(mask.shape) == tuple(s.shape) else None
    eps = torch.finfo(s.dtype).eps
    if shown is None:
        count = torch.full((s.shape[0],), s.shape[1], device=s.device)
        finite = torch.isfinite(s).all(1)
        top, hi, lo = s.abs().amax(1), s.amax(1), s.amin(1)
    else:
        count = shown.sum(1)
        finite = (torch.isfinite(s) | ~shown).all(1)
        top = torch.where(shown, s.abs(), 0.0).amax(1)
        hi = torch.where(shown, s, -torch.inf).amax(1)
        lo = torch.where(shown, s, torch.inf).amin(1)
    spread = hi - lo
    flat = (count >= 2) & finite & (spread <= FLAT_ULPS * eps * top)
    return torch.stack([flat.to(s.dtype), top, torch.where(flat, spread, 0.0)])


def flat_samples(scores: torch.Tensor, mask: Optional[torch.Tensor] = None) -> List[int]:
    """The samples of ``scores`` ([batch, positions]) whose shown scores are uniform to the dtype's
    resolution (:func:`flat_flags`), read now."""
    flags = flat_flags(scores, mask)
    return [] if flags is None else [b for b, f in enumerate(flags[0].tolist()) if f]


def check(method: str, scores: torch.Tensor, mask: Optional[torch.Tensor], cause: Any,
          notes: List[str]) -> None:
    """Warn (:class:`relprop.RelpropWarning`) and add a note when some sample's map is uniform to
    the resolution of its dtype (:func:`flat_flags`), with ``cause`` in words (the method's reading of why:
    a string, or a ``(describe, tensor)`` pair whose text is ``describe(values of tensor)``) or a generic one.
    Read with the call's other checks (:func:`relprop.graph.host_reads.later`)."""
    flags = flat_flags(scores, mask)
    if flags is None:
        return
    batch = flags.shape[1]
    describe, extra = (cause, None) if not isinstance(cause, tuple) else cause
    values = flags.reshape(-1) if extra is None else torch.cat([flags.reshape(-1),
                                                                extra.reshape(-1).to(flags.device, flags.dtype)])

    def warn_flat(v):
        flat = [b for b in range(batch) if v[b]]
        if not flat:
            return
        b = flat[0]
        top, spread = v[batch + b], v[2 * batch + b]
        why = describe(v[3 * batch:]) if callable(describe) else describe
        why = why or ("every shown score is the same to float rounding (e.g. a target that does not depend on the "
                      "input, or a method whose map has no contrast on this model)")
        what = ("every shown score is 0" if top == 0 else
                f"spread {spread:.2g} against a largest |score| of {top:.3g}, below {FLAT_ULPS} units in the last "
                f"place of {scores.dtype}")
        samples = flat if len(flat) <= 8 else flat[:8] + ["..."]
        message = (f"{method}: the map of sample(s) {samples} is uniform to {scores.dtype} resolution ({what}): "
                   f"every position would be drawn the same. Cause: {why}")
        notes.append(message)
        warn(message)
    later(values, warn_flat)
