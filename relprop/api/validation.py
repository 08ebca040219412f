"""Check what the user passed to :func:`relprop.explain` before any tracing starts.

A wrong input should end in a :class:`relprop.InputError` that names the input, says what is wrong
with it and what to do, not in an exception raised ten frames deep inside torch or the model. The
checks here are cheap (shape, dtype and device comparisons, one ``isfinite`` per floating input);
what they cannot see (an image of the wrong size for a timm ViT, a missing batch dimension) is
caught when the capture fails: the model is then run once eagerly, and if *it* rejects the inputs
the error says so, with the model's own message.

The result is checked too: relprop never hands back NaN or ±inf scores (:func:`check_result`).
"""
from __future__ import annotations

from typing import Any, Dict, Iterable

import torch

from ..errors import CaptureError, InputError, RelpropError, warn
from ..graph.dispatch import offloaded_weights
from ..graph.host_reads import deferring, later, refuse_if
from ..graph.state import eval_mode
from ..models.decoders import is_causal_decoder

#: inputs that hold one row per sample and one column per token, like ``input_ids``
PER_TOKEN_INPUTS = ("attention_mask", "token_type_ids")


def check_model(model: Any) -> None:
    """``model`` must be an ``nn.Module`` (a HuggingFace or timm model, or any module)."""
    if not isinstance(model, torch.nn.Module):
        raise InputError(f"model must be a torch.nn.Module, not {type(model).__name__}")


def check_inputs(model: torch.nn.Module, kwargs: Dict[str, Any], primary: str) -> None:
    """Raise :class:`InputError` for inputs the model cannot take or relprop cannot explain.

    Checked: an empty batch; per-token inputs (attention mask, token types) shaped unlike the token
    ids; token ids that are not integers, lack a batch dimension or fall outside the vocabulary;
    integer pixels; floating inputs whose dtype differs from the model's; inputs on another device
    than the model; NaN or ±inf values; samples whose attention mask is all zero (nothing to
    explain). ``primary`` names the explained input.
    """
    x = kwargs[primary]
    if x.dim() == 0:
        raise InputError(f"input '{primary}' is a scalar; it needs a batch dimension first")
    if x.shape[0] == 0:
        raise InputError(f"input '{primary}' is an empty batch (shape {tuple(x.shape)}): nothing to explain")
    param = _first_parameter(model)
    offloaded = offloaded_weights(model)  # accelerate's offloaded weights are meta tensors
    device = offloaded.device if offloaded is not None else (param.device if param is not None else None)
    embeddings = _input_embeddings(model)
    if primary == "input_ids" or (embeddings is not None and not x.is_floating_point()):
        kwargs[primary] = _check_token_ids(primary, x, embeddings)
    elif not x.is_floating_point() and x.dtype != torch.bool and _any_embedding(model) is not None:
        # integer ids under another name (Perceiver's text preprocessor takes `inputs`): the model has an
        # embedding table, but get_input_embeddings() does not name it; ids beyond every table are refused
        kwargs[primary] = _check_token_ids(primary, x, _any_embedding(model))
    elif not x.is_floating_point():
        raise InputError(f"input '{primary}' has dtype {x.dtype}; the model has no embedding table to look integer "
                         f"ids up in and takes floating-point values (e.g. normalized pixels): pass {primary}.float()")
    for name, v in kwargs.items():
        if not torch.is_tensor(v):
            continue
        if device is not None and v.device != device:
            where = "runs on" if offloaded is not None else "is on"
            raise InputError(f"input '{name}' is on {v.device} but the model {where} {device}: "
                             f"move one of them, e.g. inputs['{name}'].to('{device}')")
        if v.is_floating_point():
            if param is not None and param.is_floating_point() and v.dtype != param.dtype and name == primary:
                raise InputError(f"input '{name}' is {v.dtype} but the model's parameters are {param.dtype}: "
                                 f"pass {name}.to({param.dtype}) (or convert the model)")
            _check_finite(name, v)
        if name in PER_TOKEN_INPUTS and name != primary and not x.is_floating_point():
            if tuple(v.shape) != tuple(x.shape):
                raise InputError(f"input '{name}' has shape {tuple(v.shape)} but '{primary}' has shape "
                                 f"{tuple(x.shape)}; they must match (one entry per token)")
    mask = kwargs.get("attention_mask")
    if torch.is_tensor(mask) and mask.dim() == 2 and mask.shape[0] == x.shape[0]:
        def empty_rows(flags, _):
            rows = [i for i, f in enumerate(flags) if f]
            return InputError(f"sample(s) {rows} have an attention mask of all zeros (only padding): there is no "
                              "token to explain; drop those rows from the batch")
        refuse_if((mask == 0).all(dim=1), empty_rows)


def warn_left_padding(model: torch.nn.Module, kwargs: Dict[str, Any]) -> bool:
    """Warn (:class:`relprop.RelpropWarning`) when a causal decoder (GPT-2, LLaMA, ...: ``config.is_decoder``
    or a model that generates) is given a left-padded batch without ``position_ids``: HuggingFace decoders
    number positions 0..n-1 whatever the mask, so a left-padded text is not the computation it is alone and
    its explanation is not the text's. The mask is read with the call's other checks
    (:func:`relprop.graph.host_reads.later`); returns True when it was handed over (a causal decoder with a
    mask and no ``position_ids``)."""
    mask = kwargs.get("attention_mask")
    if not is_causal_decoder(model) or not torch.is_tensor(mask) or mask.dim() != 2 or "position_ids" in kwargs:
        return False
    m = mask != 0
    name = type(model).__name__

    def left_padded(flags):
        rows = [i for i, f in enumerate(flags) if f]
        if rows:
            warn(f"{name}: samples {rows} are left-padded; this decoder numbers positions 0..n-1 whatever the mask, "
                 "so a left-padded text is not computed as it is alone and its explanation is not the text's. Pad "
                 "on the right (tokenizer.padding_side = 'right') or pass position_ids")
    later((~m[:, 0]) & m.any(1), left_padded)
    return True


def _check_token_ids(name: str, ids: torch.Tensor, embeddings) -> torch.Tensor:
    """The ids to run with: ``ids``, after refusing ids outside the vocabulary (read with the call's other
    checks); on an accelerator, clamped into it until then (an id out of range there is a device-side
    assertion that leaves the device unusable, not an error relprop could report)."""
    if ids.is_floating_point() or ids.dtype == torch.bool:
        raise InputError(f"input '{name}' has dtype {ids.dtype}; token ids must be integers "
                         f"(e.g. a tokenizer's output, or {name}.long())")
    if ids.dim() == 1:
        raise InputError(f"input '{name}' has shape {tuple(ids.shape)}: it needs a batch dimension "
                         f"({name}[None] for one text, or the tokenizer's return_tensors='pt' output)")
    if ids.shape[-1] == 0:
        raise InputError(f"input '{name}' has shape {tuple(ids.shape)}: the texts have no token")
    n = getattr(embeddings, "num_embeddings", None)
    bounds = torch.stack([ids.min(), ids.max()])

    def outside(_, values):
        low, high = values
        bad = low if low < 0 else high
        return InputError(f"input '{name}' holds token id {bad}, outside the model's vocabulary of "
                          f"{n if n is not None else '?'} ids (0..{(n - 1) if n is not None else '?'}): "
                          "was it made by another model's tokenizer?")
    flag = bounds[0] < 0 if n is None else (bounds[0] < 0) | (bounds[1] >= n)
    refuse_if(flag, outside, bounds)
    if deferring() and ids.device.type != "cpu":
        return ids.clamp(0, None if n is None else n - 1)
    return ids


def _check_finite(name: str, v: torch.Tensor) -> None:
    bad = ~torch.isfinite(v.reshape(v.shape[0], -1) if v.dim() else v.reshape(1, 1))

    def non_finite(rows_bad, nan):
        rows = [i for i, f in enumerate(rows_bad) if f] if v.dim() else []
        kind = "NaN" if nan[0] else "inf"
        return InputError(f"input '{name}' contains {kind} values (sample(s) {rows}); relevance cannot be "
                          "computed from non-finite inputs: clean or drop those samples")
    refuse_if(bad.any(1), non_finite, torch.isnan(v).any().reshape(1))


def capture_checked(cache, model: torch.nn.Module, kwargs: Dict[str, Any], primary: str, events=None):
    """``cache.get(model, kwargs, primary, events)``; when the capture fails, tell a model that rejects
    its inputs (an :class:`InputError` with the model's own message) from a model torch.export cannot
    trace (the :class:`CaptureError` as raised)."""
    try:
        return cache.get(model, kwargs, primary, events)
    except CaptureError:
        problem = eager_failure(model, kwargs)
        if problem is not None:
            raise InputError(f"{type(model).__name__} cannot run on these inputs ({describe(kwargs)}): "
                             f"{problem}") from None
        raise


def eager_failure(model: torch.nn.Module, kwargs: Dict[str, Any]):
    """The model's own error message when it is called on ``kwargs`` (in eval mode, without
    gradients; every module's mode is restored), or None if the call succeeds."""
    try:
        with eval_mode(model), torch.no_grad():
            model(**kwargs)
    except Exception as e:  # noqa: BLE001 - any error of the model's forward is reported to the user
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return f"{type(e).__name__}: {first[:400]}"
    return None


def describe(kwargs: Dict[str, Any]) -> str:
    """``input_ids: int64 [2, 7], attention_mask: int64 [2, 7]`` for the error messages."""
    parts = []
    for k, v in kwargs.items():
        if torch.is_tensor(v):
            parts.append(f"{k}: {str(v.dtype).replace('torch.', '')} {list(v.shape)}")
    return ", ".join(parts)


def check_result(explanations: Iterable[Any]) -> None:
    """Raise :class:`RelpropError` if a result holds NaN or ±inf (never handed to the user); read with the
    call's other checks."""
    for exp in explanations:
        for field in ("scores", "map"):
            t = getattr(exp, field, None)
            if torch.is_tensor(t) and t.is_floating_point():
                def non_finite(_, scores, method=exp.method, field=field):
                    return RelpropError(
                        f"method '{method}' produced non-finite {field} on these inputs (target scores {scores}). "
                        "The model's own outputs may overflow in its dtype; try the model in float32. If they do "
                        "not, please report this as a relprop bug.")
                refuse_if(~torch.isfinite(t).all(), non_finite, exp.target_scores.detach().float())


def _first_parameter(model: torch.nn.Module):
    for p in model.parameters():
        return p
    return None


def _any_embedding(model: torch.nn.Module):
    """The largest ``nn.Embedding`` of the model (None without one): where integer inputs that are not
    called ``input_ids`` can be token ids."""
    tables = [m for m in model.modules() if isinstance(m, torch.nn.Embedding)]
    return max(tables, key=lambda m: m.num_embeddings) if tables else None


def _input_embeddings(model: torch.nn.Module):
    get = getattr(model, "get_input_embeddings", None)
    if callable(get):
        try:
            emb = get()
        except (NotImplementedError, AttributeError):
            return None
        return emb if isinstance(emb, torch.nn.Embedding) else None
    return None

