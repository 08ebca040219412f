"""Products of two input-dependent tensors: the attention matmuls A·V and Q·Kᵀ.

CVPR 2021, §3.2 and Lemma 1 (ii): for a product of two tensors the z-rule (gradient × input)
gives *each* operand the whole incoming relevance, so their shares sum to twice the incoming total.
The authors' code (``Attention.relprop`` in ``baselines/ViT/ViT_LRP.py``) therefore divides both
shares by 2. The relevance of the attention map, R_A, is read after that halving (Eq. 9–10).
Both presets (``"chefer2021"`` and ``"lrp"``) do this. When one operand is a constant the product
is a linear map and the linear rule of the preset applies (:mod:`relprop.rules.linear`).
"""
from __future__ import annotations

import torch

from .linear import constant_matrix_product
from .normalization import is_statistic
from .rule_registry import rule
from .stabilize import promote, safe_divide, scratch, times_fresh

aten = torch.ops.aten


def z_rule_matmul(a: torch.Tensor, b: torch.Tensor, z: torch.Tensor, relevance: torch.Tensor, eps: float):
    """Z-rule for ``z = a @ b`` (Lemma 1): ``R_a = a ⊙ (S bᵀ)``, ``R_b = b ⊙ (aᵀ S)``, ``S = R / z``.

    Each of the two returned shares sums to Σ R (where z ≠ 0). Shares are shaped like the
    broadcast product, which the interpreter reduces onto the operands.
    """
    s = safe_divide(relevance, z, eps)
    ra = times_fresh(s @ b.transpose(-1, -2), a)
    rb = times_fresh(a.transpose(-1, -2) @ s, b)
    return ra, rb


def _halved(r: torch.Tensor) -> torch.Tensor:
    """``r / 2`` for a share the rule made itself (in place where autograd does not record it)."""
    return r.div_(2) if scratch(r) else r / 2


@rule(aten.matmul.default, aten.bmm.default, aten.mm.default, preset=("chefer2021", "lrp"))
def matmul(ctx, relevance):
    """Attention products (both operands live): z-rule on each operand, then both halved
    (CVPR 2021 Lemma 1 and §3.2; ``cam1 /= 2`` etc. in ``Attention.relprop`` of the authors'
    ``ViT_LRP.py`` and ``ViT_orig_LRP.py``, the same in their BERT).

    With one constant operand the product is a linear layer: the active preset's linear rule
    (:func:`relprop.rules.linear.constant_matrix_product`).
    """
    a, b = ctx.args[0], ctx.args[1]
    if not (ctx.live[0] is True and ctx.live[1] is True):
        return constant_matrix_product(ctx, relevance)
    if a.dim() < 2 or b.dim() < 2:
        # vector operands: promote to matrices as torch.matmul does; shares come back in the
        # broadcast shape (the interpreter sums them onto the operand)
        a2 = promote(a).unsqueeze(0) if a.dim() == 1 else promote(a)
        b2 = promote(b).unsqueeze(-1) if b.dim() == 1 else promote(b)
        z = a2 @ b2
        ra, rb = z_rule_matmul(a2, b2, z, relevance.reshape(z.shape), ctx.eps)
        if a.dim() == 1:
            ra = ra.squeeze(-2)
        if b.dim() == 1:
            rb = rb.squeeze(-1)
        return (ra / 2, rb / 2)
    z = promote(ctx.out)
    if relevance.numel() <= min(a.numel(), b.numel()):
        # halved before, not after: (R/2)/z = (R/z)/2 and the products scale alike, exactly (a power
        # of 2), so the shares are the same numbers, with a pass over the smaller tensor (A·V: R is
        # tokens × d, the share of A tokens × tokens)
        return z_rule_matmul(promote(a), promote(b), z, relevance * 0.5, ctx.eps)
    ra, rb = z_rule_matmul(promote(a), promote(b), z, relevance, ctx.eps)
    return (_halved(ra), _halved(rb))


@rule(aten.mul.Tensor, preset=("chefer2021", "lrp"))
def multiply(ctx, relevance):
    """Element-wise product.

    One constant factor (a gain, a scale, a 0/1 mask): R passes to the live factor unchanged, as
    the paper's code treats scaling. Two live factors (gates): the z-rule gives each the whole R
    (Lemma 1 ii), then both are halved, as for the attention products. A live factor that is a
    normalizing statistic of the input (RMSNorm's ``rsqrt(mean(x²) + ε)``, see
    :mod:`relprop.rules.normalization`) is treated like LayerNorm's: the other factor gets all of R.
    """
    a, b = ctx.args[0], ctx.args[1]
    live_a, live_b = ctx.live[0] is True, ctx.live[1] is True
    if live_a and live_b and is_statistic(ctx, 1):
        return (relevance, None)
    if live_a and live_b and is_statistic(ctx, 0):
        return (None, relevance)
    if live_a and live_b:
        z = promote(ctx.out)
        s = safe_divide(relevance, z, ctx.eps)
        return (promote(a) * promote(b) * s / 2, promote(a) * promote(b) * s / 2)
    if live_a:
        return (relevance, None)
    if live_b:
        return (None, relevance)
    return (None, None)
