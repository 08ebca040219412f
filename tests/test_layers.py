"""relprop is built as one-way layers, with an explicit public surface.

The imports of every module of ``relprop/`` are read from the source (``tests/layering.py``); a
module may import only from its own layer or the layers below it, never a relprop module inside a
function, no two modules may import each other (directly or in a cycle), and no module is longer
than ~400 lines. Lazy imports (``importlib.import_module``) are allowed only in the package's
``__init__`` and the command line's dispatcher, and count as imports.
"""
import ast
import importlib
import os
import subprocess
import sys
import textwrap

import pytest

import layering

import relprop

VIOLATIONS = layering.violations()


@pytest.mark.parametrize("kind", ["upward", "function-level", "cycles", "too long", "lazy"])
def test_layering(kind):
    found = VIOLATIONS[kind]
    assert not found, f"{len(found)} {kind} import(s)/module(s):\n" + "\n".join(found)


def test_every_module_has_a_layer():
    for module in layering.modules():
        layering.layer_of(module)  # raises KeyError for a module no layer names


def test_the_checker_sees_what_it_must_refuse(tmp_path, monkeypatch):
    """The reader of imports finds a function-level import and an upward import when there is one."""
    pkg = tmp_path / "relprop"
    (pkg / "graph").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "errors.py").write_text("")
    (pkg / "api.py").write_text("")
    (pkg / "graph" / "__init__.py").write_text("")
    (pkg / "graph" / "nodes.py").write_text(textwrap.dedent("""
        from ..errors import x
        def f():
            from .. import api
    """))
    monkeypatch.setattr(layering, "ROOT", str(pkg))
    found = layering.violations()
    assert any("relprop.graph.nodes" in v and "relprop.api" in v for v in found["upward"])
    assert any("inside a function" in v for v in found["function-level"])


def test_the_checker_follows_lazy_imports(tmp_path, monkeypatch):
    """importlib.import_module of a literal or of a literal table's item is an edge of the graph (here
    upward and closing a cycle); one outside the allowed places, or of a name the reader cannot
    follow, or of no module, is refused; a third-party module imported so elsewhere is not."""
    pkg = tmp_path / "relprop"
    (pkg / "graph").mkdir(parents=True)
    (pkg / "__init__.py").write_text(textwrap.dedent("""
        import importlib
        LAZY = {"explain": "relprop.api", "nothing": "relprop.nowhere"}
        def __getattr__(name):
            return importlib.import_module(LAZY[name])
    """))
    (pkg / "api.py").write_text("from . import errors\n")
    (pkg / "errors.py").write_text(textwrap.dedent("""
        import importlib
        def later():
            return importlib.import_module("relprop.api")
    """))
    (pkg / "graph" / "__init__.py").write_text(textwrap.dedent("""
        import importlib
        from importlib import import_module
        def f(name):
            importlib.import_module("timm")
            import_module("relprop.api")
            return importlib.import_module(name)
    """))
    monkeypatch.setattr(layering, "ROOT", str(pkg))
    monkeypatch.setattr(layering, "LAZY_PLACES", ("relprop", "relprop.errors"))
    edges, _ = layering.lazy_imports(layering.modules())
    assert edges["relprop"] == [("relprop.api", 5)] and edges["relprop.errors"] == [("relprop.api", 4)]
    assert edges["relprop.graph"] == []
    found = layering.violations()
    assert found["upward"] == ["relprop.errors:4 imports relprop.api (errors -> api)"]
    assert found["cycles"] == ["relprop.api <-> relprop.errors"]
    assert found["function-level"] == []
    lazy = found["lazy"]
    assert len(lazy) == 3, lazy
    assert any("relprop:5" in v and "'relprop.nowhere'" in v and "no module" in v for v in lazy)
    assert any("relprop.graph:6 imports relprop.api lazily; only relprop, relprop.errors may" == v for v in lazy)
    assert any("relprop.graph:7" in v and "cannot follow" in v for v in lazy)


def test_lazy_names_are_what_they_name():
    """Every public name read lazily (relprop.LAZY_IMPORTS) is the object its module defines, the
    names are those the type checkers see (the TYPE_CHECKING imports), and every command of the
    parser has the function that runs it (relprop.cli.COMMANDS)."""
    from relprop import cli
    eager = {"RelpropError", "CaptureError", "DispatchError", "InputError", "MethodError", "OptionError",
             "PresetError", "PositionPathError", "TargetError", "UnsupportedOperation", "RelpropWarning",
             "__version__"}
    assert set(relprop.__all__) == set(relprop.LAZY_IMPORTS) | eager
    for name, module in relprop.LAZY_IMPORTS.items():
        mod = importlib.import_module(module)
        assert getattr(relprop, name) is (mod if module == f"relprop.{name}" else getattr(mod, name)), name
    with open(relprop.__file__, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    guarded = next(n for n in tree.body if isinstance(n, ast.If) and getattr(n.test, "id", "") == "TYPE_CHECKING")
    seen = {}
    for node in guarded.body:
        for alias in node.names:
            seen[alias.name] = "relprop" + (f".{node.module}" if node.module else f".{alias.name}")
    assert seen == relprop.LAZY_IMPORTS
    commands = cli.build_parser()._subparsers._group_actions[0].choices
    assert set(commands) == set(cli.COMMANDS)
    for module, function in cli.COMMANDS.values():
        assert callable(getattr(importlib.import_module(module), function))
    assert cli.load_model is importlib.import_module("relprop.cli.loading").load_model
    assert cli.commands is importlib.import_module("relprop.cli.commands")


def test_public_surface():
    assert set(relprop.__all__) <= set(dir(relprop))
    for name in ("explain", "coverage", "methods", "Explanation", "Preset", "presets", "rule", "RelpropError"):
        assert name in relprop.__all__
    import relprop.methods as m  # the subpackage, not a function that shadows it
    assert m is relprop.methods and hasattr(m, "get_method") and hasattr(m, "method_registry")
    table = relprop.methods()  # and it is still callable
    assert "transformer_attribution" in table and table["lrp"]["signed"] is True
    assert list(table)[0] == "transformer_attribution"
    assert isinstance(relprop.presets(), dict) and "chefer2021" in relprop.presets()


def test_no_comment_points_outside_the_repository():
    """No docstring or comment of relprop/ points to a file that is not in the repository or to an
    issue number."""
    bad = []
    for module, path in layering.modules().items():
        with open(path, encoding="utf-8") as f:
            for i, line in enumerate(f, 1):
                if "DESIGN" in line or "shared/papers" in line or "relprop.methods.pooled" in line \
                        or "issue #" in line or "(issue " in line:
                    bad.append(f"{path}:{i}: {line.strip()}")
    assert not bad, "\n".join(bad)


def test_explaining_needs_only_torch(tmp_path):
    """With numpy, tqdm, matplotlib, scipy, sklearn, transformers and timm unavailable, relprop imports
    and explains a plain torch attention model (the extras are for pictures, evaluation, the CLI)."""
    script = textwrap.dedent("""
        import sys
        for name in ("numpy", "tqdm", "matplotlib", "scipy", "sklearn", "transformers", "timm", "PIL", "rich"):
            sys.modules[name] = None  # import fails
        import torch
        import relprop

        class Block(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.qkv = torch.nn.Linear(8, 24)
                self.proj = torch.nn.Linear(8, 8)
            def forward(self, x):
                q, k, v = self.qkv(x).chunk(3, -1)
                a = torch.softmax(q @ k.transpose(-1, -2) / 8 ** 0.5, -1)
                return x + self.proj(a @ v)

        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.blocks = torch.nn.Sequential(Block(), Block())
                self.head = torch.nn.Linear(8, 3)
            def forward(self, x):
                return self.head(self.blocks(x)[:, 0])

        torch.manual_seed(0)
        model = Net().eval()
        exp = relprop.explain(model, torch.randn(2, 5, 8), target=1, method=["transformer_attribution", "lrp",
                                                                           "integrated_gradients"])
        assert exp[0].scores.shape == (2, 5) and len(exp[0].blocks) == 2
        print("ok", "numpy" in sys.modules and sys.modules["numpy"] is not None)
    """)
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(relprop.__file__))))
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.split() == ["ok", "False"]
