"""relprop: explain the predictions of unmodified transformer models.

``relprop.explain(model, inputs, target=t)`` captures the model's graph with ``torch.export``,
propagates relevance through it with the rules of Chefer, Gur & Wolf, *Transformer
Interpretability Beyond Attention Visualization* (CVPR 2021), and aggregates the per-block
attention records into token/patch scores.
"""
from .errors import (CaptureError, InputError, MethodError, OptionError, RelpropError, TargetError,  # noqa: F401
                     UnsupportedOperation)
from .rules import rule, presets, RuleContext  # noqa: F401
from .rules.registry import define_preset  # noqa: F401
from .graph.capture import clear_cache, CACHE_SIZE  # noqa: F401
from .explanation import Explanation  # noqa: F401
from .api import explain  # noqa: F401
from .graph.coverage import Coverage, coverage  # noqa: F401
from .methods import all_methods as _all_methods


def methods():
    """Every method name with its description, class-specificity, sign and reference."""
    return {name: {"description": m.description, "class_specific": m.class_specific, "signed": m.signed,
                   "reference": m.reference}
            for name, m in _all_methods().items()}


__version__ = "0.1.0"
