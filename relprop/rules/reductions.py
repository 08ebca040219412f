"""Reductions and normalizations: pooling over tokens (``sum``, ``mean``) and division by a
statistic of the input itself (L2 normalization of a sentence embedding, RMS/mean statistics).

* ``sum`` / ``mean`` over some dimensions (mean pooling of token states): the z-rule,
  R_i = x_i / Σ_k x_k · R (Bach et al. 2015, Eq. 56-58), each element's share of the pooled value.
  It conserves relevance wherever the pooled value is non-zero.
* ``x / y`` where y is computed from the input (a norm, a standard deviation): relevance passes to
  x unchanged and the statistic y receives none, the same convention as the identity rule on
  LayerNorm (CVPR 2021 code) and on normalization statistics (AttnLRP, Achtibat et al. 2024).
  ``linalg_vector_norm``, ``sqrt``, ``rsqrt`` and ``pow`` therefore never receive relevance when
  they only feed such a divisor.
"""
from __future__ import annotations

import torch

from .rule_registry import rule
from .stabilize import promote, safe_divide

aten = torch.ops.aten


def _reduced_dims(x, dims):
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return list(range(x.dim()))
    if isinstance(dims, int):
        dims = [dims]
    return [d % x.dim() for d in dims]


@rule(aten.sum.dim_IntList, aten.mean.dim, preset=("chefer2021", "lrp"))
def pooling_z_rule(ctx, relevance):
    """Sum/mean pooling: R_i = x_i / Σ_k x_k · R over each pooled group (z-rule)."""
    x = promote(ctx.args[0])
    dims = _reduced_dims(x, ctx.args[1] if len(ctx.args) > 1 else None)
    keepdim = bool(ctx.args[2]) if len(ctx.args) > 2 else bool(ctx.kwargs.get("keepdim", False))
    z = x.sum(dims, keepdim=True)
    r = relevance
    if not keepdim:
        for d in sorted(dims):
            r = r.unsqueeze(d)
    return (x * safe_divide(r, z, ctx.eps),) + (None,) * (len(ctx.args) - 1)


@rule(aten.div.Tensor, preset=("chefer2021", "lrp"), no_relevance_to={1})
def divide_by_statistic(ctx, relevance):
    """x / c, c constant or a statistic of the input (a norm): R_x = R_out; the divisor gets none."""
    live_x = ctx.live[0] is True
    return ((relevance if live_x else None),) + (None,) * (len(ctx.args) - 1)

