"""What a rule declares about itself: :class:`RuleSpec`, the entry of a preset's table.

A rule's abilities are declared where it is registered, as keywords of ``@rule`` (or
``Preset.rule``)::

    @rule(aten.div.Tensor, preset="attnlrp", gradient_form=renormalizing(constant_operand(1)),
          no_relevance_to={1})
    def divide(ctx, relevance):
        ...

and the registry stores them, with the function, in one :class:`RuleSpec`. The graph, the walk,
the fast path and the coverage report read its fields; they never look for attributes on the
function.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, FrozenSet, Iterable, Optional, Sequence

from ..errors import PresetError

RuleFn = Callable[..., Sequence]

#: what a rule is to the coverage count (:mod:`relprop.engine.coverage`): ``"exact"``, a rule written
#: for the op with its formula (linear, products, softmax, norms, activations); ``"structural"``,
#: relevance moved without arithmetic (shape-only routing, selections, scatters: the ``"base"``
#: preset's rules); ``"fallback"``, a generic rule applied because the preset has nothing for the op
#: (the gradient-times-input z-rule of ``unsupported="z_rule"``)
RULE_KINDS = ("exact", "structural", "fallback")


@dataclasses.dataclass(frozen=True)
class GradientForm:
    """A rule's modified-gradient form, for the one-backward fast path
    (:mod:`relprop.rules.gradient_forms`), and what it declares.

    Attributes
    ----------
    replace : ``replace(node, live, eps) -> callable | None``: a replacement for ``node.target``
        (same arguments, same forward value) whose gradient is the rule, or None when the plain op's
        ordinary gradient is the rule. Calling the form calls it.
    lost : for an ε-rule (AttnLRP Eq. 8), ``lost(node, args, out, relevance, eps)``: the relevance
        its stabilizer keeps from the node's inputs (a tensor shaped like the relevance, booked as
        absorbed by the walk), a ``(label, share)`` pair booked under its own label, or None; None
        (the field): the form's rule passes all its relevance on.
    inner : the form this one wraps (the op's own form under :func:`epsilon_stabilized`), or None.
    """

    replace: Callable[..., Optional[Callable]]
    lost: Optional[Callable] = None
    inner: Optional["GradientForm"] = None

    def __call__(self, node, live, eps):
        """The replacement of ``node.target`` (``replace(node, live, eps)``)."""
        return self.replace(node, live, eps)

    @property
    def __name__(self) -> str:  # messages that name a form read this, as for a function
        return getattr(self.replace, "__name__", type(self.replace).__name__)


def as_form(form: Optional[Callable]) -> Optional[GradientForm]:
    """``form`` as a :class:`GradientForm` (a plain ``form(node, live, eps)`` function declares no
    ``lost``); None stays None."""
    if form is None or isinstance(form, GradientForm):
        return form
    return GradientForm(form)


def _positions(value: Optional[Iterable[int]]) -> FrozenSet[int]:
    return frozenset(value) if value is not None else frozenset()


@dataclasses.dataclass(frozen=True)
class RuleSpec:
    """A relevance rule and what it declares.

    Attributes
    ----------
    fn
        the rule, ``fn(ctx, relevance) -> one share per positional argument`` (see
        ``relprop.rules.rule_registry``).
    gradient_form
        its modified-gradient form, a ``GradientForm`` (a plain
        ``form(node, live, eps) -> replacement | None`` function is wrapped in one), for the
        one-backward fast path (``relprop.rules.gradient_forms``); None: the rule has none, and a
        preset that uses it walks the graph rule by rule.
    formula
        for a rule of ``aten.linear``, the formula ``formula(x, w, relevance, eps) -> R_x``
        (``w`` [in, out]) it applies, so that other rules apply the active preset's linear rule to
        linear maps that are not ``aten.linear`` (a product with a constant matrix, MoE experts).
    writes_out
        the rule may compute into its node's output buffer when the engine says it is dead
        (``relprop.rules.RuleContext.out_writable``); False: it is never told.
    no_relevance_to
        positions of arguments the rule never gives relevance to (the divisor of a
        normalization), so that ops feeding only those need no rule.
    constant_positions
        positions of arguments held constant for this node (selection parameters
        of a selective scan): a share the rule gives them is booked as absorbed.
    operands
        the nodes the rule is applied to instead of the node's arguments (a whole subgraph
        explained at its output node, e.g. an element-wise function written out op by op, applied
        to its input); None: the node's own arguments. Set per node by
        ``relprop.engine.node_rules``, not at registration.
    region
        the subgraph an ``operands`` rule explains (``relprop.graph.elementwise.Region``).
    kind
        what the rule is to the coverage count, one of ``RULE_KINDS``; None: the kind the preset it is
        registered in declares for its rules (``relprop.rules.Preset.rule_kind``).
    name, module
        the function's name and the last part of its module, for messages.
    """

    fn: RuleFn
    gradient_form: Optional[GradientForm] = None
    formula: Optional[Callable] = None
    writes_out: bool = False
    no_relevance_to: FrozenSet[int] = frozenset()
    constant_positions: FrozenSet[int] = frozenset()
    operands: Optional[tuple] = None
    region: Any = None
    kind: Optional[str] = None
    name: str = ""
    module: str = ""

    def __post_init__(self):
        if self.kind is not None and self.kind not in RULE_KINDS:
            raise PresetError(f"kind={self.kind!r} is not a rule kind. Choices: {list(RULE_KINDS)} (None: the kind "
                             "of the preset it is registered in)")
        object.__setattr__(self, "no_relevance_to", _positions(self.no_relevance_to))
        object.__setattr__(self, "constant_positions", _positions(self.constant_positions))
        object.__setattr__(self, "gradient_form", as_form(self.gradient_form))
        if not self.name:
            object.__setattr__(self, "name", getattr(self.fn, "__name__", type(self.fn).__name__))
        if not self.module:
            object.__setattr__(self, "module", str(getattr(self.fn, "__module__", "") or "").rsplit(".", 1)[-1])

    def __call__(self, ctx, relevance):
        """Apply the rule: ``fn(ctx, relevance)``."""
        return self.fn(ctx, relevance)

    @property
    def __name__(self) -> str:  # messages and reprs that name a rule read this, as for a function
        return self.name

    def declaring(self, **declared) -> "RuleSpec":
        """This spec with the keywords given (not None) replaced."""
        changes = {k: v for k, v in declared.items() if v is not None}
        return dataclasses.replace(self, **changes) if changes else self


def as_spec(rule, **declared) -> RuleSpec:
    """``rule`` (a function or a :class:`RuleSpec`) as a :class:`RuleSpec`, with the declared
    keywords (None: not declared) over what it declares already."""
    if isinstance(rule, RuleSpec):
        return rule.declaring(**declared)
    if not callable(rule):
        raise TypeError(f"a rule must be a function fn(ctx, relevance), not {type(rule).__name__}")
    return RuleSpec(rule).declaring(**declared)
