"""The ``relprop`` command line (also ``python -m relprop``).

==================  ======================================================================================
module              job
==================  ======================================================================================
``parser``          the arguments of every command (imports nothing heavy)
``common``          exit statuses, one-line errors, offline mode, parsing --option (imports nothing heavy)
``early_checks``    every command's argument checks that need no model, run before torch is imported
``known_names``     the methods with their options, the presets, metrics and units those checks know
``loading``         loading a model offline (folder, timm name, cached hub id, the demo) and running it;
                    the --method names
``commands``        ``relprop methods``, ``relprop explain``, ``relprop demo``
``images``          explaining image files (``--image``)
``texts``           explaining texts (``--text``, ``--text-file``, the demo)
``evaluate``        ``relprop evaluate``: the papers' evaluation protocols on a dataset
``visualize``       ``relprop visualize``: activation maximization
==================  ======================================================================================

Everything runs offline: models are loaded from a local folder or the local HuggingFace/timm cache
(``HF_HUB_OFFLINE=1``, ``local_files_only=True``) and nothing is ever downloaded. A mistake a user can
make (missing file, unknown model, model not available offline, unknown method, bad target) is one line
on stderr and a non-zero exit status, never a traceback (``--debug`` shows it).

Start-up: this module is the dispatcher. It parses the arguments with :mod:`relprop.cli.parser` and
:mod:`relprop.cli.common` and checks them with :mod:`relprop.cli.early_checks` (a missing file, an
unknown method or option), which import no torch, numpy, transformers or timm, so ``relprop --help``,
``relprop COMMAND --help``, ``relprop --version`` and a bad argument take a fraction of a second. Only
then does :func:`run_command` import the module that runs the command (:data:`COMMANDS`), with
``importlib.import_module`` on a name written in this file; ``Loaded`` and ``load_model`` and the
submodules are read the same way (:data:`LAZY_IMPORTS`). This module and ``relprop/__init__.py`` are
the only places allowed to import relprop modules that way, and ``tests/layering.py`` counts every
such import as an import (so none may point to a higher layer or close a cycle).
"""
from __future__ import annotations

import argparse
import importlib
import sys
from typing import TYPE_CHECKING, Optional, Sequence

from ..errors import RelpropError
from ..version import __version__
from .common import (DEMO_NAME, EXIT_FAILED, EXIT_MODEL, EXIT_OK, EXIT_USAGE, CliError, fail, go_offline, quiet,
                     root_cause)
from .early_checks import check_arguments
from .parser import build_parser

if TYPE_CHECKING:  # what type checkers see; at run time, __getattr__ below
    from .loading import Loaded, load_model

__all__ = ["DEMO_NAME", "EXIT_FAILED", "EXIT_MODEL", "EXIT_OK", "EXIT_USAGE", "CliError", "Loaded", "build_parser",
           "load_model", "main", "run_command"]

#: command -> (the module that runs it, its function of the parsed arguments returning the exit status)
COMMANDS = {
    "methods": ("relprop.cli.commands", "cmd_methods"),
    "explain": ("relprop.cli.commands", "cmd_explain"),
    "demo": ("relprop.cli.commands", "cmd_demo"),
    "evaluate": ("relprop.cli.evaluate", "run"),
    "visualize": ("relprop.cli.visualize", "run"),
}

#: public names and submodules of this package that are imported on their first read
LAZY_IMPORTS = {
    "Loaded": "relprop.cli.loading", "load_model": "relprop.cli.loading",
    "commands": "relprop.cli.commands", "loading": "relprop.cli.loading", "images": "relprop.cli.images",
    "texts": "relprop.cli.texts", "evaluate": "relprop.cli.evaluate", "visualize": "relprop.cli.visualize",
}


def run_command(args: argparse.Namespace) -> int:
    """Import the module that runs ``args.command`` (:data:`COMMANDS`) and run it; returns its exit
    status. The one place where the command line imports the heavy modules (torch and the models)."""
    module = importlib.import_module(COMMANDS[args.command][0])
    return getattr(module, COMMANDS[args.command][1])(args)


def __getattr__(name: str):
    """``relprop.cli.load_model``, ``relprop.cli.commands``, ...: imported on first read (PEP 562)."""
    if name not in LAZY_IMPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(LAZY_IMPORTS[name])
    return module if module.__name__ == f"{__name__}.{name}" else getattr(module, name)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line; returns the exit status (the console script exits with it)."""
    go_offline()
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        if args.version:
            print(f"relprop {__version__}")
            return EXIT_OK
        if not getattr(args, "command", None):
            parser.print_help()
            return EXIT_USAGE
        check_arguments(args)  # before torch is imported: a mistake is answered at once (early_checks)
        quiet(debug)  # after parsing: silencing transformers imports it
        return run_command(args)
    except CliError as err:
        fail(str(err))
        if debug:
            raise
        return err.code
    except KeyboardInterrupt:
        fail("interrupted")
        return 130
    except BrokenPipeError:
        return EXIT_OK
    except Exception as err:  # noqa: BLE001 - one line, not a traceback
        if debug:
            raise
        first = (str(err).strip().splitlines() or [""])[0]
        if isinstance(err, RelpropError):
            fail(first + (" (--debug shows the whole message)" if "\n" in str(err).strip() else ""))
        else:
            fail(f"{type(err).__name__}: {first}{root_cause(err)} (run with --debug for the traceback)")
        return EXIT_FAILED
