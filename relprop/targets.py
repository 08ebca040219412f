"""Resolve the ``target`` argument of :func:`relprop.explain` into per-sample scores.

``target`` may be None (each sample's predicted class), an int (the same class for every sample),
one int per sample (a list or a tensor), or a callable ``target(outputs) -> [batch]`` returning
any differentiable score per sample (a logit difference, a similarity, ...). The relevance seed is
the gradient of the summed scores with respect to the model's outputs: for a class index that is
exactly the one-hot vector of that class (CVPR 2021, §3.3: relevance 1 at the target logit).
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Tuple

import torch

from .errors import TargetError


def logits_of(outputs: Any) -> torch.Tensor:
    """The class scores of a model output: a tensor, ``outputs.logits`` or ``outputs[0]``."""
    if torch.is_tensor(outputs):
        return outputs
    logits = getattr(outputs, "logits", None)
    if torch.is_tensor(logits):
        return logits
    if isinstance(outputs, (tuple, list)) and outputs and torch.is_tensor(outputs[0]):
        return outputs[0]
    raise TargetError(
        f"cannot find class scores in the model's output ({type(outputs).__name__}); "
        "pass target=callable(outputs) -> [batch] scores"
    )


def resolve(target: Any, batch: int) -> Tuple[Callable, Callable]:
    """Return ``(score_fn, target_of)``: the [batch] target scores and the [batch] class indices
    (None for a callable target) as functions of the model's outputs."""
    if callable(target) and not torch.is_tensor(target):
        def score_fn(outputs):
            s = target(outputs)
            if not torch.is_tensor(s) or s.dim() != 1 or s.shape[0] != batch:
                shape = tuple(s.shape) if torch.is_tensor(s) else type(s).__name__
                raise TargetError(f"target callable must return one score per sample, shape [{batch}]; got {shape}")
            return s
        return score_fn, lambda outputs: None

    def target_of(outputs) -> torch.Tensor:
        logits = logits_of(outputs)
        if logits.dim() != 2:
            raise TargetError(
                f"the model's class scores have shape {tuple(logits.shape)}, not [batch, classes]; "
                "for token-level or language-model outputs pass target=callable(outputs) -> [batch]"
            )
        n = logits.shape[1]
        if target is None:
            return logits.detach().argmax(-1)
        if isinstance(target, bool):
            raise TargetError("target must be an int, a sequence of ints, a tensor or a callable, not bool")
        if isinstance(target, int):
            t = torch.full((batch,), target, dtype=torch.long, device=logits.device)
        else:
            try:
                t = torch.as_tensor(target, device=logits.device)
            except (TypeError, ValueError):
                raise TargetError(f"target must be an int, ints per sample or a callable, not {type(target).__name__}") from None
            if t.dtype.is_floating_point or t.dtype == torch.bool:
                raise TargetError(f"target indices must be integers, got dtype {t.dtype}")
            t = t.long().reshape(-1)
            if t.numel() == 1:
                t = t.expand(batch).clone()
            if t.numel() != batch:
                raise TargetError(f"target has {t.numel()} entries but the batch has {batch} samples")
        bad = (t < 0) | (t >= n)
        if bool(bad.any()):
            raise TargetError(f"target {t[bad].tolist()} out of range: valid class indices are 0..{n - 1} "
                              f"(the model has {n} classes)")
        return t

    def score_fn(outputs):
        t = target_of(outputs)
        logits = logits_of(outputs)
        return logits.gather(1, t[:, None]).squeeze(1)

    return score_fn, target_of
