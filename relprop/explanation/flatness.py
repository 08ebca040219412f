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

from typing import List, Optional

import torch

from ..errors import warn

#: a sample's shown scores are uniform when max − min ≤ FLAT_ULPS · eps(dtype) · max |score|
FLAT_ULPS = 8


def flat_samples(scores: torch.Tensor, mask: Optional[torch.Tensor] = None) -> List[int]:
    """The samples of ``scores`` ([batch, positions]) whose shown scores (``mask`` True; every
    position without a mask) are equal to the dtype's resolution: max − min ≤ FLAT_ULPS ulps of
    the largest |score| (all zero included). Samples with fewer than two shown positions are not
    flat."""
    if not torch.is_tensor(scores) or scores.dim() != 2 or not scores.is_floating_point():
        return []
    eps = torch.finfo(scores.dtype).eps
    out = []
    for b in range(scores.shape[0]):
        s = scores[b].detach()
        if mask is not None and tuple(mask.shape) == tuple(scores.shape):
            s = s[mask[b].to(s.device)]
        if s.numel() < 2 or not bool(torch.isfinite(s).all()):
            continue
        top = float(s.abs().max())
        if float(s.max() - s.min()) <= FLAT_ULPS * eps * top:
            out.append(b)
    return out


def check(method: str, scores: torch.Tensor, mask: Optional[torch.Tensor], cause: Optional[str],
          notes: List[str]) -> None:
    """Warn (:class:`relprop.RelpropWarning`) and add a note when some sample's map is uniform to
    the resolution of its dtype (:func:`flat_samples`), with ``cause`` in words (the method's
    reading of why) or a generic one."""
    flat = flat_samples(scores, mask)
    if not flat:
        return
    b = flat[0]
    s = scores[b] if mask is None or tuple(mask.shape) != tuple(scores.shape) else scores[b][mask[b]]
    top, spread = float(s.abs().max()), float(s.max() - s.min())
    why = cause or ("every shown score is the same to float rounding (e.g. a target that does not depend on the "
                    "input, or a method whose map has no contrast on this model)")
    what = ("every shown score is 0" if top == 0 else
            f"spread {spread:.2g} against a largest |score| of {top:.3g}, below {FLAT_ULPS} units in the last place "
            f"of {scores.dtype}")
    samples = flat if len(flat) <= 8 else flat[:8] + ["..."]
    message = (f"{method}: the map of sample(s) {samples} is uniform to {scores.dtype} resolution ({what}): every "
               f"position would be drawn the same. Cause: {why}")
    notes.append(message)
    warn(message)
