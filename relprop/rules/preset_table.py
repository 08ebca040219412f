"""The :class:`Preset`: a named table of relevance rules, one rule per aten op, that extends other presets.

A preset finds the rule of an op in its own table (with the scoped overrides of the current context),
else in the presets it extends (depth first). Registering over a rule a preset already has is an error
unless ``replace=True``; replacing one of relprop's own rules that way warns, and ``Preset.reset`` puts
it back. This module also holds what every preset shares: the presets by name (:data:`PRESETS`), the
rules the built-in ones had when relprop finished loading (:data:`BUILTIN`), the scoped overrides
(:data:`OVERRIDES`) and the keys of a table that are not aten ops (:class:`PseudoOp`). Finding a preset
by name, the ``@rule`` decorator and ``override`` are ``relprop.rules.rule_registry``.
"""
from __future__ import annotations

import contextvars
import threading
from typing import Callable, Dict, Iterable, Optional, Sequence, Tuple, Union

import torch

from ..errors import PresetError, warn
from .spec import RULE_KINDS, RuleSpec, as_spec

#: where relevance starts at the outputs (:attr:`Preset.seed`): "gradient" R = ∂s/∂y (relevance 1 at
#: the target logit, CVPR 2021 §3.3) or "score" R = y ⊙ ∂s/∂y (the target logit's value, sign included)
SEEDS = ("gradient", "score")

#: every preset by name, in the order they were made
PRESETS: Dict[str, "Preset"] = {}
#: the rules each built-in preset had when relprop finished loading (see ``relprop.rules.rule_registry.seal_builtins``)
BUILTIN: Dict[str, Dict[object, RuleSpec]] = {}
LOCK = threading.RLock()
#: scoped overrides of the current context, innermost last: ((preset name, {op: rule}), ...)
OVERRIDES: "contextvars.ContextVar[tuple]" = contextvars.ContextVar("relprop_rule_overrides", default=())


class PseudoOp:
    """A key of a preset's table that is not an aten op but a pattern of the graph that one rule
    explains as a whole (:data:`ELEMENTWISE_FUNCTION`)."""

    def __init__(self, name: str, description: str):
        self.__name__ = name
        self.description = description

    def __repr__(self) -> str:
        return self.__name__


#: an element-wise function of one tensor written out op by op (GPT-2's ``gelu_new``, CLIP's
#: ``quick_gelu``, softcapping, a softplus; :mod:`relprop.graph.elementwise`): a preset with a rule
#: for it applies that rule to the whole function, ``rule(ctx, R)`` with ``ctx.args == (x,)`` and
#: ``ctx.out`` the function's output; a preset without one explains its ops one by one
ELEMENTWISE_FUNCTION = PseudoOp("elementwise_function", "y = f(x) computed element-wise by several ops")


def op_overloads(op) -> list:
    """The op overloads ``op`` stands for: every overload of a packet (``torch.ops.aten.gelu``), else ``op``."""
    if isinstance(op, torch._ops.OpOverloadPacket):
        return [getattr(op, o) for o in op.overloads()]
    return [op]


def qualified_name(op) -> Optional[str]:
    """``"namespace::name.overload"`` of an op overload (``"transformers::grouped_mm_fallback.default"``),
    the key under which a rule for an op that may not exist when relprop loads is registered."""
    schema = getattr(op, "_schema", None)
    if schema is None:
        return None
    return f"{schema.name}.{schema.overload_name or 'default'}"


class Preset:
    """A named table of relevance rules extending other presets.

    Parameters
    ----------
    name
        the name ``explain(preset=...)`` takes; must be new (``relprop.presets()`` lists the
        existing ones).
    extends
        the preset (name or object), or presets, searched for any op this one has no rule
        for, e.g. ``"chefer2021"``. Every preset extends at least ``"base"`` (the shape-only
        routing rules).
    description
        one line saying what the preset is (shown by ``relprop.presets()``).
    conservative
        whether its rules conserve relevance (documentation for reports).
    modified_gradient
        whether its rules are meant to have modified-gradient forms, so that
        ``explain(method="lrp", preset=...)`` runs as one backward pass (``"attnlrp"``,
        ``"cp_lrp"``); a rule registered in it without a form then warns. Inherited.
    seed
        where relevance starts at the model's outputs (``SEEDS``): ``"gradient"``, the
        derivative of the explained score by each output (the one-hot of the target logit, CVPR
        2021 §3.3: relevance 1), or ``"score"``, that derivative times the output (the target
        logit's value, sign included: Bach et al. 2015, AttnLRP and LXT). None: inherited
        (``"gradient"`` at ``"base"``).
    rule_kind
        what its rules that declare no ``kind`` are to the coverage count (``spec.RULE_KINDS``): "exact".
    """

    def __init__(self, name: str, *, extends: Union[str, "Preset", Sequence[Union[str, "Preset"]]],
                 description: str = "", conservative: bool = True, modified_gradient: bool = False,
                 seed: Optional[str] = None, rule_kind: str = "exact"):
        if rule_kind not in RULE_KINDS:
            raise PresetError(f"rule_kind={rule_kind!r} is not a choice. Choices: {list(RULE_KINDS)}")
        if seed is not None and seed not in SEEDS:
            raise PresetError(f"seed={seed!r} is not a choice. Choices: {list(SEEDS)} (None: the seed of the preset "
                              "it extends)")
        if not isinstance(name, str) or not name:
            raise PresetError(f"a preset's name must be a non-empty str, not {name!r}")
        parents = (extends,) if isinstance(extends, (str, Preset)) else tuple(extends)
        names = tuple(p.name if isinstance(p, Preset) else p for p in parents)
        with LOCK:
            if name in PRESETS:
                raise PresetError(f"a preset named '{name}' exists already ({PRESETS[name].description}); pick "
                                  f"another name, or use it as it is: relprop.rules.get_preset('{name}')")
            for p in names:
                if not isinstance(p, str) or p not in PRESETS:
                    raise PresetError(f"preset '{name}' extends unknown preset {p!r}. Choices: {sorted(PRESETS)}")
            if name != "base" and not names:
                raise PresetError(f"preset '{name}' must extend a preset, e.g. Preset('{name}', extends='chefer2021')")
            self.name = name
            self.parents: Tuple[str, ...] = names
            self.description = description or f"user preset '{name}', extending {', '.join(names)}"
            self.conservative = conservative
            self._modified_gradient = modified_gradient
            self._seed = seed
            self.rule_kind = rule_kind
            self.rules: Dict[object, RuleSpec] = {}
            PRESETS[name] = self

    # -- reading ---------------------------------------------------------------------------------
    @property
    def modified_gradient(self) -> bool:
        """True when this preset or one it extends runs as a modified gradient."""
        return self._modified_gradient or any(PRESETS[p].modified_gradient for p in self.parents)

    @property
    def seed(self) -> str:
        """Where relevance starts (``SEEDS``): this preset's own choice, else the first found in
        the presets it extends, else ``"gradient"``."""
        for p in self.lineage():
            if p._seed is not None:
                return p._seed
        return "gradient"

    def lineage(self) -> Tuple["Preset", ...]:
        """This preset and every preset it extends, in lookup order (depth first, no repeats)."""
        out = [self]
        for p in self.parents:
            out += [q for q in PRESETS[p].lineage() if q not in out]
        return tuple(out)

    def own_rule(self, op) -> Optional[RuleSpec]:
        """The rule this preset's own table (with the scoped overrides of this context) gives ``op``."""
        for name, table in reversed(OVERRIDES.get()):
            if name == self.name and op in table:
                return table[op]
        return self.rules.get(op)

    def lookup(self, op) -> Optional[RuleSpec]:
        """The rule for ``op`` (its ``RuleSpec``, called like the function): this preset's
        own, else the first found in the presets it extends. An op overload without one is looked
        up by its ``qualified_name`` too (rules for ops of other libraries, registered by name:
        ``rule("transformers::grouped_mm_fallback.default")``)."""
        found = self._lookup(op)
        if found is None:
            name = qualified_name(op)
            if name is not None:
                found = self._lookup(name)
        return found

    def _lookup(self, op) -> Optional[RuleSpec]:
        found = self.own_rule(op)
        if found is not None:
            return found
        for parent in self.parents:
            found = PRESETS[parent]._lookup(op)
            if found is not None:
                return found
        return None

    def owner(self, op) -> Optional[Tuple[RuleSpec, "Preset"]]:
        """``(rule, the preset of the lineage whose own table holds it)`` for ``op``, or None."""
        for key in (op, qualified_name(op)):
            for p in self.lineage():
                spec = p.own_rule(key) if key is not None else None
                if spec is not None:
                    return spec, p
        return None

    def describe(self, op) -> Optional[str]:
        """``'<rule module>.<function> (<preset it is registered in>)'`` for ``op``, or None."""
        found = self.owner(op)
        return None if found is None else f"{found[0].module}.{found[0].name} ({found[1].name})"

    # -- writing ---------------------------------------------------------------------------------
    def rule(self, *ops, replace: bool = False, gradient_form: Optional[Callable] = None,
             formula: Optional[Callable] = None, writes_out: Optional[bool] = None,
             no_relevance_to: Optional[Iterable[int]] = None, constant_positions: Optional[Iterable[int]] = None,
             kind: Optional[str] = None):
        """Decorator: register the function as this preset's rule for ``ops`` (op overloads such
        as ``torch.ops.aten.gelu.default``, or packets such as ``torch.ops.aten.gelu`` for every
        overload), with what it declares (the keywords, fields of ``RuleSpec``; a keyword
        left None declares nothing). Returns the function unchanged. An op that already has a rule
        in this preset's own table is an error unless ``replace=True``; replacing one of relprop's
        built-in rules warns (``reset`` restores it; ``override`` changes a rule for a
        ``with`` block only)."""
        if not ops:
            raise PresetError("rule() needs at least one op, e.g. rule(torch.ops.aten.gelu.default)")
        declared = dict(gradient_form=gradient_form, formula=formula, writes_out=writes_out,
                        no_relevance_to=no_relevance_to, constant_positions=constant_positions, kind=kind)

        def decorate(fn):
            if not callable(fn):
                raise PresetError(f"a rule must be a function fn(ctx, relevance), not {type(fn).__name__}")
            self.register(ops, as_spec(fn, **declared), replace=replace)
            return fn

        return decorate

    def register(self, ops: Sequence, spec: RuleSpec, replace: bool = False) -> None:
        """Put ``spec`` in this preset's table for ``ops`` (see ``rule``)."""
        overloads = [ov for op in ops for ov in op_overloads(op)]
        with LOCK:
            for ov in overloads:
                old = self.rules.get(ov)
                new = old is not None and old != spec
                if new and not replace:
                    raise PresetError(f"{ov} already has a rule in preset '{self.name}' ({old.name}); pass "
                                      "replace=True to replace it for the whole process, or change it for a "
                                      "block of code with relprop.rules.override(...)")
                if new and BUILTIN.get(self.name, {}).get(ov) is old:
                    warn(f"rule {spec.name} replaces relprop's built-in rule {old.name} for {ov} "
                         f"in preset '{self.name}' for the whole process; "
                         f"relprop.rules.get_preset('{self.name}').reset({ov}) restores it")
            self._warn_without_gradient_form(spec, overloads)
            for ov in overloads:
                self.rules[ov] = spec

    def reset(self, *ops) -> None:
        """Undo registrations in this preset: each op (every op when none is given) gets back the
        rule relprop's own preset had for it, or none for a preset defined by the user."""
        builtin = BUILTIN.get(self.name, {})
        with LOCK:
            targets = [ov for op in ops for ov in op_overloads(op)] if ops else list(self.rules) + list(builtin)
            for ov in targets:
                if ov in builtin:
                    self.rules[ov] = builtin[ov]
                else:
                    self.rules.pop(ov, None)

    def _warn_without_gradient_form(self, spec: RuleSpec, ops) -> None:
        if self.modified_gradient and spec.gradient_form is None:
            warn(f"rule {spec.name} for {', '.join(map(str, ops))} in preset '{self.name}' "
                 "has no modified-gradient form: explain(method='lrp') under this preset will walk the "
                 "graph rule by rule instead of one backward pass. Declare one with "
                 "@relprop.rule(op, preset=..., gradient_form=...) (relprop.rules.gradient_forms)")

    def __repr__(self) -> str:
        return (f"Preset('{self.name}', extends={list(self.parents)}, rules={len(self.rules)}, "
                f"conservative={self.conservative})")
