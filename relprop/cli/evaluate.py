"""``relprop evaluate``: evaluate explanation methods on a dataset from the command line.

::

    relprop evaluate DATA --model MODEL [--method M ...] --out DIR
    relprop evaluate DATA --model MODEL --method rollout --grid head_fusion=mean,max start_block=0,4 --out DIR

DATA is a folder of images with masks (``images/*.png|jpg``, ``masks/<same stem>.png``, optional
``labels.csv``) or a JSONL file of texts with rationales (``{"text": ..., "label": int,
"rationale": [...]}``); see :mod:`relprop.evaluation.datasets` for the formats. MODEL is a local
HuggingFace folder (or hub id) of an image or sequence classifier, or ``timm:NAME`` (with
``--checkpoint`` for the weights). DIR receives ``results.md``, ``results.csv`` (one row per
method), ``curves.csv`` and ``perturbation.png``; with ``--grid`` (one method), the settings ranked by
``--metric`` (:func:`relprop.evaluation.tune`) into ``tune.md`` and ``tune.csv``.

:func:`add_parser` registers it on ``relprop``'s command line (it sets ``func=run``);
``python -m relprop.cli.evaluate`` runs it standalone.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import sys
from typing import Any, Optional, Sequence

import torch

from ..errors import RelpropError
from ..evaluation import datasets, report, sharded
from ..evaluation.perturbation_protocol import DEFAULT_STEPS
from ..evaluation.tune import tune
from ..methods import table
from . import loading
from .common import EXIT_MODEL, CliError, fail
from .early_checks import check_evaluate_arguments, parse_grid
from .loading import parse_methods
from .parser import DEFAULT_METHODS, EVALUATE_DESCRIPTION, add_evaluate, configure_evaluate


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``evaluate`` on an ``argparse`` subparsers object (the arguments of
    :func:`relprop.cli.parser.add_evaluate`); it sets ``func=run``."""
    p = add_evaluate(subparsers)
    p.set_defaults(func=run)
    return p


def load_model(spec: Any, kind: str, checkpoint: Optional[str] = None, timm_kwargs: Optional[dict] = None):
    """An nn.Module as is; ``timm:NAME`` via ``timm.create_model``; else a HuggingFace image
    (``kind="vision"``) or sequence (``kind="text"``) classifier ``from_pretrained``. In eval mode."""
    if isinstance(spec, torch.nn.Module):
        return spec.eval()
    spec = str(spec)
    if spec.startswith("timm:") or spec.startswith("timm/"):
        import timm
        name = spec.split(":", 1)[1] if spec.startswith("timm:") else spec
        kw = dict(timm_kwargs or {})
        if checkpoint:
            kw.setdefault("pretrained", False)
            kw["checkpoint_path"] = checkpoint
        else:
            kw.setdefault("pretrained", True)
        return timm.create_model(name, **kw).eval()
    import transformers
    cls = transformers.AutoModelForImageClassification if kind == "vision" else \
        transformers.AutoModelForSequenceClassification
    return cls.from_pretrained(spec).eval()


def run(args: argparse.Namespace) -> int:
    """Run ``relprop evaluate``; returns the exit code (0 ok, 2 bad input)."""
    try:
        kind = "vision" if os.path.isdir(args.data) else "text"
        if kind == "text" and not os.path.isfile(args.data):
            raise RelpropError(f"{args.data} is neither a folder nor a file")
        timm_kwargs = json.loads(args.timm_kwargs) if args.timm_kwargs else None
        names = [n.strip() for v in (args.method or []) for n in v.split(",") if n.strip()]
        methods = sorted(table()) if "all" in names else (parse_methods(names, "") if names else list(DEFAULT_METHODS))
        loaded_tokenizer = None
        if isinstance(args.model, str) and not (args.checkpoint or timm_kwargs or args.model.startswith("timm:")):
            loaded = loading.load_model(args.model)  # the loader of relprop explain: same names, same errors
            model, loaded_tokenizer = loaded.model, loaded.tokenizer
        else:
            try:
                model = load_model(args.model, kind, args.checkpoint, timm_kwargs)
            except (OSError, RuntimeError, ValueError) as err:
                raise CliError(f"cannot load model {args.model}: {str(err).strip().splitlines()[0][:300]}",
                               EXIT_MODEL) from None
        device = sharded.device_for_rank(args.device)
        model = model.to(device)
        if kind == "vision":
            size = args.image_size or datasets.model_image_size(model)
            if size is not None and len(size) == 1:
                size = (size[0], size[0])
            if (args.mean is None) != (args.std is None):
                raise RelpropError("give both --mean and --std, or neither")
            norm = (args.mean, args.std) if args.mean is not None else datasets.model_normalization(model)
            data = datasets.ImageMaskFolder(args.data, image_size=size, normalization=norm, limit=args.limit)
            tokenizer = None
        else:
            from transformers import AutoTokenizer
            tok_spec = args.tokenizer or loaded_tokenizer or (
                args.model if isinstance(args.model, str) else
                getattr(getattr(model, "config", None), "_name_or_path", None))
            if not tok_spec:
                raise RelpropError("texts need a tokenizer: pass --tokenizer")
            tokenizer = AutoTokenizer.from_pretrained(tok_spec) if isinstance(tok_spec, str) else tok_spec
            data = datasets.RationaleJSONL(args.data, tokenizer, max_length=args.max_length, limit=args.limit)
        removal = int(args.removal) if str(args.removal).lstrip("-").isdigit() else args.removal
        baseline = None if args.baseline is None else (args.baseline[0] if len(args.baseline) == 1 else args.baseline)
        if args.grid:
            if len(methods) != 1:
                raise RelpropError(f"--grid tunes one method; got --method {' '.join(methods)}")
            metric = args.metric or ("positive_auc" if kind == "vision" else "aopc")
            result = tune(model, data, methods[0], parse_grid(args.grid), metric=metric, target=args.target,
                          batch_size=args.batch_size, steps=args.steps or DEFAULT_STEPS, baseline=baseline,
                          unit=args.unit, removal=removal, tokenizer=tokenizer,
                          perturbation_batch_size=args.perturbation_batch_size, rationale_k=args.k,
                          progress=not args.no_progress, preset=args.preset)
            return _write_tune(result, args.out)
        # batch by batch, resumable from --out, shared among the processes of torchrun
        settings = {k: v for k, v in vars(args).items() if k not in ("func", "out", "no_progress", "device")}
        result = sharded.evaluate_resumable(
            model, data, methods, args.out, settings=settings, target=args.target, batch_size=args.batch_size,
            steps=args.steps or DEFAULT_STEPS, baseline=baseline, unit=args.unit, removal=removal,
            tokenizer=tokenizer, perturbation_batch_size=args.perturbation_batch_size, rationale_k=args.k,
            aopc=not args.no_aopc, kendall=not args.no_kendall, progress=not args.no_progress, preset=args.preset)
        if result is None:  # another torchrun process than rank 0: rank 0 writes the report
            return 0
        paths = report.write_report(result, args.out)
    except CliError as e:  # as relprop explain: one line, the same exit statuses (3: the model cannot be loaded)
        fail(str(e))
        return e.code
    except (RelpropError, OSError, json.JSONDecodeError) as e:
        print(f"relprop evaluate: error: {e}", file=sys.stderr)
        return 2
    print(report.to_markdown_table(result))
    print("\nwrote " + ", ".join(paths.values()))
    return 0


def _write_tune(result, out: str) -> int:
    os.makedirs(out, exist_ok=True)
    table_md = result.to_markdown()
    with open(os.path.join(out, "tune.md"), "w") as f:
        f.write(f"# tune: {result.method}, {result.metric} ({'higher' if result.higher_is_better else 'lower'} "
                f"is better)\n\n{table_md}\n\nbest: {result.best}\n")
    keys = list(result.rows[0])
    with open(os.path.join(out, "tune.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(result.rows)
    print(table_md)
    print(f"\nbest: {result.best}\nwrote {os.path.join(out, 'tune.md')}, {os.path.join(out, 'tune.csv')}")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``relprop evaluate`` as a program of its own; returns the exit status."""
    parser = configure_evaluate(argparse.ArgumentParser(prog="relprop evaluate", description=EVALUATE_DESCRIPTION))
    args = parser.parse_args(argv)
    try:
        check_evaluate_arguments(args)  # as relprop evaluate does before importing torch
    except CliError as e:
        fail(str(e))
        return e.code
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
