"""Relevance rules, one module per op family, and the registry that groups them in presets.

==================  ======================================================================
module              ops
==================  ======================================================================
``routing``         shape-only ops (view, permute, slice, select, cat, expand, ...)
``passthrough``     GELU, softmax, LayerNorm, tanh, scaling by constants, where, masks
``linear``          ``aten.linear``, ``aten.addmm``, products with a constant matrix
``products``        attention matmuls and element-wise products of two live tensors
``residual``        add / sub (residual connections, position embeddings, masks)
``convolution``     the patch embedding (z^B on pixels)
``reductions``      sum/mean pooling (z-rule), division by a norm or other statistic
``pointwise``       element-wise maths written out op by op: neg, pow, rsqrt, sqrt (gelu_new, RoPE)
``normalization``   products with a normalizing statistic (RMSNorm's x · rsqrt(mean(x²) + ε))
``windows``         Swin's shape ops: constant_pad_nd, roll, as_strided, unfold, flip
``attnlrp``         the AttnLRP preset (Achtibat et al., ICML 2024), with modified-gradient forms
``cp_lrp``          the CP-LRP preset (Ali et al., ICML 2022): attention and gates held constant
``pa_lrp``          the PA-LRP preset (Bakish et al., NeurIPS 2025): position relevance reassigned to tokens
``norm_layers``     BatchNorm in inference and GroupNorm (hybrid and convolutional models), every preset
``pooling``         average/max pooling and upsampling of feature maps, every preset
``scatter``         writes (index_put with masks, slice_scatter, select_scatter); norms, amax, max.dim
``moe``             mixture-of-experts layers: top-k routing, the experts' grouped products, gate weights
``gradient_forms``  rules as modified gradients (autograd functions) for the one-backward fast path
``spec``            :class:`RuleSpec`: a rule with what it declares (its gradient form, formula, ...)
==================  ======================================================================

The registry: ``preset_table`` (the :class:`Preset`, a named table of rules extending other presets),
``rule_registry`` (presets by name, the ``@rule`` decorator, ``override``) and ``builtin_presets``
(``"base"``, ``"chefer2021"``, ``"lrp"``).
"""
# the rule modules register their rules when imported; a preset's table is complete after the last
from . import routing, passthrough, linear, products, residual, convolution, reductions
from . import pointwise, normalization, windows, moe, attnlrp, cp_lrp, pa_lrp, norm_layers, pooling, scatter
from .context import RuleContext
from .gradient_forms import gradient_form
from .rule_registry import Preset, describe, get_preset, lookup, override, presets, rule, seal_builtins
from .spec import RuleSpec

seal_builtins(presets())

__all__ = ["Preset", "RuleContext", "RuleSpec", "describe", "get_preset", "gradient_form", "lookup", "override",
           "presets", "rule",
           # the rule modules, one per op family
           "attnlrp", "convolution", "cp_lrp", "linear", "moe", "norm_layers", "normalization", "pa_lrp", "passthrough",
           "pointwise", "pooling", "products", "reductions", "residual", "routing", "scatter", "windows"]
