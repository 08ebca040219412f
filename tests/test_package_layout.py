"""The folders show the layers: every module sits in a package named for its layer, file names are
unique, and the public import paths of the loose modules that became packages keep working.

The layer of a package is read by ``tests/layering.py`` (``PACKAGE_LAYERS``); this file checks what a
reader of the tree sees: no loose top-level modules but the errors, the version and the entry points,
one file per name (``relprop/**/api.py`` twice would make "the api module" two things), and the old
paths (``relprop.demo``, ``relprop.generation``, ...) giving the very objects of the new ones.
"""
import collections
import importlib
import os
import subprocess
import sys
import textwrap

import layering
import pytest

import relprop

PACKAGE = os.path.dirname(os.path.abspath(relprop.__file__))
#: the only files directly under relprop/ besides the packages
TOP_LEVEL = {"__init__.py", "__main__.py", "errors.py", "version.py", "py.typed"}


def test_only_the_entry_points_errors_and_version_are_top_level_modules():
    loose = {f for f in os.listdir(PACKAGE) if os.path.isfile(os.path.join(PACKAGE, f))}
    assert loose == TOP_LEVEL, sorted(loose ^ TOP_LEVEL)
    packages = {f for f in os.listdir(PACKAGE) if os.path.isdir(os.path.join(PACKAGE, f)) and f != "__pycache__"}
    assert packages <= set(layering.PACKAGE_LAYERS), sorted(packages - set(layering.PACKAGE_LAYERS))


def duplicated_file_names(root: str) -> dict:
    """File name -> the paths that use it, for every .py name used twice under ``root`` (``__init__.py``
    aside)."""
    seen = collections.defaultdict(list)
    for folder, _, files in os.walk(root):
        for f in files:
            if f.endswith(".py") and f != "__init__.py":
                seen[f].append(os.path.relpath(os.path.join(folder, f), os.path.dirname(root)))
    return {name: sorted(paths) for name, paths in seen.items() if len(paths) > 1}


def test_file_names_are_unique():
    found = duplicated_file_names(PACKAGE)
    assert not found, "\n".join(f"{name}: {', '.join(paths)}" for name, paths in sorted(found.items()))


def test_the_name_check_sees_a_duplicate(tmp_path):
    for path in ("pkg/__init__.py", "pkg/a/__init__.py", "pkg/a/blocks.py", "pkg/b/__init__.py", "pkg/b/blocks.py",
                 "pkg/b/other.py"):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("")
    assert duplicated_file_names(str(tmp_path / "pkg")) == {
        "blocks.py": [os.path.join("pkg", "a", "blocks.py"), os.path.join("pkg", "b", "blocks.py")]}


#: old public import path -> (its module now, names it must still give)
OLD_PATHS = {
    "relprop.targets": ("relprop.targets", ("Target", "resolve", "next_token", "predicted_next_token", "contrast",
                                            "Contrast", "PositionTarget", "logits_of", "question_answering",
                                            "token_classification", "best_span", "specify", "head_kind")),
    "relprop.target_heads": ("relprop.targets.target_heads", ("question_answering", "token_classification",
                                                              "best_span", "QA_PARTS")),
    "relprop.target_forms": ("relprop.targets.target_forms", ("specify", "head_kind")),
    "relprop.demo": ("relprop.tools.demo", ("load", "checkpoint_dir", "ZeroShotClassifier", "DemoUnavailable",
                                            "labels_from_names")),
    "relprop.generation": ("relprop.api.generated_text", ("explain_generation", "GenerationExplanation",
                                                          "TOKENS_PER_CALL")),
    "relprop.actmax": ("relprop.tools.activation_maximization", ("maximize_activation", "Unit", "total_variation")),
    "relprop.raw_inputs": ("relprop.api.raw_inputs", ("pixels", "adapt", "model_image_size")),
    "relprop.api": ("relprop.api", ("explain", "explain_settings", "coverage", "prepare")),
}


@pytest.mark.parametrize("old", sorted(OLD_PATHS))
def test_old_public_paths_are_the_new_modules(old):
    new, names = OLD_PATHS[old]
    module = importlib.import_module(old)
    assert module is importlib.import_module(new)
    assert sys.modules[old] is module and module.__name__ == new and module.__spec__.name == new
    for name in names:
        assert hasattr(module, name), f"{old}.{name}"
    attribute = old.split(".")[1]
    assert getattr(relprop, attribute) is module  # relprop.demo after ``import relprop``


def test_old_paths_in_a_fresh_interpreter():
    """``from relprop.X import name`` and ``relprop.X.name`` with nothing imported before, as a user's
    script would (the lazy module paths of ``relprop/__init__.py`` and the packages' re-exports)."""
    script = textwrap.dedent("""
        import relprop
        assert relprop.demo.load is relprop.tools.demo.load
        from relprop.generation import explain_generation, TOKENS_PER_CALL
        from relprop.target_heads import question_answering
        from relprop.targets import next_token, question_answering as qa
        from relprop.api import explain
        assert qa is question_answering and explain is relprop.explain
        assert explain_generation is relprop.explain_generation and TOKENS_PER_CALL > 0
        assert relprop.targets.next_token is next_token and relprop.contrast is relprop.targets.contrast
        print("ok")
    """)
    env = dict(os.environ, PYTHONPATH=os.path.dirname(PACKAGE))
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.split() == ["ok"]


def test_every_public_name_of_relprop_still_reads():
    for name in relprop.__all__:
        assert getattr(relprop, name) is not None, name
