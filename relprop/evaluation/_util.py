"""Helpers shared by the evaluation modules: binding inputs, running the model in chunks, reading
explanations and normalizations. Nothing here computes a metric."""
from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Tuple

import numpy as np
import torch

from ..errors import InputError, TargetError
from ..explanation import Explanation
from ..graph.inputs import bind_inputs, primary_input
from ..targets import logits_of


def bind(model: torch.nn.Module, inputs: Any) -> Tuple[Dict[str, Any], str]:
    """``inputs`` (tensor, tuple or dict) as keyword arguments of ``model.forward`` and the name of
    the input that explanations refer to (pixels or token ids)."""
    kwargs = bind_inputs(model, inputs)
    return kwargs, primary_input(kwargs)


def modality_of(x: torch.Tensor) -> str:
    """``"vision"`` for [batch, channels, H, W] floating pixels, ``"text"`` for [batch, positions] ids."""
    if x.is_floating_point() and x.dim() == 4:
        return "vision"
    if not x.is_floating_point() and x.dim() == 2:
        return "text"
    raise InputError(f"cannot evaluate on an input of shape {tuple(x.shape)} and dtype {x.dtype}: expected "
                     "[batch, channels, height, width] pixels or [batch, positions] token ids")


def take(kwargs: Dict[str, Any], index: torch.Tensor, batch: int) -> Dict[str, Any]:
    """The samples ``index`` of every batched tensor in ``kwargs`` (others are passed unchanged)."""
    return {k: (v.index_select(0, index) if torch.is_tensor(v) and v.dim() > 0 and v.shape[0] == batch else v)
            for k, v in kwargs.items()}


@torch.no_grad()
def forward_logits(model: torch.nn.Module, kwargs: Dict[str, Any]) -> torch.Tensor:
    """[batch, classes] float32 class scores of one forward pass (no gradients)."""
    return logits_of(model(**kwargs)).float()


def resolve_classes(target: Any, clean_logits: torch.Tensor) -> torch.Tensor:
    """[batch] long class indices: None -> the predicted class of the clean input, an int, or one
    per sample."""
    batch, classes = clean_logits.shape
    if target is None:
        return clean_logits.argmax(-1)
    if callable(target) and not torch.is_tensor(target):
        raise TargetError("the evaluation measures top-1 accuracy and probabilities of a class; pass a class "
                          "index (int, one per sample, or None for the predicted class), not a callable")
    t = torch.as_tensor(target, device=clean_logits.device).long()
    if t.dim() == 0:
        t = t.expand(batch)
    if t.shape != (batch,):
        raise TargetError(f"target has shape {tuple(t.shape)}; expected one class per sample ({batch})")
    if bool(((t < 0) | (t >= classes)).any()):
        raise TargetError(f"target {t.tolist()} out of range for {classes} classes")
    return t.clone()


def scores_of(scores_or_explanation: Any) -> Tuple[Optional[Explanation], torch.Tensor]:
    """(the Explanation or None, its scores tensor)."""
    if isinstance(scores_or_explanation, Explanation):
        return scores_or_explanation, scores_or_explanation.scores
    if torch.is_tensor(scores_or_explanation):
        return None, scores_or_explanation
    if isinstance(scores_or_explanation, np.ndarray):
        return None, torch.from_numpy(scores_or_explanation)
    raise InputError(f"expected an Explanation or a tensor of scores, not {type(scores_or_explanation).__name__}")


def to_numpy(x: Any) -> np.ndarray:
    if torch.is_tensor(x):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def model_device(model: torch.nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    for b in model.buffers():
        return b.device
    return torch.device("cpu")


def resolve_normalization(normalization: Any) -> Optional[Tuple[Tuple[float, ...], Tuple[float, ...]]]:
    """The per-channel ``(mean, std)`` a model's inputs were normalized with, from

    * ``None``: none known (the pixels the model sees are taken as the un-normalized space);
    * a pair ``(mean, std)`` of numbers or per-channel sequences;
    * a dict with ``mean``/``std`` (a timm ``pretrained_cfg``) or ``image_mean``/``image_std``;
    * a HuggingFace image processor (``image_mean``/``image_std`` attributes);
    * a timm model (its ``pretrained_cfg``).
    """
    if normalization is None:
        return None
    mean = std = None
    if isinstance(normalization, dict):
        mean = normalization.get("mean", normalization.get("image_mean"))
        std = normalization.get("std", normalization.get("image_std"))
    elif isinstance(normalization, (tuple, list)) and len(normalization) == 2:
        mean, std = normalization
    elif hasattr(normalization, "image_mean") and hasattr(normalization, "image_std"):
        mean, std = normalization.image_mean, normalization.image_std
    elif isinstance(getattr(normalization, "pretrained_cfg", None), dict):
        cfg = normalization.pretrained_cfg
        mean, std = cfg.get("mean"), cfg.get("std")
    if mean is None or std is None:
        raise InputError(f"cannot read a normalization (mean, std) from {type(normalization).__name__}: pass "
                         "(mean, std), a dict with mean/std, a HuggingFace image processor or a timm model")

    def tup(v):
        return tuple(float(a) for a in (v if isinstance(v, (tuple, list, np.ndarray)) else [v]))
    mean, std = tup(mean), tup(std)
    if any(s == 0 for s in std):
        raise InputError(f"normalization std {std} contains 0")
    return mean, std


def as_channels(value: Any, channels: int, device, name: str) -> torch.Tensor:
    """A scalar or per-channel sequence as a [channels] float tensor."""
    t = torch.as_tensor(value, dtype=torch.float32, device=device).flatten()
    if t.numel() == 1:
        t = t.expand(channels)
    if t.numel() != channels:
        raise InputError(f"{name} has {t.numel()} values; the images have {channels} channels")
    return t


def floor_count(fraction: float, n: torch.Tensor) -> torch.Tensor:
    """floor(fraction * n) per sample, robust to 0.7 * 10 = 7.000000000000001 and 0.29 * 100 = 28.99..."""
    return torch.floor(n.double() * float(fraction) + 1e-9).long()


def check_fractions(steps: Sequence[float]) -> np.ndarray:
    f = np.asarray(list(steps), dtype=np.float64)
    if f.ndim != 1 or f.size == 0 or (f < 0).any() or (f > 1).any():
        raise InputError(f"steps must be fractions in [0, 1], got {list(steps)}")
    if (np.diff(f) <= 0).any():
        raise InputError(f"steps must be increasing, got {list(steps)}")
    return f
