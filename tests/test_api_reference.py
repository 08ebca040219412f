"""docs/api.md covers the public names and only those, named the way users write them, and the docstrings it
renders read cleanly with mkdocstrings' numpy parser.

The rule (stated at the top of docs/api.md): every name of ``relprop.__all__`` has an entry; the other entries
are public names of the subpackages the guides import from (:data:`PUBLIC_SUBPACKAGES`, a name being public
when it is in the subpackage's ``__all__``), and every such name a guide writes (``relprop.targets.next_token``,
``from relprop.viz import heads_figure``) has an entry too. An entry is ``::: <path>``, optionally with a
``heading:`` that names the object as users write it when the path the docs tool reads is another (the demo's
``relprop.demo`` is ``relprop.tools.demo`` on disk): the heading and the path must be the same object.
"""
import ast
import importlib
import importlib.util
import inspect
import re
import types
from pathlib import Path

import pytest

import relprop

ROOT = Path(__file__).resolve().parents[1]
API = ROOT / "docs" / "api.md"
#: the subpackages whose public names (their ``__all__``) the guides tell users to import
PUBLIC_SUBPACKAGES = ("targets", "methods", "rules", "viz", "evaluation", "interop", "demo")
#: Sphinx cross-reference roles, which markdown shows literally (write ``relprop.explain`` instead)
SPHINX_ROLE = re.compile(r":(?:py:)?(?:func|class|meth|mod|data|attr|exc|obj|const|ref):`")
#: numpy docstring sections whose items are ``name : type`` lines (the type goes to the table's type column)
ITEM_SECTIONS = {"parameters", "other parameters", "attributes", "returns", "yields", "raises", "receives", "warns"}


def entries():
    """(path the docs tool reads, the public name shown, the members option or None) of every ``:::`` line."""
    text = API.read_text(encoding="utf-8")
    found = []
    for m in re.finditer(r"^::: (\S+)\n((?:    .*\n)*)", text, flags=re.M):
        options = m.group(2)
        heading = re.search(r'^\s+heading: "([^"]+)"', options, flags=re.M)
        members = re.search(r"^\s+members: \[(.*)\]", options, flags=re.M)
        found.append((m.group(1), heading.group(1) if heading else m.group(1),
                      [x.strip() for x in members.group(1).split(",")] if members else None))
    return found


def resolve(path: str):
    """The object a dotted path names, read as users read it: attribute by attribute from ``relprop``,
    importing a submodule only where no attribute has the name."""
    parts = path.split(".")
    obj = importlib.import_module(parts[0])
    for i, name in enumerate(parts[1:], start=2):
        obj = getattr(obj, name) if hasattr(obj, name) else importlib.import_module(".".join(parts[:i]))
    return obj


def resolve_on_disk(path: str):
    """The object a path of an entry names, read as the docs tool reads it: the longest module path, then
    attributes."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(path)


def shadowed_module(path: str) -> bool:
    """Whether ``path`` names a function or class at run time but a module of the same name on disk
    (``relprop.evaluation.tune``), which the docs tool, reading files, would document instead."""
    try:
        spec = importlib.util.find_spec(path)
    except (ImportError, ValueError):  # a parent is not a package (relprop.evaluation.tune.tune)
        spec = None
    return spec is not None and not isinstance(resolve(path), types.ModuleType)


def public_names(subpackage: str) -> set:
    module = resolve(f"relprop.{subpackage}")
    if hasattr(module, "__all__"):
        return set(module.__all__)
    return {n for n, v in vars(module).items() if not n.startswith("_")
            and getattr(v, "__module__", None) == module.__name__}


def test_the_reference_is_parsed():
    found = entries()
    assert len(found) > 40
    assert ("relprop.methods.table", "relprop.methods()", None) in found
    assert ("relprop.explain", "relprop.explain", None) in found


def test_every_public_name_of_relprop_has_an_entry():
    documented = {shown.removesuffix("()") for _, shown, _ in entries()}
    missing = [name for name in relprop.__all__ if f"relprop.{name}" not in documented]
    assert not missing, f"names of relprop.__all__ without an entry in docs/api.md: {missing}"


@pytest.mark.parametrize("path, shown", [(p, s) for p, s, _ in entries()])
def test_an_entry_names_a_public_name(path, shown):
    name = shown.removesuffix("()")
    parts = name.split(".")
    assert parts[0] == "relprop" and not any(p.startswith("_") and not p.startswith("__") for p in parts), shown
    if len(parts) == 2:
        assert parts[1] in relprop.__all__, f"{shown} is not in relprop.__all__"
    else:
        assert len(parts) == 3 and parts[1] in PUBLIC_SUBPACKAGES, f"{shown}: an internal module path"
        assert parts[2] in public_names(parts[1]), f"{shown} is not a public name of relprop.{parts[1]}"
    assert not any(p.startswith("_") and not p.startswith("__") for p in path.split(".")), path
    assert not shadowed_module(path), f"{path} is a module on disk: write the path of the object in it"
    if shown.endswith("()"):  # relprop.methods() is the function the entry documents
        assert resolve(name)() == resolve_on_disk(path)()
    else:
        assert resolve(name) is resolve_on_disk(path), f"{shown} and {path} are different objects"


def guide_names():
    """``relprop.<public subpackage>.<name>`` the guides and the README write or import."""
    names = set()
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        text = page.read_text(encoding="utf-8")
        for sub, name in re.findall(r"\brelprop\.(\w+)\.(\w+)", text):
            names.add((sub, name))
        for sub, imported in re.findall(r"from relprop\.(\w+) import ([\w, ]+)", text):
            names.update((sub, n.strip()) for n in imported.split(","))
    return {(s, n) for s, n in names if s in PUBLIC_SUBPACKAGES and n in public_names(s)
            and not isinstance(getattr(resolve(f"relprop.{s}"), n), types.ModuleType)}


def test_the_guides_names_have_entries():
    assert ("targets", "next_token") in guide_names()
    documented = {name for path, shown, _ in entries() for name in (path, shown)}
    missing = sorted(f"relprop.{s}.{n}" for s, n in guide_names() if f"relprop.{s}.{n}" not in documented)
    assert not missing, f"public names the guides use, without an entry in docs/api.md: {missing}"


def documented_objects():
    """(label, docstring) of every entry and of the members it renders (public ones; those listed, if any)."""
    for path, shown, members in entries():
        obj = resolve_on_disk(path)
        yield shown, obj.__doc__
        if isinstance(obj, type):
            inner = {n: v for n, v in vars(obj).items() if not re.match(r"^_[^_]", n)}
        elif isinstance(obj, types.ModuleType):
            inner = {n: getattr(obj, n) for n in members or getattr(obj, "__all__", [])}
        else:
            inner = {}
        for name, value in inner.items():
            value = value.fget if isinstance(value, property) else getattr(value, "__func__", value)
            if (inspect.isfunction(value) or inspect.isclass(value)) and value.__doc__:
                yield f"{shown}.{name}", value.__doc__


def test_the_checks_read_members():
    labels = {label for label, _ in documented_objects()}
    assert {"relprop.Explanation.show", "relprop.Explanation.kept_blocks", "relprop.viz.colours.rgb"} <= labels


def test_documented_docstrings_have_no_sphinx_roles():
    bad = [label for label, doc in documented_objects() if doc and SPHINX_ROLE.search(doc)]
    assert not bad, f"Sphinx roles show literally in the API reference; write ``name`` instead: {bad}"


def is_type(text: str) -> bool:
    """Whether the text after ``name :`` reads as a type (``int``, ``torch.Tensor or None``, ``str,
    optional``) rather than a description, which would land in the type column."""
    t = re.sub(r",\s*optional$", "", text.strip().rstrip(".")).replace(" or ", " | ")
    try:
        ast.parse(t, mode="eval")
    except SyntaxError:
        return False
    return len(t.split()) <= 4


def misplaced_descriptions(doc: str) -> list:
    """Lines of the item sections of a numpy docstring that the parser would misread: ``name : description``
    (the description lands in the type column) and prose at the items' indentation (read as an item, or
    swallowed by the item above it: write such a paragraph before the sections)."""
    lines = inspect.cleandoc(doc).splitlines()
    bad, section = [], None
    for i, line in enumerate(lines):
        if i + 1 < len(lines) and re.fullmatch(r"\s*-{3,}\s*", lines[i + 1]):
            section = line.strip().lower()
            continue
        if section not in ITEM_SECTIONS or not line.strip() or line[0].isspace() or re.fullmatch(r"-{3,}", line):
            continue
        m = re.match(r"^([\w*][\w*, ]*?) : (.+)$", line)
        if not (is_type(m.group(2)) if m else re.fullmatch(r"[\w*]+(, [\w*]+)*", line) or is_type(line)):
            bad.append(line)
    return bad


def test_the_type_check_tells_types_from_descriptions():
    doc = """Do it.

    Parameters
    ----------
    x : torch.Tensor or None
        the input.
    k : int, optional
    model : the classifier (eval mode); not modified.
    a, b
        two more.

    Returns
    -------
    Explanation
        the result.

    A paragraph after the sections.
    """
    assert misplaced_descriptions(doc) == ["model : the classifier (eval mode); not modified.",
                                           "A paragraph after the sections."]


def test_parameter_descriptions_are_not_in_the_type_column():
    bad = {label: lines for label, doc in documented_objects() if doc and (lines := misplaced_descriptions(doc))}
    assert not bad, f"write the name on its own line and the description indented under it: {bad}"
