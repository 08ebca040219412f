"""Element-wise functions of one input that transformers write out op by op.

Decoder graphs contain element-wise maths that encoders get as one fused op: GPT-2's ``gelu_new``
is ``0.5·x·(1 + tanh(√(2/π)(x + 0.044715·x³)))`` (``pow``, ``tanh``, ``mul``, ``add``), LLaMA's
RMSNorm is ``x · rsqrt(mean(x²) + ε)`` (``pow``, ``mean``, ``rsqrt``) and its rotary embedding
rotates halves of the query with ``neg`` and ``cat``.

* ``neg``: y = −x is linear; the z-rule R_x = x · (∂y/∂x) · R / y = R is exact, so relevance passes
  unchanged (and any sign flip is already in the value, not in the relevance).
* ``pow`` (by a number), ``rsqrt``, ``sqrt``: element-wise non-linearities
  of one live input. Chefer, Gur & Wolf (CVPR 2021, §3.2; the authors' ``RelProp.relprop`` for
  GELU, softmax and the other non-parametric layers) give such layers the identity rule, which
  is conservative; we do the same. (The z-rule would scale relevance by the local exponent, e.g.
  3·R for x³, and is not conservative.) In RMSNorm these ops only feed the normalizing statistic,
  which receives no relevance (see :mod:`relprop.rules.normalization`), so their rule is never
  reached there; it is used where they sit on the relevance path, as in ``gelu_new``.

Registered for both paper presets (``"chefer2021"`` and ``"lrp"``).
"""
from __future__ import annotations

import torch

from .rule_registry import rule

aten = torch.ops.aten
PAPER_PRESETS = ("chefer2021", "lrp")


@rule(aten.neg.default, preset=PAPER_PRESETS)
def negation(ctx, relevance):
    """y = −x (rotary embeddings' ``rotate_half``): the exact z-rule, R_x = R_y."""
    return (relevance,)


@rule(aten.pow.Tensor_Scalar, aten.rsqrt.default, aten.sqrt.default, preset=PAPER_PRESETS)
def elementwise_identity(ctx, relevance):
    """Element-wise non-linearity of one input (x^p, x^-1/2, √x): R_x = R_y, as the CVPR 2021
    code treats non-parametric element-wise layers (``RelProp.relprop`` returns R)."""
    return (relevance,) + (None,) * (len(ctx.args) - 1)
