"""Coverage as a figure: the share of each zoo architecture's graph nodes that relprop handles with an
exact rule, a structural one, a fallback, or not at all (``relprop.coverage``), per model and in total,
and the same count by DynamicLRP (Lee & Millan Arias, 2025) when a checkout of its code is given.

Run through ``python benchmarks/zoo_report.py --coverage`` (see there). Only the capture runs for relprop
(``torch.export``, no explanation). The categories come from what the rules declare
(:data:`relprop.engine.coverage.CATEGORIES`):

* exact: a rule written for the op, with its formula (and the ops of an element-wise function that one
  rule explains as a whole);
* structural: relevance moved without arithmetic (shape-only routing, an element of a list output) or
  no rule needed (the embedding lookup where relevance stops, constants, ops feeding only a divisor);
* fallback: a generic rule (the gradient-times-input z-rule of ``unsupported="z_rule"``);
* missing: no rule; ``explain()`` refuses the model under that preset.

DynamicLRP counts the nodes of the *autograd* graph reached from the explained score (``grad_fn`` objects,
parameters' ``AccumulateGrad`` leaves included, ``addmm`` and convolutions split into product + bias) and
gives each node type its propagation function by name, any type without one the identity
(``IdentityProp``). Its code is imported from the checkout (``DIR/src``) and run on the same tiny models.
"""
from __future__ import annotations

import collections
import dataclasses
import os
import sys
from typing import Dict, List, Optional, Sequence, Tuple

import torch

import relprop
import zoo
from relprop.engine.coverage import CATEGORIES
from zoo_checks import forward, get_model, target_scores


@dataclasses.dataclass
class Row:
    """The coverage of one architecture under one preset."""

    model: str
    preset: str
    counts: Dict[str, int]  # nodes per category, whole graph
    path_counts: Dict[str, int]  # nodes per category, relevance path
    #: (op, count) of each op in the fallback or missing category
    named: Dict[str, List[Tuple[str, int]]] = dataclasses.field(default_factory=dict)
    error: Optional[str] = None  # the capture's refusal, when relprop cannot capture the model

    @property
    def nodes(self) -> int:
        return sum(self.counts.values())

    def share(self, category: str, on_path: bool = False) -> float:
        counts = self.path_counts if on_path else self.counts
        total = sum(counts.values())
        return 100.0 * counts[category] / total if total else 0.0


def coverage_rows(names: Sequence[str], presets: Sequence[str]) -> List[Row]:
    """One :class:`Row` per (architecture, preset): ``relprop.coverage`` of the zoo entry on its tiny
    inputs (captured once per model, reported per preset)."""
    rows = []
    for name in names:
        entry = zoo.ZOO[name]
        model = get_model(name)
        inputs = entry.inputs(model)
        for preset in presets:
            try:
                report = relprop.coverage(model, inputs, preset, wrt=entry.wrt)
            except relprop.RelpropError as err:
                empty = dict.fromkeys(CATEGORIES, 0)
                why = " ".join(f"{type(err).__name__}: {err}".split())[:200]
                rows.append(Row(name, preset, empty, dict(empty), error=why))
                continue
            named = {c: collections.Counter(o.op for o in report.ops if o.category == c).most_common()
                     for c in ("fallback", "missing")}
            rows.append(Row(name, preset, report.category_counts(), report.category_counts(on_path=True), named))
    return rows


def total(rows: Sequence[Row], preset: str) -> Row:
    """The rows of ``preset`` summed (architectures the capture refused left out)."""
    counts, path, named = collections.Counter(), collections.Counter(), collections.defaultdict(collections.Counter)
    for r in rows:
        if r.preset != preset or r.error:
            continue
        counts.update(r.counts)
        path.update(r.path_counts)
        for c, ops in r.named.items():
            named[c].update(dict(ops))
    return Row("TOTAL", preset, {c: counts[c] for c in CATEGORIES}, {c: path[c] for c in CATEGORIES},
               {c: n.most_common() for c, n in named.items()})


def named_ops(rows: Sequence[Row], category: str, preset: str) -> List[Tuple[str, int, List[str]]]:
    """(op, nodes, models) of every op counted in ``category`` under ``preset``."""
    ops: Dict[str, list] = {}
    for r in rows:
        if r.preset != preset:
            continue
        for op, n in r.named.get(category, []):
            entry = ops.setdefault(op, [op, 0, []])
            entry[1] += n
            entry[2].append(r.model)
    return [tuple(v) for v in ops.values()]


def markdown(rows: Sequence[Row], preset: str) -> str:
    """The table of one preset: per architecture, then the total."""
    head = ("model", "nodes", "exact %", "structural %", "fallback %", "missing", "path nodes", "path exact %",
            "path structural %", "fallback / missing ops")
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in [r for r in rows if r.preset == preset] + [total(rows, preset)]:
        if r.error:
            lines.append(f"| {r.model} | capture refused: {r.error} |" + " |" * (len(head) - 2))
            continue
        ops = "; ".join(f"{c}: " + ", ".join(f"{op} x{n}" for op, n in r.named.get(c, []))
                        for c in ("fallback", "missing") if r.named.get(c))
        bold = "**" if r.model == "TOTAL" else ""
        cells = (f"{bold}{r.model}{bold}", str(r.nodes), f"{r.share('exact'):.1f}", f"{r.share('structural'):.1f}",
                 f"{r.share('fallback'):.1f}", str(r.counts["missing"]), str(sum(r.path_counts.values())),
                 f"{r.share('exact', True):.1f}", f"{r.share('structural', True):.1f}", ops or "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def same_counts(rows: Sequence[Row], presets: Sequence[str]) -> List[str]:
    """The presets whose rows have exactly the counts of the first preset's, on every architecture."""
    key = {p: [(r.model, r.counts, r.path_counts) for r in rows if r.preset == p] for p in presets}
    return [p for p in presets if key[p] == key[presets[0]]]


def _stacked(ax, labels, parts, colours, title):
    """One stacked horizontal bar per label: ``parts`` {name: [percent per label]}."""
    left = [0.0] * len(labels)
    for name, widths in parts.items():
        ax.barh(range(len(labels)), widths, left=left, color=colours[name], label=name, height=0.8)
        left = [a + b for a, b in zip(left, widths)]
    ax.set_title(title, fontsize=9)
    ax.set_xlim(0, 100)
    ax.set_ylim(len(labels) - 0.5, -0.5)
    ax.tick_params(labelsize=7)
    ax.set_xlabel("% of the nodes", fontsize=8)


def draw(rows: Sequence[Row], presets: Sequence[str], path: str, peer: Optional[Sequence["PeerRow"]] = None) -> None:
    """Stacked bars per architecture (and the total) of the nodes by category under the first preset: over
    the relevance path, over the whole graph, and (``peer``) DynamicLRP's autograd nodes by handling."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    preset = presets[0]
    colours = {"exact": "#2b6cb0", "structural": "#90cdf4", "fallback": "#ed8936", "missing": "#c53030",
               "own function": "#2f855a", "AccumulateGrad (leaf)": "#cbd5e0", "IdentityProp by default": "#ed8936"}
    by_model = {r.model: r for r in rows if r.preset == preset}
    by_model["TOTAL"] = t = total(rows, preset)
    models = list(by_model)
    failed = {p.model for p in peer or () if p.error}
    labels = [m + (" (relprop: capture refused)" if by_model[m].error else "")
              + (" (DynamicLRP failed)" if m in failed else "") for m in models]
    panels = 3 if peer else 2
    fig, axes = plt.subplots(1, panels, figsize=(4.0 * panels + 1.6, 0.2 * len(models) + 1.8), sharey=True)
    same = same_counts(rows, presets)
    for ax, on_path in zip(axes, (True, False)):
        n = sum((t.path_counts if on_path else t.counts).values())
        ok = t.share("exact", on_path) + t.share("structural", on_path)
        _stacked(ax, labels, {c: [by_model[m].share(c, on_path) for m in models] for c in CATEGORIES}, colours,
                 f"relprop, {'relevance path' if on_path else 'whole graph'}: {n} aten nodes\n"
                 f"{ok:.2f} % exact or structural")
    axes[0].set_yticks(range(len(models)))
    axes[0].set_yticklabels(labels)
    if peer:
        ran = {p.model: p for p in peer}

        def pct(p, n):
            return 100.0 * n / p.nodes if p is not None and not p.error and p.nodes else 0.0
        sums = [sum(p.nodes for p in peer if not p.error), sum(p.dedicated for p in peer if not p.error),
                sum(p.leaves for p in peer if not p.error)]
        whole = PeerRow("TOTAL", *sums, {"": sums[0] - sums[1] - sums[2]})
        get = {**ran, "TOTAL": whole}.get
        parts = {"own function": [pct(get(m), get(m).dedicated) if get(m) else 0.0 for m in models],
                 "AccumulateGrad (leaf)": [pct(get(m), get(m).leaves) if get(m) else 0.0 for m in models],
                 "IdentityProp by default": [pct(get(m), sum(get(m).identity.values())) if get(m) else 0.0
                                             for m in models]}
        _stacked(axes[2], labels, parts, colours, f"DynamicLRP: {sums[0]} autograd nodes\n"
                 f"{100.0 * sums[1] / max(1, sums[0] - sums[2]):.2f} % of non-leaf nodes with their own function")
    fig.suptitle(f"Coverage of the zoo ({len(models) - 1} tiny architectures), preset '{preset}'"
                 + (f" (the same counts under {', '.join(same[1:])})" if len(same) > 1 else ""), fontsize=10)
    handles = {label: h for ax in axes for h, label in zip(*ax.get_legend_handles_labels())}
    fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.45 / fig.get_figheight(), 1, 1))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------ DynamicLRP's count


@dataclasses.dataclass
class PeerRow:
    """DynamicLRP's count on one architecture: autograd nodes by how its engine handles them."""

    model: str
    nodes: int = 0
    dedicated: int = 0  # a propagation function written for the node type
    leaves: int = 0  # AccumulateGrad: parameters and inputs (relevance stops)
    identity: Dict[str, int] = dataclasses.field(default_factory=dict)  # types given IdentityProp by default
    error: Optional[str] = None


def load_dynamiclrp(checkout: str):
    """``(LRPEngine, LRPPropFunctions)`` imported from a DynamicLRP checkout (``checkout/src``)."""
    sys.path.insert(0, os.path.join(os.path.abspath(checkout), "src"))
    from lrp_engine import LRPEngine
    from lrp_engine.lrp_prop_fcns import LRPPropFunctions
    return LRPEngine, LRPPropFunctions


def dynamiclrp_rows(names: Sequence[str], checkout: str) -> List[PeerRow]:
    """DynamicLRP's node count per architecture: the zoo model run forward with autograd on its inputs
    (float inputs marked as requiring a gradient, as DynamicLRP's examples do), its graph built from the
    entry's target scores with ``LRPEngine.get_model_operations`` and each node type mapped to its
    propagation function with ``LRPPropFunctions.generate_prop_fcn_map`` (its own code, unchanged)."""
    engine, functions = load_dynamiclrp(checkout)
    rows = []
    for name in names:
        entry = zoo.ZOO[name]
        model = get_model(name)
        inputs = entry.inputs(model)
        grad = {k: v.detach().clone().requires_grad_(True) if torch.is_tensor(v) and v.is_floating_point() else v
                for k, v in inputs.items()} if isinstance(inputs, dict) else (
            inputs.detach().clone().requires_grad_(True) if inputs.is_floating_point() else inputs)
        try:
            with torch.enable_grad():
                scores = target_scores(entry, forward(model, grad), grad)
                types, _, nodes = engine.get_model_operations(scores)
                fcn_map = functions.generate_prop_fcn_map(types)
        except Exception as err:  # noqa: BLE001 - the peer's failure is the finding, recorded as it is
            rows.append(PeerRow(name, error=" ".join(f"{type(err).__name__}: {err}".split())[:160]))
            continue
        identity = {t: n for t, n in types.items() if fcn_map[t] is functions.IdentityProp}
        leaves = types.get("AccumulateGrad", 0)
        rows.append(PeerRow(name, nodes, nodes - leaves - sum(identity.values()), leaves, identity))
    return rows


def peer_markdown(peer: Sequence[PeerRow], rows: Sequence[Row], preset: str) -> str:
    """DynamicLRP's count beside relprop's (relevance path, ``preset``) on the same architectures."""
    ours = {r.model: r for r in rows if r.preset == preset}
    head = ("model", "DynamicLRP nodes", "with own function", "AccumulateGrad", "IdentityProp by default",
            f"relprop path nodes ({preset})", "relprop exact+structural %")
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    sums, both = collections.Counter(), []
    for p in peer:
        r = ours.get(p.model)
        mine = (str(sum(r.path_counts.values())), f"{r.share('exact', True) + r.share('structural', True):.1f}") \
            if r is not None and not r.error else ("capture refused", "-")
        if p.error:
            lines.append(f"| {p.model} | could not run: {p.error} | | | | {mine[0]} | {mine[1]} |")
            continue
        ident = ", ".join(f"{t} x{n}" for t, n in sorted(p.identity.items(), key=lambda kv: -kv[1])) or "-"
        lines.append(f"| {p.model} | {p.nodes} | {p.dedicated} | {p.leaves} | {ident} | {mine[0]} | {mine[1]} |")
        if r is not None and not r.error:
            both.append(r)
            sums.update(nodes=p.nodes, dedicated=p.dedicated, leaves=p.leaves, identity=sum(p.identity.values()))
    t = total(both, preset)
    lines.append(f"| **TOTAL, the {len(both)} both ran** | {sums['nodes']} | {sums['dedicated']} | {sums['leaves']} | "
                 f"{sums['identity']} | {sum(t.path_counts.values())} | "
                 f"{t.share('exact', True) + t.share('structural', True):.2f} |")
    inner = sums["nodes"] - sums["leaves"]
    lines.append(f"\nDynamicLRP, the {len(both)} both ran: {sums['dedicated']} of {inner} non-leaf autograd nodes "
                 f"({100.0 * sums['dedicated'] / max(1, inner):.2f} %) "
                 f"have a propagation function of their own, {sums['identity']} get IdentityProp by default")
    return "\n".join(lines)
