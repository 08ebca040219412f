"""relprop: explain the predictions of unmodified transformer models.

``relprop.explain(model, inputs, target=t)`` captures the model's graph with ``torch.export``,
propagates relevance through it with the rules of Chefer, Gur & Wolf, *Transformer
Interpretability Beyond Attention Visualization* (CVPR 2021), and aggregates the per-block
attention records into token/patch scores.

The package is built as one-way layers (``docs/architecture.md``): ``errors`` → ``graph`` →
``rules`` → ``engine`` → ``methods`` → ``viz`` → ``explanation`` → ``api`` → ``evaluation`` →
``cli``; this module only gathers the public names.

It gathers them lazily (PEP 562): ``import relprop`` imports only the errors and the version, and
the module that defines a public name (:data:`LAZY_IMPORTS`) is imported the first time the name is
read (``relprop.explain``, ``from relprop import explain``). So ``relprop --help`` and anything
else that needs only the errors does not pay for importing torch. This module and the command
line's dispatcher (``relprop/cli/__init__.py``) are the only places allowed to import a relprop
module this way; ``tests/layering.py`` reads :data:`LAZY_IMPORTS` and counts its modules as imports.
"""
import importlib
from typing import TYPE_CHECKING

from .errors import (CaptureError, DispatchError, InputError, MethodError, OptionError, PresetError, RelpropError,
                     RelpropWarning, TargetError, UnsupportedOperation)
from .version import __version__

if TYPE_CHECKING:  # what type checkers and editors see; at run time, __getattr__ below
    from . import methods
    from .actmax import visualize
    from .api import coverage, explain, explain_settings
    from .engine import Conservation, Coverage, Trace
    from .explanation import Explanation
    from .generation import GenerationExplanation, explain_generation
    from .graph.capture import CACHE_SIZE, clear_cache
    from .graph.disk_cache import set_cache_dir
    from .rules import Preset, RuleContext, get_preset, presets, rule
    from .targets import contrast

#: public name -> the module that defines it, imported on the first read of the name
LAZY_IMPORTS = {
    "explain": "relprop.api", "explain_settings": "relprop.api", "coverage": "relprop.api",
    "visualize": "relprop.actmax",
    "methods": "relprop.methods",
    "contrast": "relprop.targets",
    "Explanation": "relprop.explanation",
    "Conservation": "relprop.engine", "Coverage": "relprop.engine", "Trace": "relprop.engine",
    "explain_generation": "relprop.generation", "GenerationExplanation": "relprop.generation",
    "Preset": "relprop.rules", "RuleContext": "relprop.rules", "get_preset": "relprop.rules",
    "presets": "relprop.rules", "rule": "relprop.rules",
    "CACHE_SIZE": "relprop.graph.capture", "clear_cache": "relprop.graph.capture",
    "set_cache_dir": "relprop.graph.disk_cache",
}

__all__ = [
    # explaining
    "explain", "explain_settings", "visualize", "coverage", "methods", "contrast", "Explanation", "Conservation",
    "Coverage", "Trace", "explain_generation", "GenerationExplanation",
    # rules and presets
    "Preset", "RuleContext", "get_preset", "presets", "rule",
    # the capture cache (in memory and on disk)
    "CACHE_SIZE", "clear_cache", "set_cache_dir",
    # errors and warnings
    "RelpropError", "CaptureError", "DispatchError", "InputError", "MethodError", "OptionError", "PresetError",
    "TargetError", "UnsupportedOperation", "RelpropWarning",
    "__version__",
]


def __getattr__(name: str):
    """Import the module that defines the public name ``name`` (PEP 562) and keep the value here,
    so later reads are plain attribute reads."""
    if name not in LAZY_IMPORTS:
        raise AttributeError(f"module 'relprop' has no attribute {name!r}")
    module = importlib.import_module(LAZY_IMPORTS[name])
    value = module if module.__name__ == f"{__name__}.{name}" else getattr(module, name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
