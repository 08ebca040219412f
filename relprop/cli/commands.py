"""The ``relprop`` commands ``methods``, ``explain`` and ``demo``."""
from __future__ import annotations

import json
import sys
from typing import Dict, List

from ..tools import demo
from ..api import coverage
from ..methods import get_method, table
from .common import EXIT_FAILED, EXIT_OK, CliError, one_line
from .early_checks import check_explain_arguments
from .images import explain_images
from .loading import (Loaded, apply_settings, check_preset, load_demo, load_model, method_label, method_options,
                      parse_methods)
from .texts import explain_texts


def methods_rows() -> List[Dict]:
    return [{"name": k, **v} for k, v in table().items()]


def methods_markdown() -> str:
    """The methods table as markdown."""
    lines = ["| method | what it computes | class-specific | signed | reference |",
             "|---|---|---|---|---|"]
    for r in methods_rows():
        lines.append(f"| `{r['name']}` | {r['description']} | {'yes' if r['class_specific'] else 'no'} | "
                     f"{'yes' if r['signed'] else 'no'} | {r['reference']} |")
    return "\n".join(lines)


def cmd_methods(args) -> int:
    rows = methods_rows()
    if args.format == "json":
        print(json.dumps(rows, indent=1, ensure_ascii=False))
        return EXIT_OK
    if args.format == "markdown":
        print(methods_markdown())
        return EXIT_OK
    from rich.console import Console
    from rich.table import Table
    table = Table(title="relprop explanation methods (relprop explain --method NAME)", show_lines=False,
                  title_justify="left")
    table.add_column("method", style="bold", no_wrap=True)
    table.add_column("class-specific", justify="center")
    table.add_column("signed", justify="center")
    table.add_column("what it computes")
    table.add_column("reference", style="dim")
    for r in rows:
        table.add_row(r["name"], "yes" if r["class_specific"] else "no", "yes" if r["signed"] else "no",
                      r["description"], r["reference"])
    Console(width=None if sys.stdout.isatty() else 160).print(table)
    return EXIT_OK


def cmd_explain(args) -> int:
    texts = check_explain_arguments(args)  # (main() checked before importing torch; a direct call checks here)
    if args.method:
        parse_methods(args.method, "")  # unknown names fail before the model is loaded
    check_preset(args.preset)
    loaded = load_model(args.model) if args.model else load_demo()
    if loaded.kind == "image" and texts:
        raise CliError(f"{loaded.name} is an image classifier: give --image, not --text")
    if loaded.kind == "text" and args.image:
        raise CliError(f"{loaded.name} is a text classifier: give --text, not --image")
    names = parse_methods(args.method, loaded.default_method)
    apply_settings(loaded, names, args)
    if args.coverage:
        print_coverage(loaded, args.image, texts)
    if loaded.kind == "image":
        return explain_images(loaded, args.image, names, args)
    counterfactual = args.counterfactual
    return explain_texts(loaded, texts, names, args, counterfactual=counterfactual, title="relprop explain")


def print_coverage(loaded: Loaded, images: List[str], texts: List[str]) -> None:
    """``--coverage``: the coverage report (relprop.coverage) of the model on the first input; the
    explanation follows. Ops with no rule end the command with exit status 1 after the report."""
    import torch
    from PIL import Image, UnidentifiedImageError
    if images:
        try:
            with Image.open(images[0]) as im:
                inputs = torch.stack([loaded.preprocess(im.convert("RGB"))])
        except (UnidentifiedImageError, OSError) as err:
            why = getattr(err, "strerror", None) or one_line(err)
            raise CliError(f"cannot read image {images[0]}: {why}") from None
    else:
        enc = loaded.tokenizer(texts[:1], padding=True, truncation=True, return_tensors="pt")
        inputs = {k: v for k, v in enc.items() if k in ("input_ids", "attention_mask", "token_type_ids")}
    report = coverage(loaded.model, inputs)
    print(report)
    print()
    if not report.complete:
        ops = sorted({o.op for o in report.missing})
        raise CliError(f"{len(report.missing)} op(s) on the relevance path have no rule: {', '.join(ops)} "
                       "(see the report above)", EXIT_FAILED)


def _described(info, loaded) -> str:
    """The method in one sentence for the demo's text model: its own for the demo's default, else the
    registry's description and reference."""
    preset = loaded.preset or loaded.default_options.get("preset")
    return demo.DESCRIBED.get((info.name, preset)) or f"{info.description} ({info.reference})"


def cmd_demo(args) -> int:
    texts = check_explain_arguments(args) or list(demo.DEFAULT_TEXTS)
    if args.method:
        parse_methods(args.method, "")
    check_preset(args.preset)
    loaded = load_demo(args.labels)
    names = parse_methods(args.method, loaded.default_method)
    apply_settings(loaded, names, args)
    infos = [get_method(n) for n in names]
    labels = list(loaded.labels.values())
    header = [
        "[bold]relprop demo[/bold]: all-MiniLM-L6-v2 (the real pretrained checkpoint, offline) as a zero-shot "
        "classifier",
        f"  labels: {', '.join(labels)}",
        f"  score of a label = {demo.DEFAULT_SCALE:g} × cosine(sentence embedding, embedding of the label's "
        "description)",
    ] + [f"  method: [bold]{i.name}[/bold]" + method_label(i.name, loaded)[len(i.name):]
         + f" — {_described(i, loaded)}"
         + (" — rows of all tokens (query='mean'), as the model mean-pools" if "query" in
            method_options(i.name, loaded.options) else "")
         + (f"\n  why this method: {demo.WHY}" if i.name == demo.DEFAULT_METHOD and loaded.preset in (
             None, loaded.default_options.get("preset")) else "") for i in infos]
    cf = None if args.target is not None and len(labels) < 2 else "second"
    if len(labels) < 2:
        cf = None
    return explain_texts(loaded, texts, names, args, counterfactual=cf, title="relprop demo", header=header)
