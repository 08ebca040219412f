"""Explanation methods, each a small pure function of the per-block records of a trace.

=========================  ============================================================
module                     methods
=========================  ============================================================
``transformer_attribution``  the paper's method (CVPR 2021, Eq. 13–14)
``attention_baselines``    its Table-3 ablations, lrp, partial_lrp, raw_attention, rollout,
                           attention_gradcam (CVPR 2021); gradient_rollout (ICCV 2021)
``attcat``                 cat, attcat, grads, attgrads (AttCAT paper); attention_norm; gradcam
``gradients``              input_x_gradient, smoothgrad, integrated_gradients
``perturbation``           value_zeroing, vit_cx
``norm_flows``             attn_res_ln_norm (Kobayashi et al. 2021); the norms of attention_norm
``aggregation``            head fusion, block range, layer aggregation of the rollout-style methods
=========================  ============================================================

A method is ``fn(trace, **options) -> dict`` with ``"tokens"`` ([batch, tokens]: every token of the
graph, class/distillation tokens included, for images; every position for text), optionally
``"matrix"`` ([batch, tokens, tokens]) or, for input-level methods on images, ``"pixels"``
([batch, H, W]). :mod:`relprop.explanation` turns that into an :class:`relprop.Explanation`.

``relprop.methods`` is this package; called, ``relprop.methods()``, it returns the table of methods
(:func:`relprop.methods.method_registry.table`).
"""
import sys
import types

# the method modules register their methods when imported, in the order relprop.methods() lists them
from . import transformer_attribution, attention_baselines, attcat, gradients, perturbation, norm_flows
from .apply import apply
from .method_registry import MethodInfo, all_methods, get_method, method, table

__all__ = ["MethodInfo", "all_methods", "apply", "get_method", "method", "table",
           "attcat", "attention_baselines", "norm_flows", "gradients", "perturbation", "transformer_attribution"]


class _CallableModule(types.ModuleType):
    """The ``relprop.methods`` package, which is also the function ``relprop.methods()``."""

    def __call__(self):
        """Every method name with its description, class-specificity, sign and reference."""
        return table()


sys.modules[__name__].__class__ = _CallableModule
