"""relprop is built as one-way layers, with an explicit public surface.

The imports of every module of ``relprop/`` are read from the source (``tests/layering.py``); a
module may import only from its own layer or the layers below it, never a relprop module inside a
function, no two modules may import each other (directly or in a cycle), and no module is longer
than ~400 lines.
"""
import os
import subprocess
import sys
import textwrap

import pytest

import layering

import relprop

VIOLATIONS = layering.violations()


@pytest.mark.parametrize("kind", ["upward", "function-level", "cycles", "too long"])
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


def test_public_surface():
    assert set(relprop.__all__) <= set(dir(relprop))
    for name in ("explain", "coverage", "methods", "Explanation", "Preset", "presets", "rule", "RelpropError"):
        assert name in relprop.__all__
    import relprop.methods as m  # the subpackage, not a function that shadows it
    assert m is relprop.methods and hasattr(m, "get_method") and hasattr(m, "registry")
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
