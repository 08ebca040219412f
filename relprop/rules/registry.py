"""The rule registry: which backward relevance rule applies to which aten op, grouped in presets.

A *rule* is a function ``rule(ctx, relevance) -> sequence`` called once per graph node on the
relevance path, walking from the output to the input. ``relevance`` is the relevance that reached
the node's output (float32, shaped like the output). The rule returns one entry per positional
argument of the op (``node.args``): a relevance tensor (shaped like that argument, or like the
node's output when the argument was broadcast), ``None`` for arguments that receive nothing
(weights, shapes, dims), or a list of those for list arguments (``aten.cat``). Relevance given to
an argument that does not depend on the input (a parameter, the class token, a mask) is counted as
*absorbed* by that constant; relevance given to an input-dependent argument keeps flowing.

A *preset* is a named set of rules. Presets may extend others: ``"chefer2021"`` and ``"lrp"`` both
extend ``"base"``, which holds the shape-only routing rules that every preset shares. Rules are
registered with the :func:`rule` decorator::

    @relprop.rule(torch.ops.aten.gelu.default, preset="chefer2021")
    def gelu_identity(ctx, relevance):
        return (relevance,)
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Dict, Iterable, Optional, Sequence, Union

import torch

from ..errors import RelpropError

RuleFn = Callable[..., Sequence]


@dataclasses.dataclass
class Preset:
    """A named group of rules; ``parents`` are searched when a rule is not found here."""

    name: str
    description: str
    parents: tuple = ()
    conservative: bool = True
    rules: Dict[object, RuleFn] = dataclasses.field(default_factory=dict)


_PRESETS: Dict[str, Preset] = {}


def define_preset(name: str, description: str, parents: Iterable[str] = (), conservative: bool = True) -> Preset:
    """Create (or return the existing) preset ``name`` extending ``parents``."""
    if name in _PRESETS:
        return _PRESETS[name]
    for p in parents:
        if p not in _PRESETS:
            raise RelpropError(f"preset '{name}' extends unknown preset '{p}'; known: {sorted(_PRESETS)}")
    preset = Preset(name, description, tuple(parents), conservative)
    _PRESETS[name] = preset
    return preset


def get_preset(name: str) -> Preset:
    """The preset called ``name``; an unknown name is an error that lists the known ones."""
    try:
        return _PRESETS[name]
    except KeyError:
        import difflib

        close = difflib.get_close_matches(str(name), list(_PRESETS), n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        raise RelpropError(f"'{name}' is not a preset. Choices: {sorted(_PRESETS)}.{hint}") from None


def presets() -> Dict[str, str]:
    """Every preset name with its description."""
    return {name: p.description for name, p in _PRESETS.items()}


def _overloads(op) -> list:
    if isinstance(op, torch._ops.OpOverloadPacket):
        return [getattr(op, o) for o in op.overloads()]
    return [op]


def rule(*ops, preset: Union[str, Sequence[str]] = "chefer2021", replace: bool = True):
    """Register the decorated function as the relevance rule of ``ops`` in ``preset``.

    Parameters
    ----------
    *ops : torch.ops.aten op overloads (``torch.ops.aten.gelu.default``) or packets
        (``torch.ops.aten.gelu``, meaning every overload).
    preset : name or names of the presets the rule belongs to (created on first use, extending
        ``"base"``). ``"base"`` registers a rule shared by every preset.
    replace : if False, registering an op that already has a rule in the preset is an error.

    The function is called as ``fn(ctx, relevance)`` with a :class:`relprop.rules.RuleContext` and
    must return one entry per positional argument of the op (see the module docstring). A rule may
    set ``fn.no_relevance_to = {positions}`` to declare arguments it never gives relevance to (e.g.
    the divisor of a normalization), so that ops feeding only those need no rule.
    """
    names = [preset] if isinstance(preset, str) else list(preset)
    if not ops:
        raise RelpropError("relprop.rule() needs at least one op, e.g. relprop.rule(torch.ops.aten.gelu.default)")

    def decorate(fn: RuleFn) -> RuleFn:
        for name in names:
            p = _PRESETS.get(name) or define_preset(name, f"user preset '{name}'", parents=("base",))
            for op in ops:
                for overload in _overloads(op):
                    if not replace and overload in p.rules:
                        raise RelpropError(f"{overload} already has a rule in preset '{name}'")
                    p.rules[overload] = fn
        return fn

    return decorate


def lookup(preset: str, op) -> Optional[RuleFn]:
    """The rule for ``op`` in ``preset`` or its parents (depth first), or None."""
    p = get_preset(preset)
    if op in p.rules:
        return p.rules[op]
    for parent in p.parents:
        found = lookup(parent, op)
        if found is not None:
            return found
    return None


def describe(preset: str, op) -> Optional[str]:
    """``'<rule name> (<preset it is registered in>)'`` for op, or None when it has no rule."""
    p = get_preset(preset)
    if op in p.rules:
        fn = p.rules[op]
        return f"{fn.__module__.rsplit('.', 1)[-1]}.{fn.__name__} ({p.name})"
    for parent in p.parents:
        d = describe(parent, op)
        if d is not None:
            return d
    return None


define_preset("base", "shape-only routing shared by every preset")
define_preset(
    "chefer2021",
    "Chefer, Gur & Wolf, CVPR 2021, as its authors' code applies it: LRP-alpha1beta0 linear layers, "
    "normalized residual adds (Lemma 2), halved attention products (Lemma 1), z^B patch embedding",
    parents=("base",),
)
define_preset(
    "lrp",
    "the paper's plain-LRP baseline (authors' layers_lrp.py): un-normalized adds and the baseline's "
    "linear rule; NOT conservative (each linear layer returns between 1/2 and 3/2 of its relevance)",
    parents=("base",),
    conservative=False,
)
