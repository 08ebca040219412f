"""Explanation methods, each a small pure function of the per-block records (DESIGN §4).

=========================  ============================================================
module                     methods
=========================  ============================================================
``transformer_attribution``  the paper's method (CVPR 2021, Eq. 13–14)
``attention_baselines``    its Table-3 ablations, lrp, partial_lrp, raw_attention, rollout,
                           attention_gradcam (CVPR 2021); gradient_rollout (ICCV 2021)
``attcat``                 cat, attcat, grads, attgrads (AttCAT paper); attention_norm; gradcam
``gradients``              input_x_gradient, smoothgrad, integrated_gradients
``perturbation``           value_zeroing, vit_cx
=========================  ============================================================

A method is ``fn(trace, **options) -> dict`` with ``"tokens"`` ([batch, tokens]: every token of the
graph, class/distillation tokens included, for images; every position for text), optionally
``"matrix"`` ([batch, tokens, tokens]) or, for input-level methods on images, ``"pixels"``
([batch, H, W]). :func:`relprop.explain` turns that into an :class:`relprop.Explanation`.
"""
from .registry import all_methods, get_method, method, MethodInfo  # noqa: F401
from . import transformer_attribution, attention_baselines, attcat, gradients, perturbation  # noqa: F401,E402
