"""``relprop --help``, ``relprop COMMAND --help``, ``relprop --version`` and a bad argument are
answered without importing torch, numpy, transformers or timm (they took 6–8 s when the parser
imported the commands, and the commands torch), and ``import relprop`` alone imports none of them.

Each test is one fresh interpreter (``sys.modules`` of this process has torch long since), a fraction
of a second.
"""
import json
import os
import subprocess
import sys
import textwrap

import pytest

from relprop.version import __version__

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
HEAVY = ("torch", "numpy", "transformers", "timm", "PIL", "matplotlib", "scipy", "rich", "tqdm")


def _python(*args, **kw):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=120, cwd=ROOT,
                          **kw)


def test_help_version_and_bad_arguments_import_nothing_heavy():
    """Each argv run by relprop.cli.main in one fresh interpreter: its exit status, what it printed
    and the heavy modules imported by then (none)."""
    script = textwrap.dedent("""
        import contextlib, io, json, sys
        from relprop.cli import main
        results = []
        for argv in json.loads(sys.argv[1]):
            out, err = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                try:
                    code = main(argv)
                except SystemExit as stop:  # --help: argparse prints and exits 0
                    code = stop.code
            results.append([code, out.getvalue(), err.getvalue()])
        heavy = [m for m in json.loads(sys.argv[2]) if m in sys.modules]
        print(json.dumps({"results": results, "heavy": heavy}))
    """)
    argvs = [["--help"], ["explain", "--help"], ["demo", "--help"], ["methods", "--help"], ["evaluate", "--help"],
             ["visualize", "--help"], ["--version"], [], ["explain", "--bogus"], ["evaluate"],
             ["visualize", "--model", "m", "--out", "o"], ["methods", "--format", "yaml"], ["nocommand"],
             # argument mistakes of explain/demo are answered before torch is imported
             ["explain", "--image", "/no/such/picture.png"], ["explain", "--image", __file__], ["explain"],
             ["explain", "--text", "hi", "--option", "start_block"], ["demo", "--option", "a=1", "--option", "a=2"],
             ["demo", "--text-file", "/no/such/texts.txt"],
             # ... and so are unknown methods, presets and option keys, and those of evaluate and visualize
             ["explain", "--text", "hi", "--method", "rolout"], ["demo", "--preset", "attnlpr"],
             ["explain", "--text", "hi", "--model", "m", "--method", "rollout", "--option", "strat_block=4"],
             ["evaluate", "/no/such/data", "--model", "m", "--out", "o"],
             ["evaluate", HERE, "--model", "m", "--out", "o", "--method", "rollout", "--grid", "head_fusion=mean,max",
              "bogus=1"],
             ["evaluate", HERE, "--model", "m", "--out", "o", "--batch-size", "0"],
             ["evaluate", HERE, "--model", "m", "--out", "o", "--metric", "auc"],
             ["evaluate", HERE, "--model", "m", "--out", "o", "--timm-kwargs", "{bad"],
             ["visualize", "--model", "m", "--out", "o", "--unit", "neuron:1"],
             ["visualize", "--model", "m", "--out", "o", "--unit", "class:1", "--lr", "0"]]
    p = _python("-c", script, json.dumps(argvs), json.dumps(HEAVY))
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout)
    assert got["heavy"] == []
    codes = [r[0] for r in got["results"]]
    assert codes == [0] * 7 + [2] * 22
    helps = [r[1] for r in got["results"][:6]]
    assert helps[0].startswith("usage: relprop ") and "exit status:" in helps[0]
    assert "--counterfactual" in helps[1] and "--labels" in helps[2] and "--format" in helps[3]
    assert "--grid" in helps[4] and "--perturbation-batch-size" in helps[4] and "--unit" in helps[5]
    assert got["results"][6][1] == f"relprop {__version__}\n"  # the version, nothing else
    for code, out, err in got["results"][8:]:  # relprop's one line, no traceback
        assert err.startswith("relprop: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert "unrecognized arguments: --bogus" in got["results"][8][2]
    assert "required: data, --model, --out" in got["results"][9][2]
    assert "required: --unit" in got["results"][10][2]
    assert "invalid choice: 'yaml'" in got["results"][11][2]
    early = [r[2] for r in got["results"][13:]]
    assert "image file not found: /no/such/picture.png" in early[0]
    assert "--model is required for images" in early[1]
    assert "nothing to explain" in early[2]
    assert "--option 'start_block' is not KEY=VALUE" in early[3]
    assert "--option a is given twice" in early[4]
    assert "text file not found" in early[5]
    assert "unknown method: 'rolout' is not a method. Choices: [" in early[6] and "Did you mean 'rollout'?" in early[6]
    assert "unknown --preset 'attnlpr': one of base, chefer2021" in early[7] and "did you mean 'attnlrp'" in early[7]
    assert "--option strat_block is not an option of rollout; they take: discard_ratio, end_block" in early[8]
    assert "/no/such/data is neither a folder nor a file" in early[9]
    assert "--grid bogus is not an option of rollout; they take: " in early[10]
    assert "--batch-size must be >= 1, not 0" in early[11]
    assert "--metric 'auc' is not a choice: one of positive_auc" in early[12]
    assert "--timm-kwargs is not JSON" in early[13]
    assert "--unit 'neuron:1' is not a unit" in early[14]
    assert "--lr must be > 0" in early[15]


def test_python_m_relprop_help_imports_no_torch():
    """The real entry (``python -m relprop --help``), as ``python -X importtime`` lists its imports."""
    p = _python("-X", "importtime", "-m", "relprop", "--help")
    assert p.returncode == 0 and p.stdout.startswith("usage: relprop "), p.stderr[-2000:]
    imported = {line.split("|")[-1].strip() for line in p.stderr.splitlines() if line.startswith("import time:")}
    assert "relprop.cli.parser" in imported
    assert not imported & set(HEAVY), sorted(imported & set(HEAVY))


def test_import_relprop_is_light():
    """``import relprop`` imports the errors and the version only; a public name's module is imported
    when the name is first read (PEP 562; that each name is its module's object is
    tests/test_layers.py::test_lazy_names_are_what_they_name)."""
    script = textwrap.dedent("""
        import json, sys
        import relprop
        from relprop import RelpropError, __version__
        loaded = sorted(m for m in sys.modules if m.startswith("relprop"))
        heavy = [m for m in json.loads(sys.argv[1]) if m in sys.modules]
        print(json.dumps({"relprop": loaded, "heavy": heavy, "error": RelpropError.__module__,
                          "explain_in_dir": "explain" in dir(relprop)}))
    """)
    p = _python("-c", script, json.dumps(HEAVY))
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads(p.stdout) == {"relprop": ["relprop", "relprop.errors", "relprop.version"], "heavy": [],
                                    "error": "relprop.errors", "explain_in_dir": True}


def test_public_names_load_on_use():
    import relprop
    from relprop import explain  # the lazy name through the import statement
    assert explain is relprop.explain and explain.__module__ == "relprop.api.front_door"
    assert callable(relprop.methods) and relprop.methods.get_method("rollout").name == "rollout"


def test_the_names_checked_before_torch_are_the_registries():
    """relprop/cli/known_names.py (what the early checks know without importing torch) equals what
    the methods, presets, tune metrics and activation-maximization units register."""
    import relprop
    from relprop.cli import known_names, loading
    from relprop.evaluation.tune import METRICS
    from relprop.methods import get_method
    from relprop.tools import demo
    from relprop.tools.activation_maximization import UNIT_KINDS, Unit

    registered = {n: tuple(sorted(get_method(n).options)) for n in relprop.methods()}
    assert known_names.METHOD_OPTIONS == registered
    assert known_names.PRESETS == tuple(relprop.presets())
    assert set(known_names.TUNE_METRICS) == set(METRICS)
    assert known_names.DEMO_DEFAULT_METHOD == demo.DEFAULT_METHOD
    assert known_names.EXPLAIN_DEFAULT_METHOD == loading.Loaded(None, "text", "m").default_method
    assert set(known_names.UNIT_ARITY) == set(UNIT_KINDS)
    from relprop.cli.early_checks import check_unit
    from relprop.cli.common import CliError
    from relprop.errors import OptionError
    for kind in UNIT_KINDS:  # the early check of --unit accepts what Unit.parse accepts, and no more
        for n in range(5):
            spec = ":".join([kind] + ["-1"] * n)
            try:
                Unit.parse(spec)
                parsed = True
            except OptionError:
                parsed = False
            try:
                check_unit(spec)
                checked = True
            except CliError:
                checked = False
            assert parsed == checked, spec


def test_every_method_option_can_be_given_with_option():
    """Each option of each method, with its default value written as on the command line
    (``--option KEY=VALUE``), is read back as that value and passes explain()'s checks of the method's
    options; a key the method does not take is a one-line error that lists the keys it takes."""
    import inspect

    import relprop
    from relprop.api.options import method_options
    from relprop.cli.common import CliError, parse_option
    from relprop.cli import known_names
    from relprop.cli.early_checks import check_option_keys
    from relprop.methods import get_method

    seen = 0
    for name in relprop.methods():
        info = get_method(name)
        params = inspect.signature(info.fn).parameters
        for key in info.options:
            default = params[key].default
            assert default is None or isinstance(default, (bool, int, float, str)), (name, key, default)
            text = "none" if default is None else str(default).lower() if isinstance(default, bool) else str(default)
            assert parse_option(f"{key}={text}") == (key, default), (name, key, text)
            check_option_keys([key], [name])
            assert method_options([info], {key: default}, False) == {name: {key: default}}
            seen += 1
        with pytest.raises(CliError) as err:
            check_option_keys(["no_such_option"], [name])
        taken = ", ".join(sorted(info.options)) or "no options"
        assert str(err.value) == (f"--option no_such_option is not an option of {name}; they take: {taken}; "
                                  f"explain() settings: {', '.join(known_names.EXPLAIN_SETTINGS)}")
    assert seen >= 60
    # the settings of explain() itself: its keyword arguments that a command line can give (not the
    # objects: tokenizer, image processor, mask, tuning; nor wrt, the input of a multi-input model; nor progress)
    params = inspect.signature(relprop.explain).parameters
    kw = {k for k, p in params.items() if p.kind is p.KEYWORD_ONLY}
    assert set(known_names.EXPLAIN_SETTINGS) == kw - {"special_tokens_mask", "tokenizer", "wrt", "image_processor",
                                                      "progress", "tuning"}
    for key in known_names.EXPLAIN_SETTINGS:
        check_option_keys([key], ["lrp"])  # taken by every call
        check_option_keys([key], ["smoothgrad", "rollout"])
