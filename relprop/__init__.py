"""relprop: explain the predictions of unmodified transformer models.

``relprop.explain(model, inputs, target=t)`` captures the model's graph with ``torch.export``,
propagates relevance through it with the rules of Chefer, Gur & Wolf, *Transformer
Interpretability Beyond Attention Visualization* (CVPR 2021), and aggregates the per-block
attention records into token/patch scores.

The package is built as one-way layers, one package (or more) per layer (``docs/architecture.md``):
``errors`` → ``graph`` → ``rules`` → ``engine`` (and ``targets``) → ``methods`` → ``viz`` →
``explanation`` → ``api`` → ``tools`` (and ``evaluation``) → ``cli``; this module only gathers the
public names.

It gathers them lazily (PEP 562): ``import relprop`` imports only the errors and the version, and
the module that defines a public name (:data:`LAZY_IMPORTS`) is imported the first time the name is
read (``relprop.explain``, ``from relprop import explain``). So ``relprop --help`` and anything
else that needs only the errors does not pay for importing torch. This module and the command
line's dispatcher (``relprop/cli/__init__.py``) are the only places allowed to import a relprop
module this way; ``tests/layering.py`` reads :data:`LAZY_IMPORTS` and counts its modules as imports.

Module paths of the modules that moved into packages (``relprop.demo``, ``relprop.generation``, ...:
:data:`MODULE_PATHS`) import the module they name, and a renamed public name (:data:`RENAMED`) reads
as the new one with a ``DeprecationWarning``.
"""
import importlib
import importlib.machinery
import sys
import warnings
from typing import TYPE_CHECKING

from .errors import (CaptureError, DispatchError, InputError, MethodError, OptionError, PositionPathError,
                     PresetError, RelpropError, RelpropWarning, TargetError, UnsupportedOperation)
from .version import __version__

if TYPE_CHECKING:  # what type checkers and editors see; at run time, __getattr__ below
    from . import methods
    from .api import (GenerationExplanation, ImageGenerationExplanation, coverage, explain, explain_generation,
                      explain_settings)
    from .engine import Conservation, Coverage, RowChunks, Trace, Tuning
    from .explanation import Explanation
    from .graph.capture import CACHE_SIZE, clear_cache
    from .graph.disk_cache import set_cache_dir
    from .rules import Preset, RuleContext, get_preset, presets, rule
    from .targets import contrast
    from .tools.activation_maximization import maximize_activation

#: public name -> the module that defines it, imported on the first read of the name
LAZY_IMPORTS = {
    "explain": "relprop.api", "explain_settings": "relprop.api", "coverage": "relprop.api",
    "maximize_activation": "relprop.tools.activation_maximization",
    "methods": "relprop.methods",
    "contrast": "relprop.targets",
    "Explanation": "relprop.explanation",
    "Conservation": "relprop.engine", "Coverage": "relprop.engine", "Trace": "relprop.engine",
    "Tuning": "relprop.engine", "RowChunks": "relprop.engine",
    "explain_generation": "relprop.api", "GenerationExplanation": "relprop.api",
    "ImageGenerationExplanation": "relprop.api",
    "Preset": "relprop.rules", "RuleContext": "relprop.rules", "get_preset": "relprop.rules",
    "presets": "relprop.rules", "rule": "relprop.rules",
    "CACHE_SIZE": "relprop.graph.capture", "clear_cache": "relprop.graph.capture",
    "set_cache_dir": "relprop.graph.disk_cache",
}

__all__ = [
    # explaining
    "explain", "explain_settings", "coverage", "methods", "contrast", "Explanation", "Conservation", "Coverage",
    "Trace", "explain_generation", "GenerationExplanation", "ImageGenerationExplanation", "maximize_activation",
    # how the engine runs (chunk sizes, fused kernels)
    "Tuning", "RowChunks",
    # rules and presets
    "Preset", "RuleContext", "get_preset", "presets", "rule",
    # the capture cache (in memory and on disk)
    "CACHE_SIZE", "clear_cache", "set_cache_dir",
    # errors and warnings
    "RelpropError", "CaptureError", "DispatchError", "InputError", "MethodError", "OptionError", "PresetError",
    "PositionPathError", "TargetError", "UnsupportedOperation", "RelpropWarning",
    "__version__",
]


#: module paths that name a module of a package: ``import relprop.demo``, ``from relprop.generation import
#: ...`` and ``relprop.demo`` give the module named here (the same module object under both names)
MODULE_PATHS = {
    "relprop.demo": "relprop.tools.demo",
    "relprop.generation": "relprop.api.generated_text",
    "relprop.actmax": "relprop.tools.activation_maximization",
    "relprop.raw_inputs": "relprop.api.raw_inputs",
    "relprop.target_heads": "relprop.targets.target_heads",
    "relprop.target_forms": "relprop.targets.target_forms",
}


class _ModulePaths:
    """The importer of :data:`MODULE_PATHS` (a finder and loader on ``sys.meta_path``): it imports the
    module the path names and puts that module in ``sys.modules`` under the path too."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        return importlib.machinery.ModuleSpec(name, _ModulePaths) if name in MODULE_PATHS else None

    @staticmethod
    def create_module(spec):
        return None  # the default module, replaced by exec_module

    @staticmethod
    def exec_module(module):
        sys.modules[module.__name__] = importlib.import_module(MODULE_PATHS[module.__name__])


if not any(finder is _ModulePaths for finder in sys.meta_path):
    sys.meta_path.insert(0, _ModulePaths)  # before any finder that may see an old file of that name


#: old public name -> the public name it is now; reading the old one warns (DeprecationWarning)
RENAMED = {
    "visualize": "maximize_activation",  # activation maximization, not the pictures of relprop.viz
}


def __getattr__(name: str):
    """Import the module that defines the public name ``name`` (PEP 562) and keep the value here,
    so later reads are plain attribute reads; ``relprop.demo`` and the other :data:`MODULE_PATHS` are
    their modules."""
    if name in RENAMED:
        warnings.warn(f"relprop.{name} is relprop.{RENAMED[name]} (the same function under the name that says "
                      f"what it does); relprop.{name} will be removed", DeprecationWarning, stacklevel=2)
        return __getattr__(RENAMED[name])  # not kept here, so that every read warns
    if f"{__name__}.{name}" in MODULE_PATHS:
        value = importlib.import_module(MODULE_PATHS[f"{__name__}.{name}"])
    elif name in LAZY_IMPORTS:
        module = importlib.import_module(LAZY_IMPORTS[name])
        value = module if module.__name__ == f"{__name__}.{name}" else getattr(module, name)
    else:
        raise AttributeError(f"module 'relprop' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
