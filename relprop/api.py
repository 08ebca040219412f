"""The front door: :func:`explain`."""
from __future__ import annotations

import inspect
from typing import Any, Optional

import torch
import torch.nn.functional as F

from . import targets as _targets
from .errors import MethodError, RelpropError
from .explanation import Explanation
from .graph.capture import CACHE
from .graph.inputs import bind_inputs
from .graph.interpreter import run
from .methods import get_method
from .rules.registry import get_preset
from .rules.stabilize import DEFAULT_EPS


def explain(model: torch.nn.Module, inputs: Any, target: Any = None, method: str = "transformer_attribution",
            preset: str = "chefer2021", *, eps: float = DEFAULT_EPS, unsupported: str = "error",
            **options) -> Explanation:
    """Explain the score of class ``target`` of an unmodified ``model`` on ``inputs``.

    Parameters
    ----------
    model : a HuggingFace ``transformers`` or ``timm`` model (or any ``nn.Module`` that
        ``torch.export`` can capture). It is not modified; its parameters, buffers, mode and hooks
        are the same afterwards, also when this function raises.
    inputs : what the model's forward takes: a tensor (pixels), a tuple of positional arguments,
        or a dict of tensors such as a tokenizer's output.
    target : None (each sample's predicted class), an int, one int per sample, or a callable
        ``target(outputs) -> [batch]`` scores.
    method : an explanation method (``relprop.methods()`` lists them). Default: the paper's
        Transformer Attribution (Chefer et al., CVPR 2021, Eq. 13–14).
    preset : the relevance rules (``"chefer2021"``: the paper's rules as its authors' code applies
        them; ``"lrp"``: the plain-LRP baseline, not conservative).
    eps : denominator stabilizer of the rules.
    unsupported : ``"error"`` (default) raises :class:`relprop.UnsupportedOperation` for an op
        with no rule; ``"z_rule"`` applies the generic gradient × input rule to such ops.
    **options : options of the method (e.g. ``start_block=``, ``normalize_rows=``).

    Returns
    -------
    Explanation
    """
    info = get_method(method)
    get_preset(info.preset or preset)
    _check_options(info, options)
    kwargs = bind_inputs(model, inputs)
    captured = CACHE.get(model, kwargs)
    batch = kwargs[captured.primary].shape[0]
    score_fn, target_of = _targets.resolve(target, batch)
    active = info.preset or preset
    trace = run(captured, model, kwargs, score_fn, preset=active, relevance=info.needs_relevance, eps=eps,
                unsupported=unsupported, target_of=target_of)
    result = info.fn(trace, **options)
    return _package(info.name, active, result, trace, kwargs, captured)


def _check_options(info, options):
    params = inspect.signature(info.fn).parameters
    valid = [p for p in params if p != "trace"]
    for k in options:
        if k not in valid:
            raise MethodError(f"'{k}' is not an option of method '{info.name}'. Options: {valid or 'none'}")


def _package(name, preset, result, trace, kwargs, captured) -> Explanation:
    tokens = result["tokens"]
    a = captured.analysis
    mask = None
    scores = tokens
    smap = None
    prefix = 0
    if trace.modality == "vision" and trace.grid is not None:
        gh, gw = trace.grid
        n = tokens.shape[-1]
        prefix = n - gh * gw
        if prefix < 0:
            raise RelpropError(f"{n} tokens cannot hold a {gh}x{gw} patch grid")
        scores = tokens[:, prefix:]
        pixels = kwargs[captured.primary]
        smap = F.interpolate(scores.reshape(-1, 1, gh, gw).float(), size=tuple(pixels.shape[-2:]),
                             mode="bilinear", align_corners=False)[:, 0]
        mask = torch.ones_like(scores, dtype=torch.bool)
    elif trace.modality == "text":
        am = kwargs.get("attention_mask")
        if torch.is_tensor(am) and am.shape == scores.shape:
            mask = am.to(scores.device) != 0
        else:
            mask = torch.ones_like(scores, dtype=torch.bool)
        scores = torch.where(mask, scores, torch.zeros((), dtype=scores.dtype, device=scores.device))
    return Explanation(method=name, scores=scores, map=smap, mask=mask, matrix=result.get("matrix"),
                       blocks=trace.blocks, target=trace.target, target_scores=trace.target_scores,
                       conservation=trace.conservation, input_relevance=trace.input_relevance,
                       logits=trace.logits, preset=preset, modality=trace.modality, grid=trace.grid,
                       prefix_tokens=prefix, outputs=trace.outputs)
