"""Aggregation choices as hyperparameters, chosen on held-out data (the survey of transformer
explainability methods, §1.4: "for each hyperparameter, we evaluate its result and choose the one
that yields the best evaluation results").

``tune`` explains each batch once per method (``relprop.explain_settings``: one forward and
backward pass, whose per-block records serve every setting of the grid), scores every setting with
one of relprop's metrics, and returns the settings ranked, best first.
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Dict, List, Mapping, Optional

import numpy as np
import torch

from ..api import explain_settings
from ..errors import InputError, OptionError
from . import _util
from .config import EvaluationConfig
from .perturbation_protocol import perturbation_curve
from .runner import _batches, _to_device
from .segmentation import segmentation_scores
from .text_metrics import aopc as _aopc, log_odds as _log_odds, token_f1

#: metric -> (higher is better, what it is)
METRICS = {
    "positive_auc": (False, "AUC of top-1 accuracy while the most relevant pixels/tokens are removed (CVPR 2021 "
                            "Table 1; lower is better)"),
    "negative_auc": (True, "AUC of top-1 accuracy while the least relevant pixels/tokens are removed (higher is "
                           "better)"),
    "aopc": (True, "AOPC, texts (AttCAT Eq. 13; higher is better)"),
    "log_odds": (False, "log-odds, texts (AttCAT Eq. 14; lower is better)"),
    "token_f1": (True, "token-F1 of the top-k tokens against the rationales, texts (higher is better)"),
    "miou": (True, "mIoU of the maps against the masks, images (CVPR 2021 Table 2; higher is better)"),
}


@dataclasses.dataclass
class TuneResult:
    """What ``tune`` measured.

    Attributes
    ----------
    method
        the method tuned.
    metric
        the metric, and ``higher_is_better`` its direction.
    rows
        one dict per setting, best first: the options, ``"score"`` (the dataset mean) and
        ``"samples"``.
    best
        the options of the best setting (pass them to ``relprop.explain``).
    """

    method: str
    metric: str
    higher_is_better: bool
    rows: List[Dict[str, Any]]
    best: Dict[str, Any]

    def to_markdown(self) -> str:
        """The ranked table in markdown."""
        keys = [k for k in self.rows[0] if k not in ("score", "samples")] if self.rows else []
        lines = ["| rank | " + " | ".join(keys) + f" | {self.metric} |",
                 "|" + "---|" * (len(keys) + 2)]
        for i, r in enumerate(self.rows, 1):
            lines.append(f"| {i} | " + " | ".join(str(r[k]) for k in keys) + f" | {r['score']:.4f} |")
        return "\n".join(lines)

    def __repr__(self) -> str:
        arrow = "higher" if self.higher_is_better else "lower"
        return f"TuneResult({self.method}, {self.metric}, {arrow} is better)\n{self.to_markdown()}"


def grid_settings(grid: Mapping[str, Any]) -> List[Dict[str, Any]]:
    """Every combination of a grid ``{option: [values]}`` (a single value is a one-value list), in
    the grid's order."""
    if not isinstance(grid, Mapping):
        raise OptionError(f"grid must be a dict of option -> list of values, not {type(grid).__name__}")
    keys = list(grid)
    values = [v if isinstance(v, (list, tuple)) else [v] for v in grid.values()]
    if any(len(v) == 0 for v in values):
        raise OptionError(f"every option of the grid needs at least one value: {dict(grid)}")
    return [dict(zip(keys, combo)) for combo in itertools.product(*values)]


def tune(model: torch.nn.Module, data: Any, method: str, grid: Mapping[str, Any], metric: str = "positive_auc",
         config: Optional[EvaluationConfig] = None, **settings) -> TuneResult:
    """Evaluate every setting of ``grid`` for ``method`` on ``data`` and rank them (survey §1.4).

    Every batch is explained with one forward/backward pass for all the settings
    (``relprop.explain_settings``); each setting's explanation is then scored on its own.

    Parameters
    ----------
    model
        the classifier (eval mode); not modified.
    data
        as ``relprop.evaluation.evaluate`` (a dataset, batch dicts, one batch dict or a tensor).
    method
        a method whose options the grid sets (e.g. ``"rollout"``).
    grid
        ``{option: [values]}``, e.g. ``{"head_fusion": ["mean", "max"], "start_block": [0, 4]}``.
    metric
        one of ``METRICS`` (perturbation AUCs use ``config.steps``, ``unit``, ``baseline``;
        AOPC and log-odds ``config.aopc_steps``; token-F1 the first ``config.rationale_k``).
    config, **settings
        an ``EvaluationConfig`` and overrides of its fields.

    Returns
    -------
    TuneResult
        the settings ranked by the dataset mean of the metric, best first (ties keep the
        grid's order); ``.best`` the winning options.
    """
    from tqdm.auto import tqdm  # optional dependency (relprop[eval])

    if metric not in METRICS:
        raise OptionError(f"metric={metric!r} is not a choice. Choices: {sorted(METRICS)}")
    cfg = EvaluationConfig.of(config, **settings)
    combos = grid_settings(grid)
    higher, _ = METRICS[metric]
    normalization = cfg.normalization if cfg.normalization is not None else getattr(data, "normalization", None)
    tokenizer = cfg.tokenizer if cfg.tokenizer is not None else getattr(data, "tokenizer", None)
    device = _util.model_device(model)
    batches, total = _batches(data, cfg.batch_size)
    scores: List[List[np.ndarray]] = [[] for _ in combos]
    samples = 0
    bar = tqdm(total=total, unit="sample", desc=f"relprop tune {method}", disable=not cfg.progress)
    try:
        for batch in batches:
            inputs = _to_device(batch["inputs"], device)
            kwargs, primary = _util.bind(model, inputs)
            kind = _util.modality_of(kwargs[primary])
            labels = batch.get("labels")
            if cfg.target == "label":
                if labels is None:
                    raise InputError("target='label' needs labels in the data")
                labels = torch.as_tensor(labels).long().to(device)
            extra = dict(cfg.explain_options)
            special = batch.get("special_tokens_mask")
            if kind == "text" and special is not None:
                extra["special_tokens_mask"] = torch.as_tensor(special).bool().to(device)
            call = {k: v for k, v in extra.items() if k in _CALL_KEYS}
            fixed = {k: v for k, v in extra.items() if k not in _CALL_KEYS}  # method options kept in every setting
            exps = explain_settings(model, inputs, [{**fixed, **c} for c in combos],
                                    target=labels if cfg.target == "label" else None, method=method,
                                    preset=cfg.preset, **call)
            for i, exp in enumerate(exps):
                scores[i].append(_score(metric, model, inputs, exp, batch, cfg, kind, normalization, tokenizer,
                                        device))
            samples += kwargs[primary].shape[0]
            bar.update(kwargs[primary].shape[0])
    finally:
        bar.close()
    if samples == 0:
        raise InputError("the data holds no batch")
    rows = []
    for combo, per in zip(combos, scores):
        values = np.concatenate(per).astype(float)
        mean = float(np.nanmean(values)) if np.isfinite(values).any() else float("nan")
        rows.append({**combo, "score": mean, "samples": int(np.isfinite(values).sum())})
    order = sorted(range(len(rows)), key=lambda i: (np.isnan(rows[i]["score"]),
                                                    -rows[i]["score"] if higher else rows[i]["score"], i))
    ranked = [rows[i] for i in order]
    return TuneResult(method, metric, higher, ranked, dict(combos[order[0]]))


#: keyword arguments of explain_settings that are not method options
_CALL_KEYS = {"eps", "unsupported", "special_tokens_mask", "tokenizer", "memory", "wrt"}


def _score(metric, model, inputs, exp, batch, cfg, kind, normalization, tokenizer, device) -> np.ndarray:
    """[samples] values of ``metric`` for one explanation of a batch."""
    pbs = int(cfg.perturbation_batch_size or 64)
    target = exp.target
    if metric in ("positive_auc", "negative_auc"):
        mode = metric.split("_")[0]
        curve = perturbation_curve(model, inputs, exp, target, mode, cfg.steps, baseline=cfg.baseline,
                                   normalization=normalization, unit=cfg.unit, removal=cfg.removal,
                                   tokenizer=tokenizer, batch_size=pbs)
        return np.asarray(curve.per_sample_auc, dtype=float)
    if metric in ("aopc", "log_odds"):
        if kind != "text":
            raise InputError(f"metric={metric!r} is defined for texts; use positive_auc or negative_auc for images")
        fn, removal = (_aopc, cfg.aopc_removal) if metric == "aopc" else (_log_odds, cfg.log_odds_removal)
        return np.asarray(fn(model, inputs, exp, target, cfg.aopc_steps, removal=removal, tokenizer=tokenizer,
                             batch_size=pbs).per_sample, dtype=float)
    if metric == "token_f1":
        rat = batch.get("rationales")
        if rat is None:
            raise InputError("metric='token_f1' needs rationales in the data")
        return np.asarray(token_f1(exp, torch.as_tensor(rat).bool().to(device), cfg.rationale_k[0]), dtype=float)
    masks = batch.get("masks")
    if masks is None or kind != "vision":
        raise InputError("metric='miou' needs images with masks")
    return np.asarray(segmentation_scores(exp, torch.as_tensor(masks).to(device)).miou, dtype=float)
