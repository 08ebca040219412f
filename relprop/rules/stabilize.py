"""Numerical stabilization shared by the rules.

LRP rules divide relevance by a pre-activation ``z``. Where ``z`` is zero (or not finite, e.g. a
``-inf`` attention mask added to a score) the share is undefined; the authors' code returns zero
there and pushes other denominators away from zero by 1e-9. We do the same, but push in the
direction of ``z``'s sign, so that a small negative ``z`` is not pushed *through* zero.
"""
from __future__ import annotations

import torch

DEFAULT_EPS = 1e-9


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


def upcast(t: torch.Tensor) -> torch.Tensor:
    """``t`` in the precision the rules compute in: float32 at least (half precision, integers and
    booleans become float32), float64 kept, so that a float64 model is explained in float64."""
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


def finite(t: torch.Tensor) -> torch.Tensor:
    """``t`` with NaN and ±inf replaced by 0 (used on products of relevance with masks)."""
    return torch.nan_to_num(t, nan=0.0, posinf=0.0, neginf=0.0)
