"""What every ``relprop`` command shares: exit statuses, one-line errors, offline mode, argument parsing.

It imports no relprop module and nothing heavy: the parser and the dispatcher (``relprop --help``)
import it before torch is ever imported."""
from __future__ import annotations

import argparse
import difflib
import logging
import os
import sys
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple

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


def quiet(debug: bool) -> None:
    if debug:
        return
    warnings.filterwarnings("ignore")
    # torch's pytree module logs a deprecation note when a library (torchao, imported by transformers when installed)
    # registers its enums; it would be printed on stderr before relprop's one-line error. The level is set on that
    # module's logger: importing torch resets the level of the "torch" logger itself
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
    try:
        from transformers.utils import logging as tlog
        tlog.set_verbosity_error()
        tlog.disable_progress_bar()
    except Exception:  # noqa: BLE001 - transformers missing: nothing to silence
        pass


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (and our exit status)."""

    def error(self, message):  # noqa: D401 - argparse API
        raise CliError(f"{message} (see '{self.prog} --help')")


def fail(message: str) -> None:
    """Print ``message`` as relprop's one-line error on stderr."""
    print(f"relprop: error: {message}", file=sys.stderr)


def root_cause(err: BaseException) -> str:
    """``"; caused by ..."`` naming the error at the bottom of ``err``'s chain when it differs from ``err``
    (transformers reports a failed import as "Could not import module 'BertModel'", the cause below it), with
    the fix where relprop knows it (a torchvision built for another torch); "" otherwise."""
    seen, cause = set(), err
    while True:
        nxt = cause.__cause__ or cause.__context__
        if nxt is None or id(nxt) in seen:
            break
        seen.add(id(nxt))
        cause = nxt
    if cause is err:
        return ""
    text = f"{type(cause).__name__}: {one_line(cause)}"
    if "torchvision" in str(cause):
        import torch
        text = (f"torchvision does not load ({text}): it was built for another torch than {torch.__version__}; "
                "install the torchvision of the same index and version as torch, or pip uninstall torchvision")
    return f"; caused by {text}"


def one_line(err: Exception) -> str:
    text = " ".join(str(err).split())
    return text[:300] + ("…" if len(text) > 300 else "")


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
    close = difflib.get_close_matches(spec.lower(), list(dict.fromkeys(list(names) + list(parts))), n=3)
    hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    shown = ", ".join(repr(str(labels[k])) for k in sorted(labels, key=int)[:8])
    more = f", ... ({n} in all)" if n > 8 else ""
    raise CliError(f"{what} '{spec}' is not a class of this model: give an index 0..{n - 1} or a label name "
                   f"({shown}{more}).{hint}")


def parse_option(text: str) -> Tuple[str, Any]:
    """``KEY=VALUE`` of ``--option``: the value as an int, a float, true/false, none, or else the string."""
    key, sep, value = text.partition("=")
    key = key.strip()
    if not sep or not key.isidentifier():
        raise CliError(f"--option {text!r} is not KEY=VALUE (e.g. --option start_block=4)")
    return key, parse_value(value)


def parse_value(text: str) -> Any:
    """A value of ``--option`` or ``--grid``: an int, a float, true/false, none (or null), or else the string."""
    value = text.strip()
    low = value.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


def parse_options(texts: Sequence[str]) -> Dict[str, Any]:
    """Every ``--option KEY=VALUE`` as a dict (a key given twice is an error)."""
    out: Dict[str, Any] = {}
    for text in texts:
        key, value = parse_option(text)
        if key in out:
            raise CliError(f"--option {key} is given twice")
        out[key] = value
    return out


def prepare_out(folder: Optional[str]) -> Optional[str]:
    if not folder:
        return None
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise CliError(f"--out {folder} exists and is not a folder")
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as err:
        raise CliError(f"cannot create --out folder {folder}: {err.strerror}") from None
    return folder


def chunks(n: int, size: int):
    for s in range(0, n, size):
        yield s, min(n, s + size)
