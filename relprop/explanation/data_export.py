"""An :class:`~relprop.explanation.Explanation` as data: one sample of a batch (``exp[i]``), a
JSON-serialisable dict, a JSON file, an ``.npz`` archive (and back) and a tidy table.

Position names: the token strings when they are known (``tokens=``, or the explanation's own ``tokens``
when it remembers them), ``"token j"`` otherwise; for images ``"patch (r, c)"`` on the patch grid.
Target names: ``labels[t]`` (a list, or a model's ``config.id2label``) when given or remembered,
``"class t"`` otherwise.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Dict, List, Optional, Sequence

import torch

from ..engine.trace import NotKept
from ..errors import InputError
from ..viz.names import target_name as _name_of

#: BlockRecord fields that are per model, not per sample (never sliced)
_PER_MODEL = {"out_proj_weight"}
#: Explanation fields that are Python lists with one entry per sample
PER_SAMPLE_LISTS = ("tokens", "target_label", "prompt_tokens")
#: format version of to_dict / save_npz
FORMAT = 1


def batch_size(exp) -> int:
    return int(exp.scores.shape[0])


def _take(x: Any, n: int, idx):
    """``x`` with its batch axis (the first, of size ``n``) indexed by ``idx`` (a slice), recursively
    through lists, tuples, dicts and dataclasses (block records, conservation)."""
    if torch.is_tensor(x):
        return x[idx] if x.dim() >= 1 and x.shape[0] == n else x
    if type(x) is NotKept or x is None or isinstance(x, (str, int, float, bool)):
        return x
    if isinstance(x, list):
        return [_take(v, n, idx) for v in x]
    if isinstance(x, tuple) and not hasattr(x, "_fields"):
        return tuple(_take(v, n, idx) for v in x)
    if dataclasses.is_dataclass(x) and not isinstance(x, type) and not hasattr(x, "keys"):
        return dataclasses.replace(x, **{f.name: _take(getattr(x, f.name), n, idx) for f in dataclasses.fields(x)
                                         if f.init and f.name not in _PER_MODEL})
    if hasattr(x, "keys") and hasattr(x, "items"):  # a dict or a transformers ModelOutput
        taken = {k: _take(v, n, idx) for k, v in x.items()}
        try:
            return type(x)(**taken)
        except TypeError:
            return taken
    return x


def select(exp, key):
    """``exp[key]``: sample ``key`` (an int, negative counting from the end) as an explanation of a batch
    of one, or the samples of a slice; every per-sample field (scores, map, mask, targets, block records,
    per-head maps, ...) is indexed alike."""
    n = batch_size(exp)
    if isinstance(key, bool) or not isinstance(key, (int, slice)) and not hasattr(key, "__index__"):
        raise TypeError(f"an Explanation is indexed by a sample number or a slice, not {type(key).__name__}")
    if isinstance(key, slice):
        idx = key
    else:
        i = int(key)
        if not -n <= i < n:
            raise IndexError(f"sample {i} out of range: the explanation has {n} sample{'s' * (n != 1)} "
                             f"(valid: {-n} to {n - 1})")
        i %= n
        idx = slice(i, i + 1)
    values = {f.name: _take(object.__getattribute__(exp, f.name), n, idx) for f in dataclasses.fields(exp)}
    values["notes"] = list(exp.notes)
    for name in PER_SAMPLE_LISTS:  # lists of one entry per sample: indexed, not walked into
        v = object.__getattribute__(exp, name)
        if isinstance(v, list) and len(v) == n:
            values[name] = v[idx]
    return dataclasses.replace(exp, **values)


def _numbers(x) -> Optional[list]:
    if x is None:
        return None
    return x.detach().cpu().tolist() if torch.is_tensor(x) else list(x)


def _remembered(exp, name: str):
    """A field the explanation may carry when it came from a pipeline (tokens, labels), else None."""
    return getattr(exp, name, None)


def token_rows(exp, tokens: Optional[Sequence] = None) -> Optional[List[List[str]]]:
    """Per sample, the token strings given or remembered (None if neither); one list for one sample."""
    rows = tokens if tokens is not None else _remembered(exp, "tokens")
    if rows is None:
        return None
    rows = list(rows)
    if rows and isinstance(rows[0], str):
        rows = [rows]
    if len(rows) != batch_size(exp):
        raise InputError(f"tokens has {len(rows)} samples, the explanation {batch_size(exp)}")
    return [[str(t) for t in r] for r in rows]


def position_names(exp, index: int, tokens: Optional[Sequence] = None) -> List[str]:
    """The names of sample ``index``'s positions: its token strings, ``"token j"`` without them, or
    ``"patch (r, c)"`` on an image's patch grid."""
    n = int(exp.scores.shape[-1])
    if exp.grid is not None and exp.modality == "vision":
        gw = exp.grid[1]
        return [f"patch ({j // gw}, {j % gw})" for j in range(n)]
    rows = token_rows(exp, tokens)
    if rows is not None:
        if len(rows[index]) != n:
            raise InputError(f"{len(rows[index])} token strings for {n} scores in sample {index}")
        return rows[index]
    return [f"token {j}" for j in range(n)]


def target_name(exp, index: int, labels=None) -> Optional[str]:
    """The name of sample ``index``'s explained class (``labels`` or the remembered ones, else
    ``"class t"``), or None when the target was not a class (a callable)."""
    return _name_of(exp, index, labels)


def to_dict(exp, *, tokens: Optional[Sequence] = None, labels=None, include_map: bool = False) -> Dict[str, Any]:
    """The explanation as plain Python (JSON-serialisable): its method, preset and kind, and per sample
    the target, its name and score, the position names, the scores and the mask (and the image map with
    ``include_map=True``)."""
    samples = []
    for i in range(batch_size(exp)):
        sample = {"index": i,
                  "target": None if exp.target is None else int(exp.target[i]),
                  "target_label": target_name(exp, i, labels),
                  "target_score": float(exp.target_scores[i]) if exp.target_scores is not None else None,
                  "positions": position_names(exp, i, tokens),
                  "scores": _numbers(exp.scores[i].float()),
                  "mask": None if exp.mask is None else _numbers(exp.mask[i].bool())}
        if include_map and exp.map is not None:
            sample["map"] = _numbers(exp.map[i].float())
        samples.append(sample)
    return {"format": FORMAT, "method": exp.method, "preset": exp.preset, "modality": exp.modality,
            "signed": bool(exp.signed), "class_specific": bool(exp.class_specific),
            "grid": None if exp.grid is None else list(exp.grid), "samples": samples}


def to_json(exp, path: Optional[str] = None, *, tokens: Optional[Sequence] = None, labels=None,
            include_map: bool = False, indent: Optional[int] = None) -> str:
    """:func:`to_dict` as JSON: the string, or, with ``path``, written there (``path`` returned)."""
    text = json.dumps(to_dict(exp, tokens=tokens, labels=labels, include_map=include_map), indent=indent)
    if path is None:
        return text
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return str(path)


def save_npz(exp, path: str, *, tokens: Optional[Sequence] = None, labels=None) -> str:
    """Write the explanation's arrays to a compressed ``.npz``: ``scores``, ``mask``, ``target_scores``,
    and where present ``map``, ``target``; ``meta`` holds :func:`to_dict` without the scores (a JSON
    string). Read it back with ``Explanation.load_npz(path)``, or ``numpy.load(path)["scores"]``."""
    import numpy as np
    meta = to_dict(exp, tokens=tokens, labels=labels)
    for s in meta["samples"]:
        s.pop("scores"), s.pop("mask")
    arrays = {"scores": exp.scores.detach().float().cpu().numpy(),
              "target_scores": exp.target_scores.detach().float().cpu().numpy(),
              "meta": np.array(json.dumps(meta))}
    if exp.mask is not None:
        arrays["mask"] = exp.mask.detach().bool().cpu().numpy()
    if exp.map is not None:
        arrays["map"] = exp.map.detach().float().cpu().numpy()
    if exp.target is not None:
        arrays["target"] = exp.target.detach().cpu().numpy()
    with open(path, "wb") as f:
        np.savez_compressed(f, **arrays)
    return str(path)


def npz_fields(path: str) -> Dict[str, Any]:
    """The fields of the :class:`Explanation` saved by :func:`save_npz` (scores, mask, map, targets and
    what ``meta`` names; no block records), for ``Explanation(**fields)``: see ``Explanation.load_npz``.
    The position names and target names that were saved are in ``json.loads(numpy.load(path)["meta"][()])``."""
    import numpy as np
    with np.load(path, allow_pickle=False) as z:
        if "meta" not in z.files:
            raise InputError(f"{path} is not an explanation saved by relprop (no 'meta' entry)")
        meta = json.loads(str(z["meta"][()]))
        if meta.get("format") != FORMAT:
            raise InputError(f"{path} is not an explanation saved by relprop (format {meta.get('format')!r})")
        get = {k: torch.from_numpy(np.array(z[k])) for k in z.files if k != "meta"}
    return dict(method=meta["method"], scores=get["scores"], map=get.get("map"), mask=get.get("mask"),
                matrix=None, blocks=[], target=get.get("target"), target_scores=get["target_scores"],
                conservation=None, input_relevance=None, logits=None, preset=meta["preset"],
                modality=meta["modality"], grid=None if meta["grid"] is None else tuple(meta["grid"]),
                signed=meta["signed"], class_specific=meta["class_specific"], notes=[f"loaded from {path}"])


def to_table(exp, *, tokens: Optional[Sequence] = None, labels=None):
    """A tidy table, one row per sample and position: ``sample``, ``position``, ``name`` (the token string,
    ``"token j"`` or ``"patch (r, c)"``), ``score``, ``mask`` (False at padding and special tokens),
    ``target``, ``target_label``, ``method``. A ``pandas.DataFrame`` when pandas is installed, else a
    list of dicts (``pandas.DataFrame(rows)`` makes the same frame)."""
    d = to_dict(exp, tokens=tokens, labels=labels)
    rows = []
    for s in d["samples"]:
        mask = s["mask"] or [True] * len(s["scores"])
        for j, (name, score, m) in enumerate(zip(s["positions"], s["scores"], mask)):
            rows.append({"sample": s["index"], "position": j, "name": name, "score": score, "mask": m,
                         "target": s["target"], "target_label": s["target_label"], "method": d["method"]})
    try:
        import pandas
    except ImportError:
        return rows
    return pandas.DataFrame(rows)
