"""What removing a pixel, a patch or a token means in the perturbation tests
(:mod:`relprop.evaluation.perturbation_protocol`): the ranked positions of each sample, which may be removed,
and how the perturbed copies of a chunk of samples are built."""
from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import InputError
from ..explanation import special_positions
from . import _util


# --------------------------------------------------------------------------------------------- images
def vision_plan(exp, scores, kwargs, primary, unit, grid, baseline, normalization):
    x = kwargs[primary]
    b, c, h, w = x.shape
    if unit == "pixel":
        m = exp.map if exp is not None else scores
        if m is None:
            raise InputError(f"explanation '{exp.method}' has no pixel map; use unit='patch'")
        m = m.to(x.device).float()
        if m.dim() == 2:  # patch scores -> bilinear map, as relprop.explain does
            gh, gw = grid_of(m.shape[1], grid, h, w)
            m = m.reshape(b, 1, gh, gw)
        elif m.dim() == 3:
            m = m[:, None]
        else:
            raise InputError(f"image scores of shape {tuple(m.shape)}: expected [batch, H, W] or [batch, patches]")
        if tuple(m.shape[-2:]) != (h, w):
            m = F.interpolate(m, size=(h, w), mode="bilinear", align_corners=False)
        ranked = m.reshape(b, h * w)

        def expand(removed):
            return removed.reshape(-1, 1, h, w)
    else:
        if exp is not None:
            s = exp.scores
            gh, gw = exp.grid if exp.grid is not None else grid_of(s.shape[1], grid, h, w)
        else:
            s = scores
            if s.dim() == 3:
                gh, gw = s.shape[1:]
                s = s.reshape(b, gh * gw)
            else:
                gh, gw = grid_of(s.shape[1], grid, h, w)
        if h % gh or w % gw:
            raise InputError(f"a {h}x{w} image does not divide into a {gh}x{gw} patch grid")
        ph, pw = h // gh, w // gw
        ranked = s.to(x.device).float().reshape(b, gh * gw)

        def expand(removed):
            k = removed.shape[0]
            return removed.reshape(k, gh, 1, gw, 1).expand(k, gh, ph, gw, pw).reshape(k, 1, h, w)
    fill, per_sample = fill_value(baseline, normalization, x)

    def build(chunk_kwargs, ii, removed):
        xi = chunk_kwargs[primary]
        f = fill.index_select(0, ii) if per_sample else fill
        return torch.where(expand(removed), f.to(xi.dtype), xi)

    return ranked, torch.ones_like(ranked, dtype=torch.bool), Builder(x, build).bind(kwargs, primary)


def fill_value(baseline, normalization, x):
    """The value of a removed pixel in the model's input space: (baseline - mean) / std."""
    c = x.shape[1]
    norm = _util.resolve_normalization(normalization)
    mean, std = (norm if norm is not None else (0.0, 1.0))
    mean = _util.as_channels(mean, c, x.device, "normalization mean").view(1, c, 1, 1)
    std = _util.as_channels(std, c, x.device, "normalization std").view(1, c, 1, 1)
    base = 0.0 if baseline is None else baseline
    base = torch.as_tensor(base, dtype=torch.float32, device=x.device)
    per_sample = False
    if base.dim() <= 1:
        base = _util.as_channels(base, c, x.device, "baseline").view(1, c, 1, 1)
    elif base.dim() == 3 and tuple(base.shape) == tuple(x.shape[1:]):
        base = base[None]
    elif tuple(base.shape) == tuple(x.shape):
        per_sample = True
    else:
        raise InputError(f"baseline of shape {tuple(base.shape)}: expected a scalar, one value per channel, "
                         f"[C, H, W] or the inputs' shape {tuple(x.shape)}")
    return (base - mean) / std, per_sample


def grid_of(patches, grid, h, w):
    if grid is not None:
        gh, gw = grid
        if gh * gw != patches:
            raise InputError(f"grid {grid} does not hold {patches} patches")
        return int(gh), int(gw)
    side = int(round(patches ** 0.5))
    if side * side == patches:
        return side, side
    raise InputError(f"{patches} patch scores do not form a square grid; pass grid=(rows, columns)")


class Builder:
    """Builds the keyword arguments of a chunk of perturbed copies."""

    def __init__(self, primary_tensor, fn: Callable):
        self.x, self.fn = primary_tensor, fn
        self.kwargs = None
        self.primary = None

    def bind(self, kwargs, primary):
        self.kwargs, self.primary = kwargs, primary
        return self

    def __call__(self, ii, removed):
        batch = self.x.shape[0]
        out = _util.take(self.kwargs, ii, batch)
        new = self.fn(out, ii, removed)
        if isinstance(new, dict):
            out.update(new)
        else:
            out[self.primary] = new
        return out


# ----------------------------------------------------------------------------------------------- text
def removal_token(removal: Any, model: torch.nn.Module = None, tokenizer: Any = None) -> Optional[int]:
    """The id that replaces a removed token (None for ``"delete"``)."""
    if removal == "delete":
        return None
    if isinstance(removal, (int, np.integer)) and not isinstance(removal, bool):
        return int(removal)
    if isinstance(removal, str) and removal.lstrip("-").isdigit():
        return int(removal)
    cfg = getattr(model, "config", None)
    if removal == "pad":
        tid = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
        tid = tid if tid is not None else getattr(cfg, "pad_token_id", None)
    elif removal == "mask":
        tid = getattr(tokenizer, "mask_token_id", None) if tokenizer is not None else None
        tid = tid if tid is not None else getattr(cfg, "mask_token_id", None)
    else:
        raise InputError(f"removal '{removal}' is not a choice. Choices: ['pad', 'mask', 'delete', a token id]")
    if tid is None:
        raise InputError(f"no {removal.upper()} token id known: pass tokenizer=, or removal=<token id>")
    return int(tid)


def text_plan(exp, scores, kwargs, primary, model, removable, removal, tokenizer):
    ids = kwargs[primary]
    b, t = ids.shape
    if tuple(scores.shape) != (b, t):
        raise InputError(f"token scores of shape {tuple(scores.shape)}; the input ids are {(b, t)}")
    am = kwargs.get("attention_mask")
    am = am if torch.is_tensor(am) and tuple(am.shape) == (b, t) else torch.ones_like(ids)
    if removable is None:
        if exp is not None and exp.mask is not None:
            removable = exp.mask
        else:
            removable = ~special_positions(model, kwargs, primary, (b, t), ids.device)[0]
    removable = torch.as_tensor(removable, device=ids.device).bool() & (am.to(ids.device) != 0)
    token = removal_token(removal, model, tokenizer)
    if token is None:
        try:
            pad = removal_token("pad", model, tokenizer)
        except InputError:
            pad = 0
    per_position = [k for k, v in kwargs.items() if torch.is_tensor(v) and tuple(v.shape[:2]) == (b, t)]

    def build(chunk_kwargs, ii, removed):
        if token is not None:
            return {primary: torch.where(removed, torch.full_like(removed, token, dtype=ids.dtype),
                                         chunk_kwargs[primary])}
        order = torch.sort(removed.to(torch.int8), dim=1, stable=True).indices  # kept first, in order
        tail = torch.arange(t, device=ids.device)[None, :] >= (t - removed.sum(1, keepdim=True))
        new = {}
        for k in per_position:
            v = chunk_kwargs[k]
            g = v.gather(1, order.reshape(order.shape + (1,) * (v.dim() - 2)).expand_as(v))
            fill = pad if k == primary else 0
            new[k] = torch.where(tail.reshape(tail.shape + (1,) * (v.dim() - 2)),
                                 torch.full_like(g, fill), g)
        return new

    return scores.to(ids.device).float(), removable, Builder(ids, build).bind(kwargs, primary)
