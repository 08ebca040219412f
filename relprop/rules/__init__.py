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
``gradient_forms``  rules as modified gradients (autograd functions) for the one-backward fast path
==================  ======================================================================
"""
from .registry import define_preset, describe, get_preset, lookup, presets, rule  # noqa: F401
from .context import RuleContext  # noqa: F401
from . import routing, passthrough, linear, products, residual, convolution, reductions  # noqa: F401,E402
from . import pointwise, normalization  # noqa: F401,E402
from . import windows  # noqa: F401,E402
from . import attnlrp, cp_lrp  # noqa: F401,E402
