"""Captured programs kept on disk, so that a new process does not export a model again.

A program (:mod:`relprop.graph.program`) is written after its export and read back by a later
process that explains a model of the same structure on inputs of the same structure. The key is
everything that decides the graph, and nothing else:

* the model: its class, its HuggingFace config (when it has one), every submodule's class and plain
  attributes (flags such as timm's ``fused_attn``), every parameter's and buffer's name, shape and
  dtype, and the source code of every module class it is built of — **never a weight's value**
  (weights are read from the model by name at every call, so a fine-tuned copy of a checkpoint
  shares its cached graph);
* the inputs: names, tensor dtypes, devices and ranks, plain values, the explained input, the
  parameters' dtypes and devices;
* the versions of torch, transformers, timm and relprop, and the source of relprop's export code.

A model with hooks, or whose code cannot be found, is not cached on disk. Files are written to a
temporary name and renamed, so concurrent processes never read half a file; a file that cannot be
read (truncated, corrupt, another format, another key) is deleted and the model exported again.
Deleting the directory at any time is safe.

The directory is ``$RELPROP_CACHE_DIR``, else ``$XDG_CACHE_HOME/relprop``, else
``~/.cache/relprop``; ``RELPROP_CACHE_DIR=off`` (or ``relprop.set_cache_dir(None)``) turns the disk
cache off.
"""
from __future__ import annotations

import hashlib
import inspect
import json
import os
import sys
import tempfile
import threading
from typing import Any, Dict, List, Optional

import torch

from ..errors import warn
from ..version import __version__
from . import serialize
from .program import Program

#: values of RELPROP_CACHE_DIR that turn the disk cache off
OFF = ("", "0", "off", "false", "no", "none")
_SUBDIR = f"graphs-v{serialize.FORMAT}"
_lock = threading.Lock()
_setting: Dict[str, Any] = {"directory": None, "set": False, "warned": False}
_source_hashes: Dict[tuple, str] = {}


def default_directory() -> Optional[str]:
    """The directory the environment names (None: the disk cache is off)."""
    env = os.environ.get("RELPROP_CACHE_DIR")
    if env is not None:
        return None if env.strip().lower() in OFF else os.path.expanduser(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "relprop")


def directory() -> Optional[str]:
    """The disk cache's directory in this process (None: off)."""
    return _setting["directory"] if _setting["set"] else default_directory()


def set_cache_dir(path: Optional[str]) -> Optional[str]:
    """Keep captured programs under ``path`` from now on in this process (``None`` or ``False``: keep
    none on disk; ``True``: the default directory again). Returns the previous directory.

    The cache holds graphs, never weights: a program is keyed by the model's structure, its code
    and the library versions, and it is safe to delete the directory at any time. The environment
    variable ``RELPROP_CACHE_DIR`` sets the same (``off`` turns it off)."""
    previous = directory()
    if path is True:
        _setting.update(set=False, directory=None)
    else:
        _setting.update(set=True, directory=os.path.expanduser(os.fspath(path)) if path else None)
    return previous


def clear() -> int:
    """Delete every program of the disk cache; returns how many files were removed."""
    root = directory()
    removed = 0
    if root is None or not os.path.isdir(os.path.join(root, _SUBDIR)):
        return 0
    for dirpath, _, files in os.walk(os.path.join(root, _SUBDIR)):
        for f in files:
            try:
                os.remove(os.path.join(dirpath, f))
                removed += 1
            except OSError:
                pass
    return removed


# ------------------------------------------------------------------------------------------ the key

def key_of(model: torch.nn.Module, kwargs: Dict[str, Any], primary: str, state: tuple) -> Optional[dict]:
    """Everything that decides the captured graph of ``model`` on inputs structured like ``kwargs``
    (see the module docstring), as plain data; None when the model cannot be keyed (hooks, code
    that cannot be found)."""
    modules = []
    sources = {}
    for name, m in model.named_modules():
        if _has_hooks(m):
            return None
        cls = type(m)
        qual = f"{cls.__module__}.{cls.__qualname__}"
        if qual not in sources:
            digest = _source_digest(cls)
            if digest is None:
                return None
            sources[qual] = digest
        modules.append([name, qual, _plain_attributes(m)])
    config = getattr(model, "config", None)
    cfg = None
    if config is not None and hasattr(config, "to_dict"):
        try:
            cfg = {k: v for k, v in config.to_dict().items() if k not in ("_name_or_path", "_commit_hash")}
            cfg["_attn_implementation"] = getattr(config, "_attn_implementation", None)
            cfg = json.loads(json.dumps(cfg, sort_keys=True, default=repr))
        except Exception:  # noqa: BLE001 - a config that cannot be written: not cached
            return None
    tensors = [[n, list(t.shape), str(t.dtype)] for n, t in
               (*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False))]
    inputs = []
    for k in sorted(kwargs):
        v = kwargs[k]
        if torch.is_tensor(v):
            inputs.append([k, "tensor", str(v.dtype), v.device.type, v.dim()])
        elif isinstance(v, (bool, int, float, str)) or v is None:
            inputs.append([k, "value", repr(v)])
        else:
            return None
    key = {
        "model": f"{type(model).__module__}.{type(model).__qualname__}", "config": cfg, "modules": modules,
        "sources": sources, "tensors": tensors, "inputs": inputs, "primary": primary,
        "state": [list(s) for s in state], "versions": _versions(),
    }
    return json.loads(json.dumps(key, sort_keys=True))  # plain lists and dicts, as a file gives them back


def _has_hooks(m: torch.nn.Module) -> bool:
    if "_hf_hook" in m.__dict__:  # accelerate's hooks replace forward (relprop.graph.dispatch)
        return True
    return any(getattr(m, attr, None) for attr in (
        "_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
        "_state_dict_hooks", "_load_state_dict_pre_hooks"))


def _plain_attributes(m: torch.nn.Module) -> list:
    out = []
    for k, v in sorted(vars(m).items()):
        if k.startswith("_") or k == "training":
            continue
        p = _plain(v)
        if p is not _SKIP:
            out.append([k, p])
    return out


_SKIP = object()


def _plain(v: Any, depth: int = 0):
    if isinstance(v, (bool, int, str)) or v is None:
        return v
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, (torch.dtype, torch.device)):
        return str(v)
    if isinstance(v, (list, tuple, torch.Size)) and depth < 3:
        items = [_plain(x, depth + 1) for x in v]
        return _SKIP if any(x is _SKIP for x in items) else items
    if isinstance(v, type) or inspect.isfunction(v) or inspect.isbuiltin(v):
        return f"{getattr(v, '__module__', '')}.{getattr(v, '__qualname__', repr(v))}"
    return _SKIP


def _source_digest(cls: type) -> Optional[str]:
    """sha256 of the source files of ``cls`` and its bases (None: a file cannot be read)."""
    digests = []
    for base in cls.__mro__:
        if base in (torch.nn.Module, object):
            break
        try:
            path = inspect.getsourcefile(base)
        except (TypeError, OSError):
            path = None
        if path is None:
            if base.__module__ == "builtins":
                continue
            return None
        try:
            st = os.stat(path)
        except OSError:
            return None
        k = (path, st.st_mtime_ns, st.st_size)
        if k not in _source_hashes:
            with open(path, "rb") as f:
                _source_hashes[k] = hashlib.sha256(f.read()).hexdigest()
        digests.append(_source_hashes[k])
    return hashlib.sha256("".join(digests).encode()).hexdigest()


def _versions() -> dict:
    here = os.path.dirname(os.path.abspath(__file__))
    code = hashlib.sha256()
    for name in ("export.py", "decompositions.py", "program.py", "serialize.py", "id_lookups.py", "complex_values.py"):
        with open(os.path.join(here, name), "rb") as f:
            code.update(f.read())
    out = {"torch": torch.__version__, "relprop": __version__, "export_code": code.hexdigest(),
           "python": sys.version.split()[0]}
    for lib in ("transformers", "timm"):
        mod = sys.modules.get(lib)
        out[lib] = getattr(mod, "__version__", None) if mod is not None else None
    return out


def _digest(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:32]


# ------------------------------------------------------------------------------------- load and store

def _folder(root: str, key: dict) -> str:
    return os.path.join(root, _SUBDIR, _digest(key))


def load(model: torch.nn.Module, kwargs: Dict[str, Any], primary: str, state: tuple,
         every_batch: bool = False) -> Optional[Program]:
    """A program of the disk cache that takes ``kwargs`` (None: the cache is off, or has none);
    ``every_batch``: only a program that takes every batch size."""
    root = directory()
    if root is None:
        return None
    key = key_of(model, kwargs, primary, state)
    if key is None:
        return None
    folder = _folder(root, key)
    try:
        files = sorted(os.listdir(folder))
    except OSError:
        return None
    for f in files:
        if not f.endswith(".pt"):
            continue
        path = os.path.join(folder, f)
        try:
            with open(path, "rb") as fh:
                stored_key, program = serialize.loads(fh.read())
            if stored_key != key:
                raise ValueError("another key")
        except Exception:  # noqa: BLE001 - any unreadable file is rebuilt, never trusted
            _remove(path)
            continue
        if program.match(kwargs, primary, state) is not None and (program.batch_dynamic or not every_batch):
            return program
    return None


def store(model: torch.nn.Module, kwargs: Dict[str, Any], program: Program) -> bool:
    """Write ``program`` to the disk cache; True when written (False: off, not keyable, not
    serializable, or the directory is not writable — then a warning, once per process)."""
    root = directory()
    if root is None:
        return False
    key = key_of(model, kwargs, program.primary, program.state)
    if key is None:
        return False
    try:
        data = serialize.dumps(program, key)
    except serialize.NotSerializable:
        return False
    folder = _folder(root, key)
    name = _digest([[k, p.tensor, [str(d) for d in p.dims], p.value] for k, p in sorted(program.patterns.items())])
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, os.path.join(folder, name + ".pt"))
        return True
    except OSError as e:
        with _lock:
            if not _setting["warned"]:
                _setting["warned"] = True
                warn(f"relprop could not write its graph cache under {root} ({e}); models will be captured "
                     "again in every new process. Set RELPROP_CACHE_DIR to a writable directory, or to 'off'")
        return False


def files() -> List[str]:
    """The program files in the disk cache."""
    root = directory()
    out = []
    if root is not None:
        for dirpath, _, names in os.walk(os.path.join(root, _SUBDIR)):
            out.extend(os.path.join(dirpath, f) for f in names if f.endswith(".pt"))
    return sorted(out)


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass
