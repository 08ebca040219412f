"""The front door: :func:`explain`."""
from __future__ import annotations

import inspect
from typing import Any, Optional

import torch
import torch.nn.functional as F

from . import targets as _targets
from . import validation
from .errors import MethodError, OptionError, RelpropError
from .explanation import Explanation
from .graph.capture import CACHE
from .graph.inputs import bind_inputs, with_wrt
from .graph.interpreter import MEMORY_MODES, run
from .graph.modified_gradient import FastPathUnavailable, run_fast
from .methods import get_method
from .rules.registry import get_preset
from .rules.stabilize import DEFAULT_EPS

#: preset of the methods that do not name their own, when explain() is given none
DEFAULT_PRESET = "chefer2021"


@with_wrt  # adds wrt=None: the input to explain onto (relprop.graph.inputs.explaining_wrt)
def explain(model: torch.nn.Module, inputs: Any, target: Any = None, method: str = "transformer_attribution",
            preset: Optional[str] = None, *, eps: float = DEFAULT_EPS, unsupported: str = "error",
            special_tokens_mask: Optional[torch.Tensor] = None, fast_path: bool = True, memory: str = "default",
            **options):
    """Explain the score of class ``target`` of an unmodified ``model`` on ``inputs``.

    Parameters
    ----------
    model : a HuggingFace ``transformers`` or ``timm`` model (or any ``nn.Module`` that
        ``torch.export`` can capture). It is not modified; its parameters, buffers, mode and hooks
        are the same afterwards, also when this function raises.
    inputs : what the model's forward takes: a tensor (pixels), a tuple of positional arguments,
        or a dict of tensors such as a tokenizer's output.
    target : None (each sample's predicted class), an int, one int per sample, a callable
        ``target(outputs) -> [batch]`` scores, or ``"next_token"`` for a language model (the
        predicted next token's logit at the last non-padding position, :func:`relprop.targets.next_token`).
    method : an explanation method (``relprop.methods()`` lists them), or a list of methods: they
        share one forward pass (and one relevance pass per preset) and a list of Explanations is
        returned. Default: the paper's Transformer Attribution (Chefer et al., CVPR 2021, Eq. 13–14).
    preset : the relevance rules (``relprop.presets()`` lists them): ``"chefer2021"`` (the paper's
        rules as its authors' code applies them), ``"lrp"`` (the plain-LRP baseline, not
        conservative), ``"attnlrp"`` (Achtibat et al., ICML 2024), ``"cp_lrp"`` (Ali et al., ICML
        2022). Default None: each method's own preset (``"lrp"`` for the LRP baselines), else
        ``"chefer2021"``. An explicit preset applies to every method, e.g.
        ``method="lrp", preset="attnlrp"`` is AttnLRP's input relevance.
    eps : denominator stabilizer of the rules.
    unsupported : ``"error"`` (default) raises :class:`relprop.UnsupportedOperation` for an op
        with no rule; ``"z_rule"`` applies the generic gradient × input rule to such ops.
    special_tokens_mask : [batch, positions] bool, True at positions to exclude from text scores.
        Default: padding and the ids the model's config names as special (cls/sep/bos/eos/pad).
    fast_path : when every method only reads the input relevance (``"lrp"``) and the preset's
        rules have modified-gradient forms (``"attnlrp"``, ``"cp_lrp"``), compute it with one
        backward pass (:mod:`relprop.graph.modified_gradient`); the Explanation then has no
        per-block records and ``conservation`` is None. False: always walk the graph rule by rule
        (the reference, with the conservation bookkeeping).
    memory : ``"default"`` keeps the forward values the rules read from one forward pass (the
        attention scores, masks and softmax are computed again during the walk rather than kept).
        ``"low"`` bounds the peak for long inputs: a forward pass without autograd keeps only the
        hidden states between attention blocks, then each block is recomputed, from the output
        back, for its gradients and its part of the relevance walk, and freed; the memo of split
        weights is not kept. Same results (to float rounding of the gradients), about one more
        forward pass of time plus the weight splits; the peak holds the block records (A, dA, R_A)
        and one block. Window attention (Swin) falls back to ``"default"`` with a warning.
        ``"high"`` is ``"default"`` plus a memo, kept with the model (one per model, shared by all
        input shapes) for the next calls, of the positive and negative parts of every linear weight
        that the alpha1-beta0 rule splits (Eq. 5): 2x the linear weights in float32 (~680 MiB for
        BERT-base), saving the splits' time on every later call. ``"default"`` splits each weight
        when the walk reaches it and drops the split at once.
    wrt : the input to explain onto, by name, when the model takes several (default: the first of
        ``input_ids``, ``pixel_values``, ``inputs_embeds``, ...). For a CLIP model,
        ``wrt="pixel_values"`` explains the image tower and ``wrt="input_ids"`` (the default) the
        text tower; the other tower is then a constant of the explanation.
    **options : options of the method (e.g. ``start_block=``, ``normalize_rows=``). With several
        methods, each option goes to the methods that take it.

    Returns
    -------
    Explanation (or a list of them, one per method, when ``method`` is a list)
    """
    if memory not in MEMORY_MODES:
        raise OptionError(f"memory={memory!r} is not a choice here. Choices: {list(MEMORY_MODES)}")
    many = isinstance(method, (list, tuple))
    names = list(method) if many else [method]
    if not names:
        raise MethodError("method=[] names no method")
    infos = [get_method(m) for m in names]
    if preset is not None:
        get_preset(preset)
    for info in infos:
        if info.preset:
            get_preset(info.preset)
        _check_options(info, options, many)

    def preset_of(info):  # an explicit preset wins over the method's own
        return preset if preset is not None else (info.preset or DEFAULT_PRESET)

    validation.check_model(model)
    kwargs = bind_inputs(model, inputs)
    validation.check_inputs(model, kwargs)
    captured = validation.capture_checked(CACHE, model, kwargs)
    batch = kwargs[captured.primary].shape[0]
    if isinstance(target, str) and target == "next_token":  # language models: see targets.next_token
        target = _targets.next_token(kwargs.get("attention_mask"))
    score_fn, target_of = _targets.resolve(target, batch)
    # one pass per preset whose relevance is needed; gradient-only methods reuse any pass
    wanted = list(dict.fromkeys(preset_of(i) for i in infos if i.needs_relevance))
    # the one-backward fast path, when only the input relevance is read (relprop.graph.modified_gradient)
    input_only = all(i.needs_relevance and not i.needs_blocks for i in infos)
    traces = {}
    for p in wanted:
        if fast_path and input_only:
            try:
                traces[p] = run_fast(captured, model, kwargs, score_fn, preset=p, eps=eps, target_of=target_of)
                continue
            except FastPathUnavailable:
                pass  # the interpreter below is the reference for every preset
        traces[p] = run(captured, model, kwargs, score_fn, preset=p, relevance=True, eps=eps,
                        unsupported=unsupported, target_of=target_of, memory=memory)
    if not traces:
        traces[None] = run(captured, model, kwargs, score_fn, preset=preset or DEFAULT_PRESET, relevance=False,
                           eps=eps, unsupported=unsupported, target_of=target_of, memory=memory)
    results = []
    for info in infos:
        key = preset_of(info) if info.needs_relevance else next(iter(traces))
        trace = traces[key]
        opts = _options_for(info, options)
        if info.needs_blocks and not trace.blocks:
            from .methods import all_methods
            usable = sorted(n for n, m in all_methods().items() if not m.needs_blocks)
            raise MethodError(f"method '{info.name}' reads the attention blocks, and no attention blocks (a softmax "
                              f"whose output multiplies the values) were found in {type(model).__name__}'s graph. "
                              f"Methods that apply without attention: {usable}")
        if info.needs_relevance and info.needs_blocks and any(b.relevance is None for b in trace.blocks):
            raise MethodError(f"method '{info.name}' reads the relevance of the attention maps (R_A), and preset "
                              f"'{key}' gives them none (CP-LRP holds the attention constant). Use preset "
                              f"'attnlrp' or 'chefer2021' for it, or method 'lrp' for the input relevance.")
        if getattr(trace, "stages", None) is not None:  # window attention (Swin)
            from .methods.windowed import check_applicable
            check_applicable(info, model)
        out = info.fn(trace, **opts)
        results.append(_package(info, key or preset, out, trace, kwargs, captured, model, special_tokens_mask))
    validation.check_result(results)
    return results if many else results[0]


def _check_options(info, options, many):
    valid = _option_names(info)
    if many:
        return
    for k in options:
        if k not in valid:
            raise MethodError(f"'{k}' is not an option of method '{info.name}'. Options: {sorted(valid) or 'none'}")


def _option_names(info):
    return [p for p in inspect.signature(info.fn).parameters if p != "trace"]


def _options_for(info, options):
    valid = _option_names(info)
    return {k: v for k, v in options.items() if k in valid}


SPECIAL_ID_FIELDS = ("cls_token_id", "sep_token_id", "bos_token_id", "eos_token_id", "pad_token_id")


def special_positions(model, kwargs, primary, shape, device, special_tokens_mask=None):
    """[batch, positions] bool: padding, and tokens whose id the config names as special."""
    special = torch.zeros(shape, dtype=torch.bool, device=device)
    am = kwargs.get("attention_mask")
    if torch.is_tensor(am) and tuple(am.shape) == tuple(shape):
        special |= am.to(device) == 0
    ids = kwargs.get(primary)
    cfg = getattr(model, "config", None)
    if special_tokens_mask is not None:
        m = torch.as_tensor(special_tokens_mask, device=device).bool()
        if tuple(m.shape) != tuple(shape):
            raise RelpropError(f"special_tokens_mask has shape {tuple(m.shape)}, expected {tuple(shape)}")
        special |= m
    elif torch.is_tensor(ids) and not ids.is_floating_point() and cfg is not None:
        for tid in special_ids(cfg):
            special |= ids.to(device) == tid
    return special


_SPECIAL_IDS = {}


def special_ids(cfg) -> set:
    """Special token ids of a model: those its config names, plus, when the model was loaded from a
    local folder that holds its tokenizer, the tokenizer's ``all_special_ids`` (read offline)."""
    ids = {getattr(cfg, f) for f in SPECIAL_ID_FIELDS if isinstance(getattr(cfg, f, None), int)}
    path = getattr(cfg, "_name_or_path", "") or ""
    import os
    if path and os.path.isdir(path):
        if path not in _SPECIAL_IDS:
            try:
                from transformers import AutoTokenizer
                _SPECIAL_IDS[path] = set(AutoTokenizer.from_pretrained(path, local_files_only=True).all_special_ids)
            except Exception:  # noqa: BLE001 - no tokenizer there: config ids only
                _SPECIAL_IDS[path] = set()
        ids |= _SPECIAL_IDS[path]
    return ids


def _package(info, preset, result, trace, kwargs, captured, model, special_tokens_mask) -> Explanation:
    tokens = result.get("tokens")
    if tokens is not None and getattr(trace, "stages", None) is not None:  # Swin: a stage's tokens → patch grid
        tokens = trace.stages.lift(tokens)
    pixels = result.get("pixels")
    mask = None
    scores = tokens
    smap = None
    prefix = 0
    if trace.modality == "vision" and trace.grid is not None:
        gh, gw = trace.grid
        image = kwargs[captured.primary]
        if pixels is not None:
            smap = pixels.float()
            scores = _patch_sums(smap, gh, gw)
            if tokens is not None:
                prefix = tokens.shape[-1] - gh * gw
        else:
            n = tokens.shape[-1]
            prefix = n - gh * gw
            if prefix < 0:
                raise RelpropError(f"{n} tokens cannot hold a {gh}x{gw} patch grid")
            scores = tokens[:, prefix:]
            smap = F.interpolate(scores.reshape(-1, 1, gh, gw).float(), size=tuple(image.shape[-2:]),
                                 mode="bilinear", align_corners=False)[:, 0]
        mask = torch.ones_like(scores, dtype=torch.bool)
    elif trace.modality == "text":
        special = special_positions(model, kwargs, captured.primary, tuple(scores.shape), scores.device,
                                    special_tokens_mask)
        mask = ~special
        scores = torch.where(mask, scores, torch.zeros((), dtype=scores.dtype, device=scores.device))
    return Explanation(method=info.name, scores=scores, map=smap, mask=mask, matrix=result.get("matrix"),
                       blocks=trace.blocks, target=trace.target, target_scores=trace.target_scores,
                       conservation=trace.conservation, input_relevance=trace.input_relevance,
                       logits=trace.logits, preset=preset if info.needs_relevance else None,
                       modality=trace.modality, grid=trace.grid, prefix_tokens=prefix, outputs=trace.outputs,
                       signed=info.signed, class_specific=info.class_specific)


def _patch_sums(pixel_map: torch.Tensor, gh: int, gw: int) -> torch.Tensor:
    """Sum a [batch, H, W] map over the cells of a gh x gw patch grid -> [batch, gh*gw]."""
    b, h, w = pixel_map.shape
    if h % gh == 0 and w % gw == 0:
        cells = pixel_map.reshape(b, gh, h // gh, gw, w // gw).sum((2, 4))
    else:
        cells = F.adaptive_avg_pool2d(pixel_map[:, None], (gh, gw))[:, 0] * (h * w / (gh * gw))
    return cells.reshape(b, gh * gw)
