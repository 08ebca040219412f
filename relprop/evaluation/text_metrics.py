"""Text metrics: agreement with human rationales, faithfulness and confidence.

* **token-F1** of the top-k tokens against a human rationale (ERASER, DeYoung et al. 2020; Chefer,
  Gur & Wolf, CVPR 2021, §4 and Fig. 4, which take the top-k tokens as the predicted rationale so that
  no threshold favours a method): per text, precision = |top-k ∩ R| / k, recall = |top-k ∩ R| / |R|,
  F1 their harmonic mean, then averaged over the texts (texts without rationale tokens are left out).
* **Precision@K** (AttCAT §5.3): the share of the K top-scored tokens that belong to the rationale
  (AttCAT counts them; multiply by K for the count).
* **AOPC** (AttCAT §5.3, Eq. 13): delete the top k % tokens, k = 0, 10, …, 100, and average
  p(ŷ|x) − p(ŷ|x̃_k) over k (higher is better); ŷ is the predicted class unless ``target`` is given.
* **log-odds** (AttCAT Eq. 14): replace the top k % tokens by [PAD] and average
  log(p(ŷ|x̃_k) / p(ŷ|x)) over k (lower is better), computed from log-softmax so that it stays finite.
* **Kendall-τ** (AttCAT Eq. 15) between the token scores of two classes (the rankings of the tokens),
  ``scipy.stats.kendalltau`` (τ-b, ties allowed) per text: lower = the method tells the classes apart.

Only positions where the explanation's ``mask`` is True count (never padding nor [CLS]/[SEP]); in the
top-k, ties go to the earlier position, and k is capped at the number of such tokens.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import numpy as np
import torch

from ..errors import InputError
from . import _util
from .perturbation_protocol import PerturbationResult, perturbation_curve, removal_ranks

#: AttCAT's removed fractions, 0 %, 10 %, …, 100 %
AOPC_STEPS = tuple(round(0.1 * i, 1) for i in range(0, 11))


def _scores_and_mask(scores: Any, mask: Optional[Any]):
    exp, s = _util.scores_of(scores)
    s = s.detach().float()
    if mask is None:
        mask = exp.mask if exp is not None and exp.mask is not None else torch.ones_like(s, dtype=torch.bool)
    mask = torch.as_tensor(mask, device=s.device).bool()
    if s.dim() != 2 or tuple(mask.shape) != tuple(s.shape):
        raise InputError(f"token scores {tuple(s.shape)} and mask {tuple(mask.shape)}: expected [texts, positions]")
    return s, mask


def top_k(scores: Any, k: int, mask: Optional[Any] = None) -> torch.Tensor:
    """[texts, positions] bool: the k highest-scored positions of each text among ``mask`` (ties: the
    earlier position; fewer when a text has fewer than k tokens)."""
    s, m = _scores_and_mask(scores, mask)
    if int(k) < 0:
        raise InputError(f"k must be non-negative, got {k}")
    rank = removal_ranks(s, m, "positive")
    return (rank < int(k)) & m


def _overlap(scores, rationale, k, mask):
    s, m = _scores_and_mask(scores, mask)
    r = torch.as_tensor(rationale, device=s.device).bool()
    if tuple(r.shape) != tuple(s.shape):
        raise InputError(f"rationale {tuple(r.shape)} and scores {tuple(s.shape)} differ in shape")
    r = r & m
    chosen = top_k(s, k, m)
    hit = (chosen & r).sum(1).double()
    return hit, chosen.sum(1).double(), r.sum(1).double()


def token_f1(scores: Any, rationale: Any, k: int, mask: Optional[Any] = None) -> np.ndarray:
    """[texts] token-F1 of the top-``k`` tokens against the rationale (NaN for a text without one).

    Parameters
    ----------
    scores
        an ``relprop.Explanation`` of texts or [texts, positions] scores.
    rationale
        [texts, positions] bool, True at the human rationale's tokens.
    k
        how many top-scored tokens form the predicted rationale.
    mask
        [texts, positions] bool, the positions that count (default: ``exp.mask``, else all).
    """
    hit, chosen, truth = _overlap(scores, rationale, k, mask)
    precision = torch.where(chosen > 0, hit / chosen.clamp_min(1), torch.zeros_like(hit))
    recall = hit / truth.clamp_min(1)
    f1 = torch.where(precision + recall > 0, 2 * precision * recall / (precision + recall).clamp_min(1e-12),
                     torch.zeros_like(hit))
    f1 = torch.where(truth > 0, f1, torch.full_like(f1, float("nan")))
    return _util.to_numpy(f1)


def precision_at_k(scores: Any, rationale: Any, k: int, mask: Optional[Any] = None) -> np.ndarray:
    """[texts] share of the top-``k`` tokens that are rationale tokens: |top-k ∩ R| / k (AttCAT §5.3,
    normalized by K; NaN for a text without rationale)."""
    hit, chosen, truth = _overlap(scores, rationale, k, mask)
    p = hit / max(int(k), 1)
    p = torch.where(truth > 0, p, torch.full_like(p, float("nan")))
    return _util.to_numpy(p)


def kendall_tau(scores_a: Any, scores_b: Any, mask: Optional[Any] = None) -> np.ndarray:
    """[texts] Kendall-τ between the token scores for two classes (AttCAT Eq. 15), over the positions of
    ``mask`` (default: ``exp.mask`` of the first, else all); NaN where a text has < 2 tokens or a
    constant score vector."""
    a, m = _scores_and_mask(scores_a, mask)
    exp_b, b = _util.scores_of(scores_b)
    b = b.detach().float().to(a.device)
    if tuple(b.shape) != tuple(a.shape):
        raise InputError(f"the two score tensors differ in shape: {tuple(a.shape)} and {tuple(b.shape)}")
    if mask is None and exp_b is not None and exp_b.mask is not None:
        m = m & exp_b.mask.to(a.device)
    from scipy.stats import kendalltau  # imported when used: `relprop --help` starts without scipy
    a_np, b_np, m_np = _util.to_numpy(a), _util.to_numpy(b), _util.to_numpy(m)
    out = np.full(a_np.shape[0], np.nan)
    for i in range(a_np.shape[0]):
        sel = m_np[i]
        if sel.sum() >= 2:
            x, y = a_np[i, sel], b_np[i, sel]
            if np.ptp(x) > 0 and np.ptp(y) > 0:
                out[i] = kendalltau(x, y).statistic
    return out


@dataclasses.dataclass
class FaithfulnessResult:
    """AOPC or log-odds (AttCAT §5.3).

    Attributes
    ----------
    name : ``"aopc"`` or ``"log_odds"``.
    per_sample_curve : [texts, steps] p(ŷ|x) − p(ŷ|x̃_k) (AOPC) or log(p(ŷ|x̃_k) / p(ŷ|x)) (log-odds).
    curve : the underlying :class:`PerturbationResult` (probabilities per text and fraction).

    ``per_sample`` ([texts], the mean over the fractions), ``value`` (the dataset value) and
    ``mean_curve`` ([steps]) follow from them.
    """

    name: str
    per_sample_curve: np.ndarray
    curve: PerturbationResult

    @property
    def fractions(self) -> np.ndarray:
        return self.curve.fractions

    @property
    def per_sample(self) -> np.ndarray:
        return self.per_sample_curve.mean(axis=1)

    @property
    def value(self) -> float:
        """The dataset value: mean over texts and fractions."""
        return float(self.per_sample.mean()) if len(self.per_sample) else float("nan")

    @property
    def mean_curve(self) -> np.ndarray:
        """[steps] the mean over texts at each fraction (AOPC(k) / LOdds(k))."""
        return self.per_sample_curve.mean(axis=0)

    @staticmethod
    def from_curve(name: str, curve: PerturbationResult) -> "FaithfulnessResult":
        if name == "aopc":
            values = curve.clean_probability[:, None] - curve.probability
        elif name == "log_odds":
            values = curve.log_probability - curve.clean_log_probability[:, None]
        else:
            raise InputError(f"'{name}' is not a choice. Choices: ['aopc', 'log_odds']")
        return FaithfulnessResult(name, values, curve)

    @staticmethod
    def concat(results: Sequence["FaithfulnessResult"]) -> "FaithfulnessResult":
        results = list(results)
        return FaithfulnessResult.from_curve(results[0].name, PerturbationResult.concat([r.curve for r in results]))

    def __repr__(self) -> str:
        return f"FaithfulnessResult('{self.name}', texts={len(self.per_sample)}, value={self.value:.4f})"


def aopc(model: torch.nn.Module, inputs: Any, scores: Any, target: Any = None,
         steps: Sequence[float] = AOPC_STEPS, *, removal: Any = "delete", **options) -> FaithfulnessResult:
    """AOPC (AttCAT Eq. 13): mean over k of p(ŷ|x) − p(ŷ|x̃_k), the top k % tokens deleted.

    ``options`` go to ``perturbation_curve`` (``tokenizer``, ``removable``, ``batch_size``)."""
    curve = perturbation_curve(model, inputs, scores, target, "positive", steps, removal=removal, **options)
    return FaithfulnessResult.from_curve("aopc", curve)


def log_odds(model: torch.nn.Module, inputs: Any, scores: Any, target: Any = None,
             steps: Sequence[float] = AOPC_STEPS, *, removal: Any = "pad", **options) -> FaithfulnessResult:
    """Log-odds (AttCAT Eq. 14): mean over k of log(p(ŷ|x̃_k) / p(ŷ|x)), the top k % tokens replaced
    by [PAD]."""
    curve = perturbation_curve(model, inputs, scores, target, "positive", steps, removal=removal, **options)
    return FaithfulnessResult.from_curve("log_odds", curve)
