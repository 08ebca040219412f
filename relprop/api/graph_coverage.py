"""``relprop.coverage``: every op of a model's captured graph and how a preset handles it (the same
prologue and capture cache as ``explain``; nothing runs but the capture)."""
from __future__ import annotations

from typing import Any, Optional

import torch

from . import options as opt
from ..engine import report
from ..engine.coverage import Coverage
from ..models import adapter_for
from ..rules import get_preset
from ..rules.stabilize import DEFAULT_EPS
from .options import DEFAULT_PRESET
from .prologue import prepare


def coverage(model: torch.nn.Module, inputs: Any, preset: Any = "chefer2021", *, wrt: Optional[str] = None,
             unsupported: str = "error") -> Coverage:
    """Every op of ``model``'s captured graph on ``inputs`` and how ``preset`` handles it.

    Parameters
    ----------
    model, inputs, wrt
        as for ``explain`` (the capture is shared with it and cached; the model is unmodified; only the capture runs).
    preset
        the rules to report, a name or a ``relprop.Preset`` (``relprop.presets()`` lists them).
    unsupported
        as for ``explain``: an op without a rule is ``missing`` (``"error"``) or a ``fallback`` (``"z_rule"``).

    Returns
    -------
    Coverage
        ``print(report)``: every op with its module path and handling, the blocks found, a summary;
        ``report.missing`` / ``report.complete``: the ops without a rule; ``report.shares()``: the percent
        of nodes exact, structural (moved without arithmetic), fallback or missing (``on_path=True``: on
        the relevance path only).
    """
    opt.check_engine_options(eps=DEFAULT_EPS, unsupported=unsupported, memory="default")
    checked = opt.check_preset(preset)
    if checked is None:
        checked = get_preset(DEFAULT_PRESET)
    name = type(model).__name__
    model, inputs = adapter_for(model).capture_call(model, inputs)  # the family's call as explain() captures it
    prepared = prepare(model, inputs, wrt)
    return report(prepared.captured, checked, name, unsupported)
