"""Numerical stabilization shared by the rules.

LRP rules divide relevance by a pre-activation ``z``. Where ``z`` is zero (or not finite, e.g. a
``-inf`` attention mask added to a score) the share is undefined; the authors' code returns zero
there and pushes other denominators away from zero by 1e-9. We do the same, but push in the
direction of ``z``'s sign, so that a small negative ``z`` is not pushed *through* zero.
"""
from __future__ import annotations

import torch

DEFAULT_EPS = 1e-9


def promote(t):
    """A floating tensor in the precision relevance is computed in: at least float32 (float16 and
    bfloat16 are upcast), float64 kept. Anything else (integer and boolean tensors, numbers, None)
    is returned as it is. Used wherever relevance or a rule's arithmetic is computed, instead of
    ``.float()``, so that a float64 model gets float64 relevance."""
    if torch.is_tensor(t) and t.is_floating_point() and t.dtype not in (torch.float32, torch.float64):
        return t.float()
    return t


def relevance_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype relevance has for activations of ``dtype``: float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def safe_divide(num: torch.Tensor, den: torch.Tensor, eps: float = DEFAULT_EPS) -> torch.Tensor:
    """``num / den`` with ``den`` pushed ``eps`` away from 0; 0 where ``den`` is 0 or not finite.

    Never returns NaN or inf for finite ``num``; a quotient that
    overflows is set to 0 as well.
    """
    if eps:
        out = num / (den + torch.copysign(torch.full((), eps, dtype=den.dtype, device=den.device), den))
    else:
        out = num / den
    out = out.masked_fill(den == 0, 0.0)
    return torch.nan_to_num_(out, nan=0.0, posinf=0.0, neginf=0.0) if out.is_floating_point() else out


def finite(t: torch.Tensor) -> torch.Tensor:
    """``t`` with NaN and ±inf replaced by 0 (used on products of relevance with masks)."""
    return torch.nan_to_num(t, nan=0.0, posinf=0.0, neginf=0.0)
