"""Exceptions raised by relprop.

Every error says what was wrong and what to do about it, so that a user never has to read a torch
traceback to find out that, say, a target index was out of range.
"""
from __future__ import annotations

import os
import sys
import warnings


class RelpropError(Exception):
    """Base class of every error relprop raises on purpose."""


class UnsupportedOperation(RelpropError):
    """An op on the relevance path has no rule in the active preset.

    The message names the op, the module path it came from (from the captured graph's
    ``nn_module_stack``) and the decorator call that would register a rule for it.
    """

    def __init__(self, op, module_path: str, module_type: str, preset: str, detail: str = ""):
        self.op = op
        self.module_path = module_path
        self.preset = preset
        name = op_name(op)
        where = f"module '{module_path}' ({module_type})" if module_path else "the model's top level"
        msg = (
            f"no relevance rule for {name} (called in {where}) in preset '{preset}'."
            + (f" {detail}" if detail else "")
            + "\nRegister one before calling explain():\n\n"
            f"    @relprop.rule(torch.ops.{name}, preset='{preset}')\n"
            f"    def my_rule(ctx, relevance):\n"
            f"        # return one relevance tensor (or None) per positional argument of the op\n"
            f"        ...\n\n"
            "or pass unsupported='z_rule' to explain() to apply the generic gradient-times-input rule "
            "to such ops (not conservative in general)."
        )
        super().__init__(msg)


class CaptureError(RelpropError):
    """torch.export could not capture the model's graph."""


class DispatchError(CaptureError):
    """A model dispatched by accelerate (``device_map``, offloading) in a way relprop cannot run,
    e.g. over several devices; the message says which setups are supported."""


class TargetError(RelpropError, ValueError):
    """The ``target`` argument does not fit the model's output."""


class InputError(RelpropError, ValueError):
    """The ``inputs`` argument is not something the model's forward can take."""


class MethodError(RelpropError, ValueError):
    """An unknown method, or a method that does not apply to this model."""


def op_name(op) -> str:
    """``aten.linear.default`` style name of an OpOverload (or ``repr`` of anything else)."""
    name = getattr(op, "_name", None)  # "aten::linear"
    overload = getattr(op, "_overloadname", None)
    if name and overload is not None:
        ns, base = name.split("::")
        if base.endswith(f".{overload}"):  # "aten::add.Tensor": the overload is already in the name
            return f"{ns}.{base}"
        return f"{ns}.{base}.{overload}"
    return getattr(op, "__name__", repr(op))


class PositionPathError(MethodError):
    """Preset ``"pa_lrp"`` (Bakish, Zimerman, Chefer & Wolf, NeurIPS 2025) was asked for a model whose
    position encoding relprop cannot map onto its input tokens: none found, positions that are not
    the input's tokens, or two position sources (two towers, a table and rotary factors). The message
    says which; ``preset="attnlrp"`` explains the model without the reassignment."""


class OptionError(RelpropError, ValueError):
    """An option of ``relprop.explain`` has a value it does not take (the message lists them)."""


class PresetError(RelpropError, ValueError):
    """A preset or rule registration that cannot be honoured: an unknown preset, a name taken
    already, a rule registered over another without ``replace=True``."""


class RelpropWarning(UserWarning):
    """Something relprop did differently from what was asked, and why (e.g. the fast path was asked
    for and not taken; a built-in rule was replaced for the whole process)."""


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _inside_relprop(filename: str) -> bool:
    return os.path.abspath(filename).startswith(_PACKAGE_DIR)


def warn(message: str, category: type = RelpropWarning) -> None:
    """Issue a warning attributed to the user's line: the frame just outside the outermost relprop
    frame of the call stack (a script's ``relprop.explain(...)`` line, not relprop's own code), however
    deep inside relprop it was raised and whatever it passed through (torch, a rule called by the
    engine). Without a relprop frame on the stack, the caller's line."""
    frame, level, outermost = sys._getframe(1), 2, None
    while frame is not None:
        if _inside_relprop(frame.f_code.co_filename):
            outermost = level
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=outermost + 1 if outermost is not None else 2)
