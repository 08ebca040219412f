"""relprop: explain the predictions of unmodified transformer models.

``relprop.explain(model, inputs, target=t)`` captures the model's graph with ``torch.export``,
propagates relevance through it with the rules of Chefer, Gur & Wolf, *Transformer
Interpretability Beyond Attention Visualization* (CVPR 2021), and aggregates the per-block
attention records into token/patch scores.

The package is built as one-way layers (``docs/architecture.md``): ``errors`` → ``graph`` →
``rules`` → ``engine`` → ``methods`` → ``viz`` → ``explanation`` → ``api`` → ``evaluation`` →
``cli``; this module only gathers the public names.
"""
from . import methods
from .api import coverage, explain, explain_settings
from .actmax import visualize
from .generation import GenerationExplanation, explain_generation
from .engine import Conservation, Coverage, Trace
from .errors import (CaptureError, InputError, MethodError, OptionError, PresetError, RelpropError, RelpropWarning,
                     TargetError, UnsupportedOperation)
from .explanation import Explanation
from .graph.capture import CACHE_SIZE, clear_cache
from .rules import Preset, RuleContext, get_preset, presets, rule
from .targets import contrast
from .version import __version__


__all__ = [
    # explaining
    "explain", "explain_settings", "visualize", "coverage", "methods", "contrast", "Explanation", "Conservation",
    "Coverage", "Trace", "explain_generation", "GenerationExplanation",
    # rules and presets
    "Preset", "RuleContext", "get_preset", "presets", "rule",
    # the capture cache
    "CACHE_SIZE", "clear_cache",
    # errors and warnings
    "RelpropError", "CaptureError", "InputError", "MethodError", "OptionError", "PresetError", "TargetError",
    "UnsupportedOperation", "RelpropWarning",
    "__version__",
]
