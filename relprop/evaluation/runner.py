"""Evaluate explanation methods over a dataset: every metric of :mod:`relprop.evaluation` for every
method, with one :func:`relprop.explain` call per batch for all the methods (they share the forward
pass and the relevance walk).

Per batch: explain the target class (the predicted class, or the dataset's label with
``target="label"``), then per method run the perturbation tests (both modes), score the maps against
the masks (images with masks), the tokens against the rationales (texts with rationales), AOPC and
log-odds and Kendall-τ against a second explanation for the runner-up class (texts), and collect the
conservation of each relevance preset. Everything is per sample; the only statistics across samples
are the dataset averages in the final table.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Dict, Iterable, List, Optional, Sequence

import numpy as np
import torch

from ..api import explain
from ..errors import InputError
from ..graph.capture import CACHE
from . import _util
from .conservation import ConservationReport, conservation_report
from .config import EvaluationConfig
from .perturbation_protocol import PerturbationResult, perturbation_curve
from .report import summary_rows, to_markdown_table
from .segmentation import SegmentationResult, segmentation_scores
from .text_metrics import FaithfulnessResult, aopc as _aopc, kendall_tau, log_odds as _log_odds
from .text_metrics import precision_at_k, token_f1


@dataclasses.dataclass
class TextScores:
    """Text metrics of one method, per sample ([texts] arrays; NaN where undefined)."""

    token_f1: Dict[int, np.ndarray]
    precision_at_k: Dict[int, np.ndarray]
    aopc: Optional[FaithfulnessResult]
    log_odds: Optional[FaithfulnessResult]
    kendall_tau: Optional[np.ndarray]


@dataclasses.dataclass
class EvaluationResult:
    """Everything ``evaluate`` measured.

    Attributes
    ----------
    methods
        the methods, in the order asked.
    modality
        ``"vision"`` or ``"text"``.
    samples
        how many samples were evaluated.
    perturbation
        method -> mode -> ``PerturbationResult``.
    segmentation
        method -> ``SegmentationResult`` (images with masks).
    text
        method -> ``TextScores`` (texts).
    conservation
        relevance preset -> ``ConservationReport`` (methods that propagate relevance).
    presets
        method -> the preset its relevance came from (None: no relevance walk).
    settings
        the evaluation's settings, for the report.
    """

    methods: List[str]
    modality: str
    samples: int
    perturbation: Dict[str, Dict[str, PerturbationResult]]
    segmentation: Dict[str, SegmentationResult]
    text: Dict[str, TextScores]
    conservation: Dict[str, ConservationReport]
    presets: Dict[str, Optional[str]]
    settings: Dict[str, Any]

    def table(self) -> List[Dict[str, Any]]:
        """One row per method: the dataset averages (see ``relprop.evaluation.report.summary_rows``)."""
        return summary_rows(self)

    def __repr__(self) -> str:
        return f"EvaluationResult({self.modality}, samples={self.samples})\n{to_markdown_table(self)}"


def evaluate(model: torch.nn.Module, data: Any, methods: Sequence[str] = ("transformer_attribution",),
             config: Optional[EvaluationConfig] = None, **settings) -> EvaluationResult:
    """Evaluate ``methods`` on ``data`` with the papers' protocols.

    Parameters
    ----------
    model
        the classifier (eval mode), on the device the evaluation runs on; not modified.
    data
        an ``ImageMaskFolder`` / ``RationaleJSONL`` (or anything with
        ``batches(batch_size)``), an iterable of batch dicts, or one batch dict. A batch dict holds
        ``inputs`` and optionally ``labels`` [batch], ``masks`` [batch, H, W], ``rationales``
        [batch, positions] and ``special_tokens_mask`` [batch, positions].
    methods
        explanation method names (``relprop.methods()``).
    config
        an ``relprop.evaluation.EvaluationConfig`` (default: the papers' settings).
    **settings
        fields of ``relprop.evaluation.EvaluationConfig`` replacing those of ``config``
        (``target="label"``, ``batch_size=16``, ``steps=[...]``, ...); an unknown one is an error.

    Returns
    -------
    EvaluationResult
    """
    from tqdm.auto import tqdm  # optional dependency (relprop[eval])

    cfg = EvaluationConfig.of(config, **settings)
    target, batch_size, modes, steps = cfg.target, cfg.batch_size, cfg.modes, cfg.steps
    baseline, unit, removal, rationale_k = cfg.baseline, cfg.unit, cfg.removal, cfg.rationale_k
    aopc_removal, log_odds_removal, aopc_steps = cfg.aopc_removal, cfg.log_odds_removal, cfg.aopc_steps
    preset = cfg.preset
    perturbation, segmentation, aopc, kendall, conservation = (cfg.perturbation, cfg.segmentation, cfg.aopc,
                                                               cfg.kendall, cfg.conservation)
    methods = [methods] if isinstance(methods, str) else list(methods)
    if not methods:
        raise InputError("no method to evaluate")
    normalization = cfg.normalization if cfg.normalization is not None else getattr(data, "normalization", None)
    tokenizer = cfg.tokenizer if cfg.tokenizer is not None else getattr(data, "tokenizer", None)
    pbs = int(cfg.perturbation_batch_size or 64)
    options = dict(cfg.explain_options)
    device = _util.model_device(model)
    batches, total = _batches(data, batch_size)

    curves: Dict[str, Dict[str, List[PerturbationResult]]] = {m: {mode: [] for mode in modes} for m in methods}
    segs: Dict[str, List[SegmentationResult]] = {m: [] for m in methods}
    f1s = {m: {k: [] for k in rationale_k} for m in methods}
    precs = {m: {k: [] for k in rationale_k} for m in methods}
    aopcs: Dict[str, List[FaithfulnessResult]] = {m: [] for m in methods}
    lodds: Dict[str, List[FaithfulnessResult]] = {m: [] for m in methods}
    taus: Dict[str, List[np.ndarray]] = {m: [] for m in methods}
    cons: Dict[str, List[ConservationReport]] = {}
    presets: Dict[str, Optional[str]] = {}
    modality, samples = None, 0
    has_masks = has_rationales = False

    bar = tqdm(total=total, unit="sample", desc="relprop evaluate", disable=not cfg.progress)
    captures = (CACHE.captures, CACHE.specializations)
    sizes = set()
    try:
        for batch in batches:
            inputs = _to_device(batch["inputs"], device)
            kwargs, primary = _util.bind(model, inputs)
            kind = _util.modality_of(kwargs[primary])
            if modality is None:
                modality = kind
            elif kind != modality:
                raise InputError("a dataset mixes images and texts")
            n = kwargs[primary].shape[0]
            sizes.add(tuple(kwargs[primary].shape[1:]))
            labels = batch.get("labels")
            if target == "label":
                if labels is None:
                    raise InputError("target='label' needs labels in the data (labels.csv, or \"label\" in each line)")
                labels = torch.as_tensor(labels).long().to(device)
            special = batch.get("special_tokens_mask")
            extra = dict(options)
            if kind == "text" and special is not None:
                extra["special_tokens_mask"] = torch.as_tensor(special).bool().to(device)
            exps = explain(model, inputs, target=labels if target == "label" else None, method=methods,
                           preset=preset, **extra)
            explained = exps[0].target
            common = dict(baseline=baseline, normalization=normalization, unit=unit, removal=removal,
                          tokenizer=tokenizer, batch_size=pbs)
            others = None
            if kind == "text" and kendall:
                logits = exps[0].logits.detach().float()
                masked = logits.scatter(1, explained[:, None].to(logits.device), float("-inf"))
                runner_up = masked.argmax(1)
                others = explain(model, inputs, target=runner_up, method=methods, preset=preset, **extra)
            seen_presets = set()
            for i, (name, exp) in enumerate(zip(methods, exps)):
                presets[name] = exp.preset if exp.conservation is not None and exp.preset else None
                if perturbation:
                    for mode in modes:
                        curves[name][mode].append(perturbation_curve(model, inputs, exp, explained, mode, steps,
                                                                     **common))
                if kind == "vision" and segmentation and batch.get("masks") is not None:
                    has_masks = True
                    segs[name].append(segmentation_scores(exp, torch.as_tensor(batch["masks"]).to(device)))
                if kind == "text":
                    rat = batch.get("rationales")
                    if rat is not None:
                        has_rationales = True
                        rat = torch.as_tensor(rat).bool().to(device)
                        for k in rationale_k:
                            f1s[name][k].append(token_f1(exp, rat, k))
                            precs[name][k].append(precision_at_k(exp, rat, k))
                    if aopc:
                        aopcs[name].append(_aopc(model, inputs, exp, explained, aopc_steps, removal=aopc_removal,
                                                 tokenizer=tokenizer, batch_size=pbs))
                        lodds[name].append(_log_odds(model, inputs, exp, explained, aopc_steps,
                                                     removal=log_odds_removal, tokenizer=tokenizer, batch_size=pbs))
                    if others is not None:
                        taus[name].append(kendall_tau(exp, others[i]))
                if conservation and presets[name] is not None and exp.preset not in seen_presets:
                    seen_presets.add(exp.preset)
                    cons.setdefault(exp.preset, []).append(conservation_report(exp))
            samples += n
            bar.update(n)
    finally:
        bar.close()
    if modality is None:
        raise InputError("the data holds no batch")

    def cat(arrays):
        return np.concatenate(arrays) if arrays else None

    text = {}
    if modality == "text":
        for m in methods:
            text[m] = TextScores(
                token_f1={k: cat(v) for k, v in f1s[m].items()} if has_rationales else {},
                precision_at_k={k: cat(v) for k, v in precs[m].items()} if has_rationales else {},
                aopc=FaithfulnessResult.concat(aopcs[m]) if aopcs[m] else None,
                log_odds=FaithfulnessResult.concat(lodds[m]) if lodds[m] else None,
                kendall_tau=cat(taus[m]))
    described = {"target": target, "steps": [float(s) for s in steps], "modes": list(modes),
                "batch_size": batch_size,
                "captures": f"{CACHE.captures - captures[0]} graph capture(s) (torch.export or the disk "
                            f"cache) and {CACHE.specializations - captures[1]} specialization(s) for {len(sizes)} "
                            "distinct input size(s)"}
    if modality == "vision":
        norm = _util.resolve_normalization(normalization)
        described.update(unit=unit, baseline=_describe(baseline if baseline is not None else 0.0),
                        normalization=("none (baseline in the model's input space)" if norm is None else
                                       f"mean={list(norm[0])}, std={list(norm[1])}"))
    else:
        described.update(removal=str(removal), rationale_k=list(rationale_k), aopc_removal=str(aopc_removal),
                        log_odds_removal=str(log_odds_removal), aopc_steps=[float(s) for s in aopc_steps])
    return EvaluationResult(
        methods=methods, modality=modality, samples=samples,
        perturbation={m: {mode: PerturbationResult.concat(v) for mode, v in curves[m].items()}
                      for m in methods} if perturbation else {},
        segmentation={m: SegmentationResult.concat(segs[m]) for m in methods} if has_masks else {},
        text=text,
        conservation={p: ConservationReport.concat(r) for p, r in cons.items()},
        presets=presets, settings=described)


def evaluate_perturbation(model: torch.nn.Module, data: Any, methods: Sequence[str] = ("transformer_attribution",),
                          **options) -> Dict[str, Dict[str, PerturbationResult]]:
    """Only the perturbation tests of :func:`evaluate`: method -> mode -> :class:`PerturbationResult`
    (its ``accuracy`` and ``auc`` are the dataset averages)."""
    options.update(segmentation=False, aopc=False, kendall=False, conservation=False, perturbation=True)
    return evaluate(model, data, methods, **options).perturbation


def evaluate_segmentation(model: torch.nn.Module, data: Any, methods: Sequence[str] = ("transformer_attribution",),
                          **options) -> Dict[str, SegmentationResult]:
    """Only the segmentation scores of :func:`evaluate`: method -> :class:`SegmentationResult`."""
    options.update(segmentation=True, perturbation=False, aopc=False, kendall=False, conservation=False)
    return evaluate(model, data, methods, **options).segmentation


def evaluate_text(model: torch.nn.Module, data: Any, methods: Sequence[str] = ("transformer_attribution",),
                  **options) -> Dict[str, TextScores]:
    """Only the text metrics of :func:`evaluate`: method -> :class:`TextScores`."""
    options.setdefault("perturbation", False)
    options.update(conservation=False)
    return evaluate(model, data, methods, **options).text


def _batches(data: Any, batch_size: int):
    if hasattr(data, "batches") and callable(data.batches):
        return data.batches(batch_size), len(data) if hasattr(data, "__len__") else None
    if isinstance(data, Mapping):
        if "inputs" not in data:
            raise InputError("a batch dict needs an 'inputs' entry (and optionally labels, masks, rationales)")
        return [data], None
    if torch.is_tensor(data):
        return [{"inputs": data}], data.shape[0]
    if isinstance(data, Iterable):
        return (b if isinstance(b, Mapping) and "inputs" in b else _bad_batch(b) for b in data), None
    raise InputError(f"cannot evaluate on {type(data).__name__}: pass a dataset with batches(), an iterable of "
                     "batch dicts or one batch dict")


def _bad_batch(b):
    raise InputError(f"a batch must be a dict with an 'inputs' entry, not {type(b).__name__}")


def _to_device(inputs: Any, device: torch.device) -> Any:
    if torch.is_tensor(inputs):
        return inputs.to(device)
    if isinstance(inputs, Mapping):
        return {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in inputs.items()}
    if isinstance(inputs, (tuple, list)):
        return type(inputs)(v.to(device) if torch.is_tensor(v) else v for v in inputs)
    return inputs


def _describe(v: Any) -> str:
    if torch.is_tensor(v):
        return f"tensor{tuple(v.shape)}" if v.numel() > 4 else str(v.tolist())
    return str(v)
