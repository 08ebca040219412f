"""The ``relprop`` command line (also ``python -m relprop``).

=============  ========================================================================================
module         job
=============  ========================================================================================
``parser``     the argument parser of every command
``common``     exit statuses, one-line errors, offline mode, argument checks
``loading``    loading a model offline (folder, timm name, cached hub id, the demo) and running it
``commands``   ``relprop methods``, ``relprop explain``, ``relprop demo``
``images``     explaining image files (``--image``)
``texts``      explaining texts (``--text``, ``--text-file``, the demo)
``evaluate``   ``relprop evaluate``: the papers' evaluation protocols on a dataset
=============  ========================================================================================

Everything runs offline: models are loaded from a local folder or the local HuggingFace/timm cache
(``HF_HUB_OFFLINE=1``, ``local_files_only=True``) and nothing is ever downloaded. A mistake a user can
make (missing file, unknown model, model not available offline, unknown method, bad target) is one line
on stderr and a non-zero exit status, never a traceback (``--debug`` shows it).
"""
from __future__ import annotations

import sys
from typing import Optional, Sequence

from ..version import __version__
from ..errors import RelpropError
from .common import (DEMO_NAME, EXIT_FAILED, EXIT_MODEL, EXIT_OK, EXIT_USAGE, CliError, fail, go_offline,
                     quiet)
from .loading import Loaded, load_model
from .parser import build_parser

__all__ = ["DEMO_NAME", "EXIT_FAILED", "EXIT_MODEL", "EXIT_OK", "EXIT_USAGE", "CliError", "Loaded", "build_parser",
           "load_model", "main"]


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line; returns the exit status (the console script exits with it)."""
    go_offline()
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    quiet(debug)
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        if args.version:
            print(f"relprop {__version__}")
            return EXIT_OK
        if not getattr(args, "command", None):
            parser.print_help()
            return EXIT_USAGE
        return args.func(args)
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
            fail(f"{type(err).__name__}: {first} (run with --debug for the traceback)")
        return EXIT_FAILED
