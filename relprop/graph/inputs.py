"""Turn what the user passed as ``inputs`` into keyword arguments of the model's forward."""
from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any, Dict, Optional

import torch

from ..errors import InputError

#: names under which HuggingFace and timm models take their main input, in order of preference
PRIMARY_INPUT_NAMES = ("input_ids", "pixel_values", "inputs_embeds", "x", "input", "inputs", "images")


def bind_inputs(model: torch.nn.Module, inputs: Any) -> Dict[str, Any]:
    """Map ``inputs`` (a tensor, a tuple of positional arguments, or a dict) onto the names of
    ``model.forward``'s parameters, so that the model can be exported with keyword arguments only.
    """
    if isinstance(inputs, Mapping):
        args, kwargs = (), dict(inputs)
    elif torch.is_tensor(inputs):
        args, kwargs = (inputs,), {}
    elif isinstance(inputs, (tuple, list)):
        args, kwargs = tuple(inputs), {}
    else:
        raise InputError(
            f"inputs must be a tensor, a tuple of tensors or a dict of tensors (e.g. a tokenizer's output), "
            f"not {type(inputs).__name__}"
        )
    try:
        sig = inspect.signature(model.forward)
        bound = sig.bind_partial(*args, **kwargs)
    except TypeError as e:
        raise InputError(f"inputs do not fit {type(model).__name__}.forward{_sig(model)}: {e}") from None
    out = {}
    for name, value in bound.arguments.items():
        param = sig.parameters[name]
        if param.kind is inspect.Parameter.VAR_KEYWORD:
            out.update(value)
        elif param.kind is inspect.Parameter.VAR_POSITIONAL:
            raise InputError(f"{type(model).__name__}.forward takes *args; pass inputs as a dict instead")
        else:
            out[name] = value
    # decoders: a key/value cache is output state the graph cannot return; explain without it
    if "use_cache" in sig.parameters and "use_cache" not in out:
        out["use_cache"] = False
    elif "use_cache" not in out and any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values()) \
            and _has_cache_setting(getattr(model, "config", None)):
        out["use_cache"] = False
    tensors = {k: v for k, v in out.items() if torch.is_tensor(v)}
    if not tensors:
        lists = [k for k, v in out.items() if isinstance(v, (list, tuple))]
        if lists:
            raise InputError(f"inputs contain no tensor: {lists} are Python lists (a tokenizer called without "
                             "return_tensors='pt'?); call it as tokenizer(texts, return_tensors='pt', padding=True)")
        raise InputError("inputs contain no tensor: pass pixel values, input ids or a tokenizer's output")
    return out


def primary_input(kwargs: Dict[str, Any], wrt: Optional[str] = None) -> str:
    """Name of the input that relevance is explained onto (pixels, token ids or embeddings):
    ``wrt`` when given (``explain(..., wrt=...)``, e.g. ``"pixel_values"`` or ``"input_ids"`` of a
    CLIP model: its image or its text tower), else the first of :data:`PRIMARY_INPUT_NAMES`."""
    if wrt is not None:
        if not isinstance(wrt, str):
            raise InputError(f"wrt must be the name of a tensor input of the model (a str), not {type(wrt).__name__}")
        if not torch.is_tensor(kwargs.get(wrt)):
            names = sorted(k for k, v in kwargs.items() if torch.is_tensor(v))
            raise InputError(f"wrt={wrt!r} is not a tensor input of this call; choices: {names}")
        return wrt
    for name in PRIMARY_INPUT_NAMES:
        if torch.is_tensor(kwargs.get(name)):
            return name
    for name, v in kwargs.items():
        if torch.is_tensor(v) and v.is_floating_point():
            return name
    return next(k for k, v in kwargs.items() if torch.is_tensor(v))


def batch_size_of(kwargs: Dict[str, Any], primary: str) -> int:
    """The number of samples: the first dimension of the explained input ``kwargs[primary]``."""
    t = kwargs[primary]
    if t.dim() == 0:
        raise InputError(f"input '{primary}' is a scalar; it needs a batch dimension first")
    return t.shape[0]


def _has_cache_setting(config) -> bool:
    """Whether a model's config (or, for a vision-language model, its language model's ``text_config``)
    has a ``use_cache`` setting, i.e. the forward returns a key/value cache unless told not to."""
    if getattr(config, "use_cache", None) is not None:
        return True
    text = getattr(config, "text_config", None)
    return text is not None and getattr(text, "use_cache", None) is not None


def _sig(model) -> str:
    try:
        return str(inspect.signature(model.forward))
    except (TypeError, ValueError):
        return "(...)"
