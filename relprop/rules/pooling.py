"""Spatial pooling and resampling of convolutional features (hybrid models: PoolFormer-style token
mixers, MaxViT/CoAtNet downsampling, EfficientFormerV2's upsampling, CNN stems).

Every op here is a linear map of its input without bias (average pooling, adaptive average
pooling, bilinear/nearest upsampling: fixed non-negative weights) or a selection (max pooling: the
gradient routes to the maximum), so y_j = Σ_i w_ji x_i with w = ∂y/∂x, and one formula serves them
all, computed with the op's own vector-Jacobian product::

    R_x = x ⊙ (∂y/∂x)ᵀ (R / y)        (R / y stabilized by ε, 0 where y = 0)

* ``"chefer2021"`` and ``"lrp"``: the z-rule, as the authors' code applies it to pooling layers
  (``layers_ours.AvgPool2d``, ``MaxPool2d`` and ``AdaptiveAvgPool2d`` are ``RelPropSimple``:
  ``Z = forward(X); S = R / Z; R = X * grad(Z, X, S)``). Max pooling gives each window's relevance
  to its maximum.
* ``"attnlrp"`` (and ``"cp_lrp"``): the ε-rule of AttnLRP Eq. 8 on a linear map without bias,
  the same formula with the stabilizer; gradient form: the op's own gradient with the ε-rule's
  stabilizer (:func:`relprop.rules.gradient_forms.epsilon_stabilized`).

``max_pool2d_with_indices`` and ``adaptive_max_pool2d`` return ``(values, indices)``; only the
values carry relevance. Global average pooling is exported as ``mean`` and has its rule in
:mod:`relprop.rules.reductions`.
"""
from __future__ import annotations

import dataclasses

import torch

from .attnlrp import ATTNLRP
from .generic import gradient_times_input
from .gradient_forms import epsilon_stabilized
from .rule_registry import rule

aten = torch.ops.aten
PAPER_PRESETS = ("chefer2021", "lrp")

POOLS = (aten.avg_pool1d.default, aten.avg_pool2d.default, aten.avg_pool3d.default,
         aten._adaptive_avg_pool2d.default, aten._adaptive_avg_pool3d.default, aten.adaptive_avg_pool1d.default,
         aten.max_pool2d_with_indices.default, aten.max_pool3d_with_indices.default,
         aten.adaptive_max_pool2d.default, aten.adaptive_max_pool1d.default)
RESAMPLING = (aten.upsample_bilinear2d.vec, aten.upsample_bilinear2d.default, aten.upsample_nearest2d.vec,
              aten.upsample_nearest2d.default, aten.upsample_nearest1d.vec, aten.upsample_linear1d.vec,
              aten.upsample_bicubic2d.vec, aten._upsample_bilinear2d_aa.vec)


def linear_map_shares(ctx, relevance):
    """R_x = x ⊙ (∂y/∂x)ᵀ (R / y) for the op's input (argument 0), nothing to the other arguments
    (sizes, strides, flags): the z-rule / ε-rule of a linear map without bias."""
    live = (ctx.live[0],) + (False,) * (len(ctx.args) - 1)
    shares = gradient_times_input(dataclasses.replace(ctx, live=live), relevance)
    return (shares[0],) + (None,) * (len(ctx.args) - 1)


@rule(*POOLS, *RESAMPLING, preset=PAPER_PRESETS)
def pooling_z(ctx, relevance):
    """Average/max pooling, upsampling: the z-rule, R_x = x ⊙ (∂y/∂x)ᵀ (R / y), as the authors'
    ``RelPropSimple`` pooling layers (CVPR 2021 code; module docstring)."""
    return linear_map_shares(ctx, relevance)


@rule(*POOLS, *RESAMPLING, preset=ATTNLRP, gradient_form=epsilon_stabilized())
def pooling_epsilon(ctx, relevance):
    """Average/max pooling, upsampling: the ε-rule of a linear map without bias (AttnLRP Eq. 8),
    R_x = x ⊙ (∂y/∂x)ᵀ (R / (y + ε·sign y)) (module docstring)."""
    return linear_map_shares(ctx, relevance)
