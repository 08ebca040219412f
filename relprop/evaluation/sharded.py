"""Evaluation at scale: split a dataset across processes, save per-batch results, resume.

:func:`evaluate_resumable` runs :func:`relprop.evaluation.runner.evaluate` one batch at a time and
pickles each batch's :class:`EvaluationResult` into ``OUT/partial/batch-NNNNNN.pkl`` (written to a
temporary name, then renamed, so a file is either complete or absent). Under ``torchrun``
(``torch.distributed``; gloo on CPU, NCCL on GPUs) process ``rank`` of ``world`` takes the batches
``rank, rank + world, ...``; after a barrier, rank 0 concatenates every batch's per-sample results in
dataset order (:func:`merge`), so the table is identical to a single-process run: the same batches
are explained in the same way, only by different processes. A run that was interrupted picks up
from its output folder: finished batches are read back, the others computed. ``manifest.json``
records the evaluation's settings; resuming with other settings is refused.

::

    torchrun --nproc_per_node 2 -m relprop evaluate DATA --model MODEL --out DIR
"""
from __future__ import annotations

import json
import os
import pickle
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ..errors import RelpropError
from ..graph import progress_line
from .conservation import ConservationReport
from .perturbation_protocol import PerturbationResult
from .runner import EvaluationResult, TextScores, _batches, evaluate
from .segmentation import SegmentationResult
from .text_metrics import FaithfulnessResult

PARTIAL = "partial"
MANIFEST = "manifest.json"


def process_group(device: Optional[torch.device] = None) -> Tuple[int, int]:
    """(rank, world size): from an initialized ``torch.distributed`` group, or, under ``torchrun``
    (``WORLD_SIZE`` > 1 in the environment), from one this call initializes (NCCL for CUDA
    devices, else gloo); (0, 1) for a plain single process."""
    import torch.distributed as dist
    if not dist.is_available():
        return 0, 1
    if not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        backend = "nccl" if device is not None and torch.device(device).type == "cuda" else "gloo"
        dist.init_process_group(backend)
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def device_for_rank(requested: Optional[str]) -> torch.device:
    """The device of this process: ``requested`` (default cuda if available, else cpu); a bare
    ``cuda`` becomes ``cuda:LOCAL_RANK`` under torchrun, one GPU per process."""
    name = requested or ("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and "LOCAL_RANK" in os.environ:
        name = f"cuda:{int(os.environ['LOCAL_RANK'])}"
    return torch.device(name)


def _barrier():
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _check_manifest(folder: str, settings: Dict[str, Any], rank: int) -> None:
    path = os.path.join(folder, MANIFEST)
    wanted = json.loads(json.dumps(settings, default=str))
    if rank == 0 and not os.path.exists(path):
        _atomic_write(path, json.dumps(wanted, indent=1, sort_keys=True).encode())
    _barrier()
    with open(path) as f:
        found = json.load(f)
    if found != wanted:
        diff = sorted(k for k in set(found) | set(wanted) if found.get(k) != wanted.get(k))
        raise RelpropError(f"{folder} holds partial results of another evaluation (settings that differ: {diff}); "
                           "use another --out, or delete that folder to start over")


def _atomic_write(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def evaluate_resumable(model: torch.nn.Module, data: Any, methods: Sequence[str], out: str, *,
                       batch_size: int = 8, settings: Optional[Dict[str, Any]] = None, progress: Optional[bool] = None,
                       **options) -> Optional[EvaluationResult]:
    """:func:`relprop.evaluation.evaluate` of ``data``, batch by batch, resumable from ``out``
    and shared among the processes of a ``torch.distributed`` group.

    Parameters
    ----------
    model, data, methods, batch_size, **options : as for :func:`relprop.evaluation.evaluate`.
    out : the output folder; per-batch results go to ``out/partial``.
    settings : what identifies this evaluation (JSON-serializable; written to the manifest and
        compared when resuming). Default: the methods, batch size and options.
    progress : a progress bar of this process's batches: None (default) on a terminal only (or as
        ``RELPROP_PROGRESS`` says), True always, False never.

    Returns
    -------
    The merged :class:`EvaluationResult` on rank 0 (the only process in a single-process run),
    None on the other ranks.
    """
    from tqdm.auto import tqdm

    rank, world = process_group(next((p.device for p in model.parameters()), None))
    folder = os.path.join(out, PARTIAL)
    os.makedirs(folder, exist_ok=True)
    if settings is None:
        settings = {"methods": list(methods), "batch_size": batch_size,
                    **{k: v for k, v in options.items() if k != "tokenizer"}}
    _check_manifest(folder, settings, rank)
    # what evaluate() reads from a dataset object, passed on with each batch dict
    for key in ("normalization", "tokenizer"):
        if options.get(key) is None and getattr(data, key, None) is not None:
            options[key] = getattr(data, key)
    batches, _ = _batches(data, batch_size)
    count = resumed = 0
    bar = tqdm(desc=f"relprop evaluate [{rank + 1}/{world}]", unit="batch", disable=not progress_line.wanted(progress))
    try:
        for i, batch in enumerate(batches):
            count += 1
            if i % world != rank:
                continue
            path = os.path.join(folder, f"batch-{i:06d}.pkl")
            if os.path.exists(path):
                resumed += 1
            else:
                result = evaluate(model, batch, methods, batch_size=batch_size, progress=False, **options)
                _atomic_write(path, pickle.dumps(result))
            bar.update(1)
    finally:
        bar.close()
    if resumed:
        print(f"relprop evaluate: process {rank}: {resumed} batch(es) read back from {folder}", flush=True)
    _barrier()
    if rank != 0:
        return None
    results = []
    for i in range(count):
        path = os.path.join(folder, f"batch-{i:06d}.pkl")
        if not os.path.exists(path):
            raise RelpropError(f"batch {i} has no result in {folder}; did a process fail? Run again to resume")
        with open(path, "rb") as f:
            results.append(pickle.load(f))
    if not results:
        raise RelpropError("the data holds no batch")
    return merge(results)


def merge(results: List[EvaluationResult]) -> EvaluationResult:
    """One :class:`EvaluationResult` from the results of consecutive batches (in dataset order):
    per-sample arrays concatenated, exactly as :func:`evaluate` concatenates its batches."""
    first = results[0]
    methods = first.methods
    for r in results[1:]:
        if r.methods != methods or r.modality != first.modality:
            raise RelpropError("cannot merge evaluations of different methods or modalities")
    perturbation = {m: {mode: PerturbationResult.concat([r.perturbation[m][mode] for r in results])
                        for mode in first.perturbation[m]} for m in first.perturbation}
    segmentation = {}
    for m in methods:
        parts = [r.segmentation[m] for r in results if m in r.segmentation]
        if parts:
            segmentation[m] = SegmentationResult.concat(parts)
    text = {m: _merge_text([r.text[m] for r in results if m in r.text]) for m in methods if m in first.text}
    conservation = {}
    for r in results:
        for p, rep in r.conservation.items():
            conservation.setdefault(p, []).append(rep)
    presets: Dict[str, Optional[str]] = {}
    for r in results:
        for m, p in r.presets.items():
            presets[m] = presets.get(m) or p
    return EvaluationResult(methods=methods, modality=first.modality, samples=sum(r.samples for r in results),
                            perturbation=perturbation, segmentation=segmentation, text=text,
                            conservation={p: ConservationReport.concat(v) for p, v in conservation.items()},
                            presets=presets, settings=first.settings)


def _merge_text(parts: List[TextScores]) -> TextScores:
    def cat(arrays):
        arrays = [a for a in arrays if a is not None]
        return np.concatenate(arrays) if arrays else None

    def faith(items):
        items = [x for x in items if x is not None]
        return FaithfulnessResult.concat(items) if items else None

    ks = sorted({k for p in parts for k in p.token_f1})
    return TextScores(token_f1={k: cat([p.token_f1.get(k) for p in parts]) for k in ks},
                      precision_at_k={k: cat([p.precision_at_k.get(k) for p in parts]) for k in ks},
                      aopc=faith([p.aopc for p in parts]), log_odds=faith([p.log_odds for p in parts]),
                      kendall_tau=cat([p.kendall_tau for p in parts]))
