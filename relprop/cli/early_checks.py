"""The checks of every command's arguments that need no model, run by the dispatcher before torch is
imported, so that a mistake (a missing file, an unknown method, preset or option, a number out of
range, a malformed ``--grid`` or ``--unit``) is one line on stderr within a fraction of a second.

It imports nothing heavy: the names it checks against are :mod:`relprop.cli.known_names`.
"""
from __future__ import annotations

import difflib
import json
import os
from typing import Any, Dict, List, Optional, Sequence

from .common import CliError, check_images, parse_options, parse_value, read_texts
from .known_names import (DEMO_DEFAULT_METHOD, EXPLAIN_DEFAULT_METHOD, EXPLAIN_SETTINGS, METHOD_OPTIONS, PRESETS,
                          TUNE_METRICS, UNIT_ARITY)


def method_names(values: Sequence[str]) -> List[str]:
    """The names of repeated/comma-separated ``--method`` values, each once, in order."""
    return list(dict.fromkeys(n.strip() for v in values for n in v.split(",") if n.strip()))


def check_method_names(names: Sequence[str]) -> None:
    """Every name is a registered method (the message of relprop.methods.get_method, with a hint)."""
    for n in names:
        if n not in METHOD_OPTIONS:
            close = difflib.get_close_matches(n.lower(), list(METHOD_OPTIONS), n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise CliError(f"unknown method: {n!r} is not a method. Choices: {sorted(METHOD_OPTIONS)}.{hint} "
                           "Run 'relprop methods' for the table.")


def check_preset_name(name: Optional[str]) -> None:
    """``--preset``: a registered preset."""
    if name is not None and name not in PRESETS:
        close = difflib.get_close_matches(name.lower(), list(PRESETS), n=1)
        raise CliError(f"unknown --preset {name!r}: one of {', '.join(PRESETS)}"
                       + (f" (did you mean {close[0]!r}?)" if close else ""))


def check_option_keys(keys: Sequence[str], names: Sequence[str], flag: str = "--option") -> None:
    """Every key is an option of at least one of the methods ``names`` (or, for ``--option``, a
    setting of explain(): :data:`EXPLAIN_SETTINGS`); else an error listing the keys they take."""
    takes = sorted({o for n in names for o in METHOD_OPTIONS[n]})
    settings = list(EXPLAIN_SETTINGS) if flag == "--option" else []
    for key in keys:
        if key not in takes and key not in settings:
            close = difflib.get_close_matches(key, takes + settings, n=1)
            raise CliError(f"{flag} {key} is not an option of {', '.join(names)}; they take: "
                           + (", ".join(takes) or "no options")
                           + (f"; explain() settings: {', '.join(settings)}" if settings else "")
                           + (f" (did you mean {close[0]!r}?)" if close else ""))


def check_explain_arguments(args) -> List[str]:
    """The checks of ``relprop explain`` and ``relprop demo`` that need no model: files exist, inputs
    given, numbers in range, the methods, the preset and the ``--option`` keys known, ``--model`` given
    for images. Returns the texts to explain."""
    texts = read_texts(args)
    images = list(getattr(args, "image", []))
    check_images(images)
    if args.command == "explain":
        if images and texts:
            raise CliError("give --image or --text/--text-file, not both")
        if not images and not texts:
            raise CliError("nothing to explain: give --image PATH or --text TEXT (or --text-file PATH)")
        if images and not args.model:
            raise CliError("--model is required for images (a timm model name, a HuggingFace hub id or a local "
                           "folder)")
    if args.top < 0:
        raise CliError("--top must be >= 0")
    if args.batch_size < 1:
        raise CliError("--batch-size must be >= 1")
    if not 0 < args.percentile <= 100:
        raise CliError("--percentile must be in (0, 100]")
    options = parse_options(args.option)
    names = method_names(args.method)
    check_method_names(names)
    check_preset_name(args.preset)
    default = EXPLAIN_DEFAULT_METHOD if args.command == "explain" and getattr(args, "model", None) else \
        DEMO_DEFAULT_METHOD
    check_option_keys(list(options), names or [default])
    return texts


def _at_least(args, name: str, low: float, flag: Optional[str] = None) -> None:
    value = getattr(args, name)
    if value is not None and value < low:
        raise CliError(f"{flag or '--' + name.replace('_', '-')} must be >= {low:g}, not {value:g}")


def parse_grid(items: Sequence[str]) -> Dict[str, List[Any]]:
    """``["head_fusion=mean,max", "start_block=0,4"]`` -> ``{"head_fusion": ["mean", "max"],
    "start_block": [0, 4]}`` (ints, floats, true/false and none are converted)."""
    grid = {}
    for item in items:
        key, sep, values = item.partition("=")
        if not sep or not key or not values:
            raise CliError(f"--grid {item!r}: write OPTION=VALUE1,VALUE2,... (e.g. head_fusion=mean,max)")
        grid[key.replace("-", "_")] = [parse_value(v) for v in values.split(",")]
    return grid


def check_evaluate_arguments(args) -> None:
    """The checks of ``relprop evaluate`` that need no model: DATA exists, the methods, preset,
    ``--grid`` options and numbers are valid, ``--timm-kwargs`` is a JSON object."""
    if not os.path.exists(args.data):
        raise CliError(f"{args.data} is neither a folder nor a file")
    names = method_names(args.method or [])
    if "all" not in names:
        check_method_names(names)
    check_preset_name(args.preset)
    if args.grid:
        if len(names) != 1 or names == ["all"]:
            raise CliError(f"--grid tunes one method: give one --method (got {', '.join(names) or 'none'})")
        check_option_keys(list(parse_grid(args.grid)), names, "--grid")
    if args.metric is not None and args.metric not in TUNE_METRICS:
        raise CliError(f"--metric {args.metric!r} is not a choice: one of {', '.join(TUNE_METRICS)}")
    for name in ("batch_size", "perturbation_batch_size", "limit", "max_length"):
        _at_least(args, name, 1)
    if any(k < 1 for k in args.k):
        raise CliError("--k must be >= 1")
    if args.image_size is not None and (len(args.image_size) > 2 or min(args.image_size) < 1):
        raise CliError("--image-size takes N or H W, each >= 1")
    if args.steps is not None and (not args.steps or not all(0 <= s <= 1 for s in args.steps)):
        raise CliError("--steps takes fractions in [0, 1] (e.g. 0.1,0.2,0.5)")
    if (args.mean is None) != (args.std is None):
        raise CliError("give both --mean and --std, or neither")
    if args.timm_kwargs:
        try:
            kwargs = json.loads(args.timm_kwargs)
        except json.JSONDecodeError as err:
            raise CliError(f"--timm-kwargs is not JSON: {err}") from None
        if not isinstance(kwargs, dict):
            raise CliError("--timm-kwargs must be a JSON object, e.g. '{\"img_size\": 224}'")
    removal = str(args.removal)
    if removal not in ("pad", "mask", "delete") and not removal.lstrip("-").isdigit():
        raise CliError(f"--removal {removal!r} is not a choice: pad, mask, delete or a token id")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise CliError(f"--out {args.out} exists and is not a folder")


def check_unit(spec: str) -> None:
    """``--unit`` of ``relprop visualize``: KIND:N[:N...] with as many numbers as the kind takes
    (relprop.tools.activation_maximization.Unit.parse reads it)."""
    kind, _, rest = spec.strip().partition(":")
    nums = rest.split(":") if rest else []
    low, high = UNIT_ARITY.get(kind, (1, 0))
    if not (low <= len(nums) <= high and all(n.lstrip("-").isdigit() for n in nums)):
        raise CliError(f"--unit {spec!r} is not a unit: class:C, neuron:B:I[:T], channel:B:I, head:B:H, norm:B:T or "
                       "layer:B (B a block counted from the input, negative from the output)")


def check_visualize_arguments(args) -> None:
    """The checks of ``relprop visualize`` that need no model: the units' syntax and the numbers."""
    for spec in args.unit:
        check_unit(spec)
    for name, low in (("steps", 1), ("jitter", 0), ("blur", 0), ("blur_every", 1), ("tv", 0), ("length", 1),
                      ("l2", 0)):
        _at_least(args, name, low)
    if not args.lr > 0:
        raise CliError(f"--lr must be > 0, not {args.lr:g}")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise CliError(f"--out {args.out} exists and is not a folder")


#: command -> its checks before torch is imported
CHECKS = {"explain": check_explain_arguments, "demo": check_explain_arguments,
          "evaluate": check_evaluate_arguments, "visualize": check_visualize_arguments}


def check_arguments(args) -> None:
    """The early checks of ``args.command`` (none for a command without any)."""
    check = CHECKS.get(args.command)
    if check is not None:
        check(args)
