"""Presets: named tables of relevance rules, one rule per aten op, that extend other presets.

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
import contextvars
import difflib
import threading
from typing import Callable, Dict, Iterable, Mapping, Optional, Sequence, Tuple, Union

import torch

from ..errors import PresetError, warn
from .spec import RULE_KINDS, RuleFn, RuleSpec, as_spec

#: where relevance starts at the outputs (:attr:`Preset.seed`): "gradient" R = ∂s/∂y (relevance 1 at
#: the target logit, CVPR 2021 §3.3) or "score" R = y ⊙ ∂s/∂y (the target logit's value, sign included)
SEEDS = ("gradient", "score")

_PRESETS: Dict[str, "Preset"] = {}
#: the rules each built-in preset had when relprop finished loading (see :func:`seal_builtins`)
_BUILTIN: Dict[str, Dict[object, RuleSpec]] = {}
_LOCK = threading.RLock()
#: scoped overrides of the current context, innermost last: ((preset name, {op: rule}), ...)
_OVERRIDES: "contextvars.ContextVar[tuple]" = contextvars.ContextVar("relprop_rule_overrides", default=())


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


def _overloads(op) -> list:
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
        with _LOCK:
            if name in _PRESETS:
                raise PresetError(f"a preset named '{name}' exists already ({_PRESETS[name].description}); pick "
                                  f"another name, or use it as it is: relprop.rules.get_preset('{name}')")
            for p in names:
                if not isinstance(p, str) or p not in _PRESETS:
                    raise PresetError(f"preset '{name}' extends unknown preset {p!r}. Choices: {sorted(_PRESETS)}")
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
            _PRESETS[name] = self

    # -- reading ---------------------------------------------------------------------------------
    @property
    def modified_gradient(self) -> bool:
        """True when this preset or one it extends runs as a modified gradient."""
        return self._modified_gradient or any(_PRESETS[p].modified_gradient for p in self.parents)

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
            out += [q for q in _PRESETS[p].lineage() if q not in out]
        return tuple(out)

    def own_rule(self, op) -> Optional[RuleSpec]:
        """The rule this preset's own table (with the scoped overrides of this context) gives ``op``."""
        for name, table in reversed(_OVERRIDES.get()):
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
            found = _PRESETS[parent]._lookup(op)
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
        overloads = [ov for op in ops for ov in _overloads(op)]
        with _LOCK:
            for ov in overloads:
                old = self.rules.get(ov)
                new = old is not None and old != spec
                if new and not replace:
                    raise PresetError(f"{ov} already has a rule in preset '{self.name}' ({old.name}); pass "
                                      "replace=True to replace it for the whole process, or change it for a "
                                      "block of code with relprop.rules.override(...)")
                if new and _BUILTIN.get(self.name, {}).get(ov) is old:
                    warn(f"rule {spec.name} replaces relprop's built-in rule {old.name} for {ov} "
                         f"in preset '{self.name}' for the whole process; "
                         f"relprop.rules.get_preset('{self.name}').reset({ov}) restores it")
            self._warn_without_gradient_form(spec, overloads)
            for ov in overloads:
                self.rules[ov] = spec

    def reset(self, *ops) -> None:
        """Undo registrations in this preset: each op (every op when none is given) gets back the
        rule relprop's own preset had for it, or none for a preset defined by the user."""
        builtin = _BUILTIN.get(self.name, {})
        with _LOCK:
            targets = [ov for op in ops for ov in _overloads(op)] if ops else list(self.rules) + list(builtin)
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


def get_preset(preset: Union[str, Preset]) -> Preset:
    """The preset called ``preset`` (or the object itself); an unknown name is an error that lists
    the known ones."""
    if isinstance(preset, Preset):
        return preset
    try:
        return _PRESETS[preset]
    except (KeyError, TypeError):
        close = difflib.get_close_matches(str(preset), list(_PRESETS), n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        raise PresetError(f"{preset!r} is not a preset. Choices: {sorted(_PRESETS)}.{hint} A new one is made with "
                          "relprop.Preset(name, extends='chefer2021').") from None


def presets() -> Dict[str, str]:
    """Every preset name with its description."""
    return {name: p.description for name, p in _PRESETS.items()}


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
        overloads = _overloads(op)
        spec = as_spec(fn)
        p._warn_without_gradient_form(spec, overloads)
        table.update({ov: spec for ov in overloads})
    token = _OVERRIDES.set(_OVERRIDES.get() + ((p.name, table),))
    try:
        yield p
    finally:
        _OVERRIDES.reset(token)


def state(preset: Union[str, Preset]) -> tuple:
    """A fingerprint of the rules ``preset`` sees now (its lineage's tables and the scoped
    overrides): plans cached on a graph are valid while it does not change."""
    tables = tuple((p.name, tuple(p.rules.items())) for p in get_preset(preset).lineage())
    overrides = tuple((name, tuple(t.items())) for name, t in _OVERRIDES.get())
    return tables, overrides


def seal_builtins(names: Iterable[str]) -> None:
    """Record the rules of relprop's own presets, once they are all registered: what
    :meth:`Preset.reset` restores and what replacing warns about."""
    for name in names:
        _BUILTIN[name] = dict(_PRESETS[name].rules)


BASE = Preset("base", extends=(), description="shape-only routing shared by every preset", seed="gradient",
              rule_kind="structural")
CHEFER2021 = Preset(
    "chefer2021", extends=BASE,
    description="Chefer, Gur & Wolf, CVPR 2021, as its authors' code applies it: LRP-alpha1beta0 linear layers, "
                "normalized residual adds (Lemma 2), halved attention products (Lemma 1), z^B patch embedding")
LRP = Preset(
    "lrp", extends=BASE, conservative=False,
    description="the paper's plain-LRP baseline as the authors' layers_lrp.py computes it: "
                "plain z-rule sums, linear layers and convolutions with separate denominators for x+W+ and x-W-; "
                "NOT conservative (a linear layer fed by both signs returns about twice its relevance)")
