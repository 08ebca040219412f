"""The layers of relprop and the imports between its modules, read from the source with ``ast``.

relprop is built as one-way layers: a module imports only from its own layer or the layers below
it (``LAYERS``, bottom first). This module reads every ``import`` of ``relprop/`` (module-level and
function-level), assigns each module to the layer of its package (the first name under ``relprop``,
:data:`PACKAGE_LAYERS`), and reports what breaks the rule:

* an import of a module of a higher layer (an *upward* import);
* an import of a relprop module inside a function (it hides a dependency, often a cycle);
* a cycle among modules;
* a module longer than :data:`MAX_LINES` lines;
* a *lazy* import of a relprop module (``importlib.import_module(...)``, ``__import__(...)``) outside
  :data:`LAZY_PLACES`, or a lazy import whose module the reader cannot name.

A lazy import is an import that runs when a function is called (``relprop --help`` must not import
torch): only the package's ``__init__`` (its public names, PEP 562) and the command line's dispatcher
may have them. Its argument must be a string literal or an item of a module-level literal table
(``importlib.import_module(LAZY_IMPORTS[name])``, ``COMMANDS[command][0]``): every ``"relprop...."``
string of that table is then one of the module's imports. Lazy imports are edges of the import graph
like the others, so they too may not point to a higher layer or close a cycle.

``tests/test_layers.py`` fails on any of them. Run it to print the tree with line counts per module
and the import graph by layer::

    python tests/layering.py            # tree, graph and violations
"""
from __future__ import annotations

import ast
import os
import sys
from typing import Dict, List, Optional, Set, Tuple

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "relprop")

#: layers, bottom first
LAYERS: List[str] = ["errors", "graph", "rules", "engine", "methods", "viz", "explanation", "models", "api", "tools",
                     "cli", "package"]
#: first name under relprop/ (a package, or one of the few top-level modules) -> its layer. A package is
#: named for its layer, except ``targets`` (what is explained: the engine resolves it into the relevance
#: seed), ``evaluation`` (the papers' protocols) and ``interop`` (relprop inside captum, Quantus and
#: inseq), tools built on the api like the others; ``errors`` and
#: ``version`` are the two modules everything may import, ``__main__`` is the command line, and the
#: package itself (``relprop/__init__.py``, the public surface) re-exports every layer.
PACKAGE_LAYERS: Dict[str, str] = {
    "errors": "errors", "version": "errors",
    "graph": "graph",
    "rules": "rules",
    "engine": "engine", "targets": "engine",
    "methods": "methods",
    "viz": "viz",
    "explanation": "explanation",
    "models": "models",
    "api": "api",
    "tools": "tools", "evaluation": "tools", "interop": "tools",
    "cli": "cli", "__main__": "cli",
}
#: modules longer than this are two modules
MAX_LINES = 400
#: the only modules allowed to import relprop modules lazily (importlib.import_module): the package's
#: public names and the command line's dispatcher
LAZY_PLACES = ("relprop", "relprop.cli")
#: the calls that import a module by name
_LAZY_CALLS = {("importlib", "import_module"), (None, "import_module"), (None, "__import__"),
               ("importlib", "__import__")}


def modules() -> Dict[str, str]:
    """Dotted module name -> file path, for every .py file under relprop/."""
    out = {}
    base = os.path.dirname(ROOT)
    for folder, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                rel = os.path.relpath(path, base)[:-3].replace(os.sep, ".")
                out[rel[: -len(".__init__")] if rel.endswith(".__init__") else rel] = path
    return out


def layer_of(module: str) -> int:
    """The rank in :data:`LAYERS` of a module, read from the first name under ``relprop`` (its package)."""
    parts = module.split(".")
    if parts[0] != "relprop":
        raise KeyError(f"{module} is not a module of relprop/")
    if len(parts) == 1:
        return LAYERS.index("package")
    if parts[1] not in PACKAGE_LAYERS:
        raise KeyError(f"{module} is in no layer: relprop.{parts[1]} is not in PACKAGE_LAYERS of tests/layering.py")
    return LAYERS.index(PACKAGE_LAYERS[parts[1]])


def _resolve(module: str, is_package: bool, node: ast.AST) -> List[str]:
    """The relprop modules an import statement names (``from . import a, b`` names a and b)."""
    names = []
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
        if node.level:
            parts = module.split(".")
            base = parts if is_package else parts[:-1]
            base = base[: len(base) - (node.level - 1)]
            prefix = ".".join(base + ([node.module] if node.module else []))
        else:
            prefix = node.module or ""
        names = [prefix] + [f"{prefix}.{a.name}" for a in node.names]
    return [n for n in names if n == "relprop" or n.startswith("relprop.")]


def imports(mods: Dict[str, str]) -> Dict[str, List[Tuple[str, int, bool]]]:
    """module -> [(imported relprop module, line, inside a function)]; only names that are modules."""
    out = {}
    for mod, path in mods.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        is_package = path.endswith("__init__.py")
        found = []

        def visit(node, in_function):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    named = _resolve(mod, is_package, child)
                    targets = [n for n in named if n in mods]
                    if isinstance(child, ast.ImportFrom):  # ``from p import m``: the submodule m, not p
                        sub = [n for n in targets[1:]] if targets and targets[0] == named[0] else targets
                        targets = sub or targets[:1]
                    for t in dict.fromkeys(targets):
                        if t != mod:
                            found.append((t, child.lineno, in_function))
                visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

        visit(tree, False)
        out[mod] = found
    return out


def _literal_tables(tree: ast.Module) -> Dict[str, ast.AST]:
    """Module-level ``NAME = {...}`` / ``[...]`` / ``(...)`` literals of a module, by name."""
    out = {}
    for node in tree.body:
        targets, value = [], None
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        if isinstance(value, (ast.Dict, ast.List, ast.Tuple, ast.Set)):
            out.update({t.id: value for t in targets if isinstance(t, ast.Name)})
    return out


def _lazy_call(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call):
        return False
    f = node.func
    if isinstance(f, ast.Name):
        return (None, f.id) in _LAZY_CALLS
    return isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and (f.value.id, f.attr) in _LAZY_CALLS


def _lazy_targets(call: ast.Call, tables: Dict[str, ast.AST]) -> Optional[List[str]]:
    """The module names a lazy import may import: its string literal, or the ``relprop`` strings of
    the module-level table it indexes (``TABLE[key]``, ``TABLE[key][0]``); None: cannot tell."""
    if not call.args:
        return None
    arg = call.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return [arg.value]
    while isinstance(arg, ast.Subscript):
        arg = arg.value
    if not (isinstance(arg, ast.Name) and arg.id in tables):
        return None
    table = tables[arg.id]
    parts = table.values if isinstance(table, ast.Dict) else table.elts
    return [n.value for part in parts for n in ast.walk(part) if isinstance(n, ast.Constant)
            and isinstance(n.value, str) and (n.value == "relprop" or n.value.startswith("relprop."))]


def lazy_imports(mods: Dict[str, str]) -> Tuple[Dict[str, List[Tuple[str, int]]], List[str]]:
    """module -> [(lazily imported relprop module, line)], and the lazy imports that break the rules
    (outside :data:`LAZY_PLACES`, a module the reader cannot name, a name that is no module)."""
    edges, bad = {}, []
    for mod, path in mods.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        tables = _literal_tables(tree)
        found = []
        for node in ast.walk(tree):
            if not _lazy_call(node):
                continue
            where = f"{mod}:{node.lineno}"
            targets = _lazy_targets(node, tables)
            if targets is None:
                bad.append(f"{where} imports a module lazily by a name this reader cannot follow (use a string "
                           "literal or an item of a module-level literal table)")
                continue
            targets = [t for t in targets if t == "relprop" or t.startswith("relprop.")]  # not timm, ...
            if targets and mod not in LAZY_PLACES:
                bad.append(f"{where} imports {', '.join(targets)} lazily; only {', '.join(LAZY_PLACES)} may")
                continue
            for t in targets:
                if t not in mods:
                    bad.append(f"{where} imports {t!r} lazily, which is no module of relprop/")
                elif t != mod:
                    found.append((t, node.lineno))
        edges[mod] = list(dict.fromkeys(found))
    return edges, bad


def line_count(path: str) -> int:
    with open(path, encoding="utf-8") as f:
        return sum(1 for _ in f)


def cycles(edges: Dict[str, Set[str]]) -> List[List[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def strong(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in list(edges):
        if v not in index:
            strong(v)
    return out


def violations() -> Dict[str, list]:
    """Every break of the layering rules (see the module docstring), by kind."""
    mods = modules()
    imp = imports(mods)
    lazy, lazy_bad = lazy_imports(mods)
    up, inner = [], []
    for mod, found in imp.items():
        if mod == "relprop":
            continue
        for target, line, in_function in found + [(t, line, False) for t, line in lazy[mod]]:
            if target == "relprop" or layer_of(target) > layer_of(mod):
                up.append(f"{mod}:{line} imports {target} ({LAYERS[layer_of(mod)]} -> "
                          f"{LAYERS[layer_of(target)]})")
            if in_function:
                inner.append(f"{mod}:{line} imports {target} inside a function")
    edges = {m: {t for t, _, _ in f if not _is_parent_package(t, m)} | {t for t, _ in lazy[m]}
             for m, f in imp.items()}
    long = [f"{m}: {line_count(p)} lines" for m, p in sorted(mods.items()) if line_count(p) > MAX_LINES]
    return {"upward": up, "function-level": inner, "cycles": [" <-> ".join(c) for c in cycles(edges)],
            "too long": long, "lazy": lazy_bad}


def _is_parent_package(target: str, mod: str) -> bool:
    """``from . import x`` inside package p names p itself first: not a dependency of its own."""
    return mod.startswith(target + ".")


def report() -> str:
    mods = modules()
    imp = imports(mods)
    lines = ["relprop/ by layer (bottom first), lines per module:"]
    total = 0
    for rank, name in enumerate(LAYERS):
        members = sorted(m for m in mods if layer_of(m) == rank)
        if not members:
            continue
        lines.append(f"  [{rank}] {name}")
        for m in members:
            n = line_count(mods[m])
            total += n
            lines.append(f"      {os.path.relpath(mods[m], os.path.dirname(ROOT)):<44} {n:>5}")
    lines.append(f"  {len(mods)} modules, {total} lines")
    lines.append("")
    lines.append("imports between layers (edges module layer -> imported layer, with counts):")
    counts: Dict[Tuple[str, str], int] = {}
    for mod, found in imp.items():
        for t, _, _ in found:
            if _is_parent_package(t, mod):
                continue
            key = (LAYERS[layer_of(mod)], LAYERS[layer_of(t)])
            counts[key] = counts.get(key, 0) + 1
    for (a, b), n in sorted(counts.items(), key=lambda kv: (layer_of_name(kv[0][0]), layer_of_name(kv[0][1]))):
        arrow = "UP " if layer_of_name(b) > layer_of_name(a) and a != "package" else "   "
        lines.append(f"  {arrow}{a:<12} -> {b:<12} {n:>3}")
    lines.append("")
    lines.append(f"lazy imports (importlib.import_module; allowed in {', '.join(LAZY_PLACES)} only):")
    for mod, found in sorted(lazy_imports(mods)[0].items()):
        for t, line in found:
            lines.append(f"  {mod}:{line} -> {t}")
    lines.append("")
    for kind, items in violations().items():
        lines.append(f"{kind}: {len(items)}")
        lines += [f"  {x}" for x in items]
    return "\n".join(lines)


def layer_of_name(name: str) -> int:
    return LAYERS.index(name)


if __name__ == "__main__":
    print(report())
