"""What relprop does with a model: every op of its captured graph and how it is handled.

``relprop.coverage(model, inputs)`` captures the model exactly as :func:`relprop.explain` would
(same cache, model untouched) and, without running it, :func:`report` says for every ``call_function`` node
of the graph its aten op, the module it came from (``nn_module_stack``) and its *handling* under a
preset:

``rule``          on the relevance path, with a rule of the preset (the rule's module, function and
                  the preset it is registered in, e.g. ``linear.linear (chefer2021)``)
``shape-only``    on the relevance path, routed by a structural rule (those of the ``base`` preset:
                  view, permute, slice, cat, where, ...): relevance moves, unchanged
``missing``       on the relevance path with no rule: :func:`relprop.explain` raises
                  :class:`relprop.UnsupportedOperation` for it
``fallback``      on the relevance path with no rule of the preset, given the generic z-rule
                  (reported with ``unsupported="z_rule"``, as :func:`relprop.explain` applies it)
``source``        where relevance stops: the embedding lookup of the token ids
``no relevance``  depends on the input but receives no relevance: it only feeds arguments a rule
                  gives none to (a divisor, e.g. a norm), or does not reach the output
``constant``      does not depend on the input (mask building, positions, shapes, parameters):
                  it needs no rule; relevance it is handed is reported as absorbed

and the attention blocks found (a softmax whose output multiplies the values), input → output.

Each node is also counted in one of :data:`CATEGORIES`, read from what the rules declare
(:attr:`relprop.rules.spec.RuleSpec.kind`, else the ``rule_kind`` of the preset the rule is registered
in), never from a list of op names: ``exact`` (a rule written for the op with its formula, and the ops
inside an element-wise function one such rule explains as a whole), ``structural`` (relevance moved
without arithmetic: a shape-only rule, an element of a list output, and the nodes that need no rule:
source, constant, no relevance), ``fallback`` (a generic rule declared ``kind="fallback"``) and
``missing``. :meth:`Coverage.shares` gives their percentages over the graph or over the relevance path;
DynamicLRP (Lee & Millan Arias, 2025) reports the same kind of figure over autograd nodes.

The relevance path is the one the engine walks (:func:`relprop.graph.nodes.relevance_path`): from
the outputs back along every argument a rule can give relevance to. It goes on past an op with no
rule as if relevance reached all of that op's live arguments, so every missing op of the model is
listed, not only the first one :func:`relprop.explain` would stop at. The table is built from the
registry, so a rule registered with ``@relprop.rule`` shows up at once.
"""
from __future__ import annotations

import collections
import dataclasses
import operator
from typing import Dict, List, Optional, Sequence, Union

import torch
import torch.fx

from ..errors import op_name
from ..graph.capture import Captured
from ..graph.nodes import module_path, module_type, relevance_path
from ..rules import rule_registry as registry
from ..rules.rule_registry import ELEMENTWISE_FUNCTION, Preset
from .node_rules import regions, rule_finder

STATUSES = ("rule", "shape-only", "missing", "fallback", "source", "no relevance", "constant")
#: what a node is to the coverage count (module docstring)
CATEGORIES = ("exact", "structural", "fallback", "missing")


@dataclasses.dataclass(frozen=True)
class OpReport:
    """One node of the captured graph."""

    node: str  # the node's name in the graph, e.g. "linear_3"
    op: str  # "aten.linear.default"
    module: str  # module path, e.g. "blocks.0.attn.qkv" ('' at the top level)
    module_type: str  # e.g. "Linear"
    status: str  # one of STATUSES
    rule: Optional[str] = None  # "<module>.<function> (<preset>)" for rule / shape-only
    category: str = "structural"  # one of CATEGORIES
    on_path: bool = False  # relevance reaches it (or the element-wise function it is inside of)


@dataclasses.dataclass(frozen=True)
class BlockReport:
    """One attention block found in the graph."""

    index: int
    name: str  # module path of the attention
    layer: str  # module path of the enclosing layer
    heads: Optional[int]
    tokens: Optional[int]


@dataclasses.dataclass
class Coverage:
    """The coverage report of one model on one input signature: every op of the captured graph and how
    a preset handles it (rule, shape-only, missing, source, no relevance, constant; docs/models.md).

    ``str(report)`` is the full table (every op, then the blocks, then a summary);
    ``missing`` lists the ops ``relprop.explain`` has no rule for.
    """

    model: str
    preset: str
    modality: str
    grid: Optional[tuple]
    ops: List[OpReport]
    blocks: List[BlockReport]

    @property
    def missing(self) -> List[OpReport]:
        """The ops on the relevance path that have no rule in the preset."""
        return [o for o in self.ops if o.status == "missing"]

    @property
    def complete(self) -> bool:
        """True when every op on the relevance path has a rule (explain() will not raise for one)."""
        return not self.missing

    @property
    def fallbacks(self) -> List[OpReport]:
        """The ops given a generic fallback rule (the z-rule of ``unsupported="z_rule"``)."""
        return [o for o in self.ops if o.category == "fallback"]

    def counts(self) -> Dict[str, int]:
        """Number of ops per handling, in the order of ``STATUSES``."""
        c = collections.Counter(o.status for o in self.ops)
        return {s: c.get(s, 0) for s in STATUSES}

    def category_counts(self, on_path: bool = False) -> Dict[str, int]:
        """Number of nodes per ``CATEGORIES`` entry, over the whole graph or (``on_path``) over
        the nodes relevance reaches."""
        c = collections.Counter(o.category for o in self.ops if o.on_path or not on_path)
        return {k: c.get(k, 0) for k in CATEGORIES}

    def shares(self, on_path: bool = False) -> Dict[str, float]:
        """Percent of the nodes per ``CATEGORIES`` entry (they sum to 100; all 0 for an empty graph)."""
        c = self.category_counts(on_path)
        total = sum(c.values())
        return {k: 100.0 * n / total if total else 0.0 for k, n in c.items()}

    def by_op(self) -> List[tuple]:
        """``(op, status, rule, count, first module)`` per distinct (op, handling), in graph order."""
        rows: Dict[tuple, list] = {}
        for o in self.ops:
            key = (o.op, o.status, o.rule)
            if key not in rows:
                rows[key] = [o.op, o.status, o.rule, 0, o.module]
            rows[key][3] += 1
        return [tuple(r) for r in rows.values()]

    def table(self, statuses: Optional[Sequence[str]] = None) -> str:
        """Every op (or those with a handling in ``statuses``), one line each, in graph order."""
        ops = [o for o in self.ops if statuses is None or o.status in statuses]
        head = ("node", "op", "module", "handling")
        rows = [(o.node, o.op, o.module or "(top level)", o.status + (f": {o.rule}" if o.rule else ""))
                for o in ops]
        return _columns(head, rows)

    def summary(self) -> str:
        """The handling counts, the distinct ops with their rules, the missing ops and the blocks."""
        lines = [f"relprop coverage of {self.model} (preset '{self.preset}', {self.modality} input"
                 + (f", patch grid {self.grid[0]}x{self.grid[1]}" if self.grid else "") + ")"]
        lines.append("  ".join(f"{s}: {n}" for s, n in self.counts().items()))
        lines.append(self.shares_line())
        lines.append("")
        lines.append(_columns(("op", "handling", "count", "first module"),
                              [(op, status + (f": {rule}" if rule else ""), str(n), mod or "(top level)")
                               for op, status, rule, n, mod in self.by_op() if status != "constant"]))
        lines.append("")
        if self.blocks:
            lines.append(f"attention blocks ({len(self.blocks)}):")
            lines.append(_columns(("#", "attention", "layer", "heads", "tokens"),
                                  [(str(b.index), b.name, b.layer, _num(b.heads), _num(b.tokens))
                                   for b in self.blocks]))
        else:
            lines.append("attention blocks: none found (no softmax whose output multiplies the values); "
                         "only methods without attention apply")
        lines.append("")
        if self.missing:
            seen = []
            for o in self.missing:
                if (o.op, o.module) not in seen:
                    seen.append((o.op, o.module))
            lines.append(f"MISSING: {len(self.missing)} op(s) on the relevance path have no rule in preset "
                         f"'{self.preset}':")
            lines += [f"  {op} in {mod or '(top level)'}" for op, mod in seen]
            op = seen[0][0]
            lines.append(f"register one with @relprop.rule(torch.ops.{op}, preset='{self.preset}') "
                         "(docs/extending.md, 'Adding a rule')")
        else:
            lines.append(f"every op on the relevance path has a rule in preset '{self.preset}'")
        if self.fallbacks:
            named = collections.Counter((o.op, o.rule) for o in self.fallbacks)
            lines.append(f"FALLBACK: {len(self.fallbacks)} op(s) get a generic rule:")
            lines += [f"  {op} x{n}: {rule}" for (op, rule), n in named.items()]
        return "\n".join(lines)

    def shares_line(self) -> str:
        """The category shares in one line: over every node of the graph, then over the relevance path."""
        def part(on_path):
            n = sum(self.category_counts(on_path).values())
            return f"{n} nodes: " + ", ".join(f"{k} {v:.1f} %" for k, v in self.shares(on_path).items())
        return f"graph {part(False)} (relevance path {part(True)})"

    def __str__(self) -> str:
        return self.table() + "\n\n" + self.summary()

    def __repr__(self) -> str:
        c = self.counts()
        return (f"Coverage(model='{self.model}', preset='{self.preset}', ops={len(self.ops)}, "
                f"rule={c['rule']}, shape_only={c['shape-only']}, missing={c['missing']}, blocks={len(self.blocks)})")


def report(captured: Captured, preset: Union[str, Preset], model_name: str = "model",
           unsupported: str = "error") -> Coverage:
    """Build the :class:`Coverage` of a captured graph under ``preset`` (a :class:`relprop.rules.Preset`;
    a name, from a direct caller, is resolved here). ``unsupported="z_rule"``: an op without a rule is
    reported as a ``fallback`` given the generic z-rule, as :func:`relprop.explain` would apply it."""
    preset = registry.get_preset(preset)
    a = captured.analysis
    rule_of = rule_finder(captured, preset, unsupported)
    path = set(relevance_path(captured.graph, a.live, a.sources, rule_of, through_missing=True))
    inside = _inside_functions(captured, preset, path)
    sources = set(a.sources)
    ops = []
    for node in captured.graph.nodes:
        if node.op != "call_function":
            continue
        rule, category = None, "structural"
        if node in sources:
            status = "source"
        elif node not in a.live:
            status = "constant"
        elif node not in path:
            status = "no relevance"
            if node in inside:
                category, rule = "exact", f"inside the element-wise function explained at {inside[node].name}"
        elif node.target is operator.getitem:
            status, rule = "shape-only", "element of a list output"
        else:
            spec = rule_of(node)
            rule = registry.describe(preset, node.target)
            category = "missing" if spec is None else _kind(preset, spec, node.target)
            status = {"missing": "missing", "structural": "shape-only", "fallback": "fallback"}.get(category, "rule")
            if spec is not None and spec.operands is not None:  # an element-wise function explained as a whole
                category = _kind(preset, spec, ELEMENTWISE_FUNCTION)
                status, rule = "rule", (f"{registry.describe(preset, ELEMENTWISE_FUNCTION)} on the element-wise "
                                        f"function of {spec.operands[0].name} ({len(spec.region.nodes)} ops)")
            elif rule is None and spec is not None:  # a generic rule of the engine (unsupported="z_rule")
                rule = f"{spec.module}.{spec.name} (unsupported='{unsupported}')"
            elif spec is not None and spec.constant_positions:
                rule = f"{rule}, with selection parameters of a selective scan held constant"
        ops.append(OpReport(node.name, op_name(node.target), module_path(node), module_type(node), status, rule,
                            category, node in path or node in inside))
    blocks = []
    for b in a.blocks:
        v = b.attention.meta.get("val")
        shape = tuple(v.shape) if isinstance(v, torch.Tensor) else ()
        heads = _int(shape[-3]) if len(shape) >= 4 else None
        tokens = _int(shape[-1]) if shape else None
        blocks.append(BlockReport(b.index, b.name, b.layer, heads, tokens))
    return Coverage(model_name, preset.name, a.modality, a.grid, ops, blocks)


def _kind(preset: Preset, spec, op) -> str:
    """What ``spec``, the rule of ``op``, is to the coverage count: its declared ``kind``, else the
    ``rule_kind`` of the preset of ``preset``'s lineage it is registered in."""
    if spec.kind is not None:
        return spec.kind
    found = preset.owner(op)
    return found[1].rule_kind if found is not None else "exact"


def _inside_functions(captured: Captured, preset: Preset, path) -> Dict[torch.fx.Node, torch.fx.Node]:
    """{node inside an element-wise function explained as a whole on the relevance path: its output}."""
    if preset.lookup(ELEMENTWISE_FUNCTION) is None:
        return {}
    return {n: out for out, region in regions(captured).items() if out in path
            for n in region.nodes if n is not out}


def _int(s) -> Optional[int]:
    try:
        return int(s)
    except (TypeError, ValueError, RuntimeError):
        return None


def _num(v) -> str:
    return "?" if v is None else str(v)


def _columns(head: tuple, rows: List[tuple]) -> str:
    widths = [max([len(head[i])] + [len(r[i]) for r in rows]) for i in range(len(head))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths[:-1]) + "  {}"
    lines = [fmt.format(*head), fmt.format(*("-" * w for w in widths))]
    lines += [fmt.format(*r) for r in rows]
    return "\n".join(line.rstrip() for line in lines)
