"""The registry of rules: presets found by name, the ``@rule`` decorator, and scoped overrides.

A preset is a named table of relevance rules, one rule per aten op, that extends other presets
(:class:`relprop.rules.preset_table.Preset`).

A *rule* ``rule(ctx, relevance) -> sequence`` is called once per graph node on the relevance path, from the
output to the input, and returns one share per positional argument of the op (a tensor, None, or a list for
list arguments; the contract in full: docs/extending.md). Shares given to input-independent arguments are
*absorbed*. A rule reads only its :class:`relprop.rules.RuleContext`, never the preset's name.

A :class:`Preset` finds the rule of an op in its own table, else in the presets it extends
(depth first). The built-in presets are ``"base"`` (the shape-only routing every preset shares),
``"chefer2021"``, ``"lrp"``, ``"attnlrp"`` and ``"cp_lrp"``. A user extends one::

    mine = relprop.Preset("mine", extends="chefer2021", description="chefer2021 with my GELU rule")
    @mine.rule(torch.ops.aten.gelu.default)
    def gelu_z(ctx, relevance):
        ...

    relprop.explain(model, x, preset="mine")          # or preset=mine

and changes a rule for a ``with`` block only with ``override({op: fn}, preset=...)``. Registering over a
rule a preset already has is an error unless ``replace=True``; replacing one of relprop's own rules that way
warns, and ``Preset.reset`` puts it back.
"""
from __future__ import annotations

import contextlib
import difflib
from typing import Callable, Dict, Iterable, Mapping, Optional, Sequence, Union

from ..errors import PresetError
from .builtin_presets import BASE, CHEFER2021, LRP
from .preset_table import (BUILTIN, ELEMENTWISE_FUNCTION, OVERRIDES, PRESETS, SEEDS, Preset, PseudoOp, op_overloads,
                           qualified_name)
from .spec import RuleFn, RuleSpec, as_spec

#: the names other modules import from here (the Preset class and the built-in presets live in
#: ``preset_table`` and ``builtin_presets``)
__all__ = ["BASE", "CHEFER2021", "ELEMENTWISE_FUNCTION", "LRP", "SEEDS", "Preset", "PseudoOp", "describe",
           "get_preset", "lookup", "override", "presets", "qualified_name", "rule", "seal_builtins", "state"]


def get_preset(preset: Union[str, Preset]) -> Preset:
    """The preset called ``preset`` (or the object itself); an unknown name is an error that lists
    the known ones."""
    if isinstance(preset, Preset):
        return preset
    try:
        return PRESETS[preset]
    except (KeyError, TypeError):
        close = difflib.get_close_matches(str(preset).lower(), list(PRESETS), n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        raise PresetError(f"{preset!r} is not a preset. Choices: {sorted(PRESETS)}.{hint} A new one is made with "
                          "relprop.Preset(name, extends='chefer2021').") from None


def presets() -> Dict[str, str]:
    """Every preset name with its description."""
    return {name: p.description for name, p in PRESETS.items()}


def rule(*ops, preset: Union[str, Preset, Sequence[Union[str, Preset]]] = "chefer2021", replace: bool = False,
         gradient_form: Optional[Callable] = None, formula: Optional[Callable] = None,
         writes_out: Optional[bool] = None, no_relevance_to: Optional[Iterable[int]] = None,
         constant_positions: Optional[Iterable[int]] = None, kind: Optional[str] = None):
    """Register the decorated function as the relevance rule of ``ops`` in ``preset`` (a name or
    ``Preset``, or several): ``@relprop.rule(torch.ops.aten.gelu.default, preset="chefer2021")``.

    The presets must exist (``Preset`` makes a new one). See ``Preset.rule`` for
    ``replace``. The function is called as ``fn(ctx, relevance)`` with a
    ``relprop.rules.RuleContext`` and returns one entry per positional argument of the op (a tensor of
    relevance, or None; docs/extending.md); it is returned unchanged. The other keywords declare what the rule can
    do (the fields of ``relprop.rules.spec.RuleSpec``, stored with it in every preset named):

    gradient_form : its modified-gradient form (``relprop.rules.gradient_forms``), for the
        one-backward fast path of ``explain(method="lrp")``.
    formula : for a rule of ``aten.linear``, ``formula(x, w, relevance, eps) -> R_x``, applied by
        other rules to linear maps that are not ``aten.linear``.
    writes_out : True when the rule may compute into its node's output once the engine says it is dead
        (``ctx.out_writable``).
    no_relevance_to : positions of arguments it never gives relevance to (e.g. the divisor of a normalization),
        so that ops feeding only those need no rule.
    constant_positions : positions of arguments it holds constant (their shares are absorbed).
    kind : what it is to the coverage count: "exact", "structural", "fallback" (None: the preset's ``rule_kind``).
    """
    targets = [preset] if isinstance(preset, (str, Preset)) else list(preset)
    if not ops:
        raise PresetError("relprop.rule() needs at least one op, e.g. relprop.rule(torch.ops.aten.gelu.default)")
    objects = [get_preset(p) for p in targets]
    declared = dict(gradient_form=gradient_form, formula=formula, writes_out=writes_out,
                    no_relevance_to=no_relevance_to, constant_positions=constant_positions, kind=kind)

    def decorate(fn):
        if not callable(fn):
            raise PresetError(f"a rule must be a function fn(ctx, relevance), not {type(fn).__name__}")
        spec = as_spec(fn, **declared)  # one spec, the same object in every preset named
        for p in objects:
            p.register(ops, spec, replace=replace)
        return fn

    return decorate


def lookup(preset: Union[str, Preset], op) -> Optional[RuleSpec]:
    """The rule ``preset`` applies to ``op`` (its own or inherited) as a ``RuleSpec`` (called
    like the function; ``.fn`` is the function), or None."""
    return get_preset(preset).lookup(op)


def describe(preset: Union[str, Preset], op) -> Optional[str]:
    """``'<rule name> (<preset it is registered in>)'`` for op, or None when it has no rule."""
    return get_preset(preset).describe(op)


@contextlib.contextmanager
def override(rules: Mapping[object, RuleFn], preset: Union[str, Preset] = "chefer2021"):
    """Within this ``with`` block (in this thread or task only), ``preset`` and every preset
    extending it use ``rules`` ({op: rule}, a rule a function or a ``RuleSpec`` with its
    declarations) in place of their own; everything is as before on exit.

    >>> with relprop.rules.override({torch.ops.aten.gelu.default: my_gelu}, preset="chefer2021"):
    ...     exp = relprop.explain(model, x)
    """
    p = get_preset(preset)
    if not isinstance(rules, Mapping) or not rules:
        raise PresetError("override() takes a non-empty dict {op: rule}")
    table = {}
    for op, fn in rules.items():
        if not callable(fn):
            raise PresetError(f"the rule given for {op} is not a function fn(ctx, relevance): {fn!r}")
        overloads = op_overloads(op)
        spec = as_spec(fn)
        p._warn_without_gradient_form(spec, overloads)
        table.update({ov: spec for ov in overloads})
    token = OVERRIDES.set(OVERRIDES.get() + ((p.name, table),))
    try:
        yield p
    finally:
        OVERRIDES.reset(token)


def state(preset: Union[str, Preset]) -> tuple:
    """A fingerprint of the rules ``preset`` sees now (its lineage's tables and the scoped
    overrides): plans cached on a graph are valid while it does not change."""
    tables = tuple((p.name, tuple(p.rules.items())) for p in get_preset(preset).lineage())
    overrides = tuple((name, tuple(t.items())) for name, t in OVERRIDES.get())
    return tables, overrides


def seal_builtins(names: Iterable[str]) -> None:
    """Record the rules of relprop's own presets, once they are all registered: what
    :meth:`Preset.reset` restores and what replacing warns about."""
    for name in names:
        BUILTIN[name] = dict(PRESETS[name].rules)
