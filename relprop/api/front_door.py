"""The front door: :func:`explain` and :func:`coverage`.

Both check every argument first (:mod:`relprop.options`), then share one prologue
(:func:`prepare`): the model and inputs are checked, the inputs bound to the model's forward and the
graph captured (cached). :func:`explain` then runs the engine once per preset the methods need
(:mod:`relprop.engine`), applies each method (:mod:`relprop.methods`) and builds the Explanations
(:mod:`relprop.explanation`).
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Dict, List, Optional, Sequence

import torch

from . import options as opt
from . import raw_inputs, refusals, validation
from ..engine import FastPathUnavailable, Request, Trace, report, run, run_fast
from ..engine.coverage import Coverage
from ..errors import MethodError, OptionError, RelpropError, RelpropWarning
from ..explanation import build, mask_from_tokenizer, split_tokenizer_keys
from ..graph.capture import CACHE, Captured, CaptureEvent, capture_notes
from ..graph.inputs import bind_inputs, primary_input
from ..methods import MethodInfo, apply, fold_choice, fold_maps
from ..rules import get_preset
from ..rules.stabilize import DEFAULT_EPS
from ..targets.target_forms import specify
from ..targets import resolve

#: preset of the methods that do not name their own, when explain() is given none
DEFAULT_PRESET = "chefer2021"


@dataclasses.dataclass
class Prepared:
    """What the prologue of :func:`explain` and :func:`coverage` produced."""

    kwargs: Dict[str, Any]
    captured: Captured
    #: what getting the graph took (cached, a new input size, read from disk, exported)
    event: Optional[CaptureEvent] = None

    @property
    def batch(self) -> int:
        return self.kwargs[self.captured.primary].shape[0]


def prepare(model: torch.nn.Module, inputs: Any, wrt: Optional[str]) -> Prepared:
    """Check ``model`` and ``inputs``, bind the inputs to the model's forward, and capture the graph
    explained onto ``wrt`` (or the default input)."""
    validation.check_model(model)
    kwargs = bind_inputs(model, inputs)
    primary = primary_input(kwargs, wrt)
    validation.check_inputs(model, kwargs, primary)
    events: List[CaptureEvent] = []
    captured = validation.capture_checked(CACHE, model, kwargs, primary, events)
    return Prepared(kwargs, captured, events[0] if events else None)


def explain(model: torch.nn.Module, inputs: Any, target: Any = None, method: Any = "transformer_attribution",
            preset: Any = None, *, eps: float = DEFAULT_EPS, unsupported: str = "error",
            special_tokens_mask: Optional[torch.Tensor] = None, tokenizer: Any = None,
            fast_path: Optional[bool] = None, memory: str = "default", wrt: Optional[str] = None,
            image_processor: Any = None, keep_blocks: Optional[bool] = None, precision: str = "float32",
            records_budget: Optional[float] = None, **options):
    """Explain the score of class ``target`` of an unmodified ``model`` on ``inputs``.

    Captures the model's graph (``torch.export``, cached per model), runs it forward and back, walks
    relevance back through it with the rules of ``preset`` and aggregates the per-block records with
    ``method``; the default is Transformer Attribution (Chefer, Gur & Wolf, *Transformer
    Interpretability Beyond Attention Visualization*, CVPR 2021, Eq. 13-14). The model's parameters,
    buffers, mode and hooks are the same afterwards, also when this function raises.

    Parameters
    ----------
    model : a ``transformers`` or ``timm`` model (any ``nn.Module`` ``torch.export`` can capture), or a
        HuggingFace text/image classification or zero-shot ``pipeline`` (docs/inputs-and-targets.md).
    inputs : what the model's forward takes (a tensor, a tuple, a dict such as a tokenizer's output), or
        raw inputs: strings, PIL images or image paths (:mod:`relprop.raw_inputs`).
    target : None (the predicted class; a language model's next token), a class index or one per sample,
        a label name, :func:`relprop.contrast`, or a callable ``target(outputs) -> [batch]``.
    method : a name from ``relprop.methods()``, or a list of names sharing one forward pass.
    preset : relevance rules, a name from ``relprop.presets()`` or a :class:`relprop.Preset`; None: each
        method's own preset, else ``"chefer2021"``.
    eps : denominator stabilizer of the rules (finite, >= 0).
    unsupported : ``"error"`` refuses an op without a rule; ``"z_rule"`` gives it gradient x input.
    special_tokens_mask : [batch, positions] bool, True at positions left out of text scores; None: from
        the batch, ``tokenizer`` or the model's config (``exp.notes`` says which).
    tokenizer : tokenizes raw text, marks special tokens, turns string targets into token ids.
    fast_path : None takes AttnLRP/CP-LRP's one-backward form when it applies; True also warns when it
        does not; False always walks rule by rule (with the conservation ledger).
    memory : ``"default"``, ``"low"`` (block by block, lower peak, about one more forward pass) or
        ``"high"`` (keeps a memo of |W| with the model for later calls).
    wrt : name of the input to explain onto when the model takes several (CLIP: ``"pixel_values"``).
    image_processor : a HuggingFace image processor for raw images.
    keep_blocks : None keeps the per-block records while they fit ``records_budget`` and folds the
        rollout-style methods block by block beyond it; True always keeps them, False always folds.
    precision : ``"float32"`` evaluates a half-precision model in float32; ``"model"`` keeps its dtype.
    records_budget : bytes the kept records may take; None: 1 GiB or a quarter of the free memory.
    **options : method options (``start_block=``, ``normalize_rows=``, ...), each given to the methods
        that take it.

    Returns
    -------
    Explanation
        Scores per token or patch, the per-block records and the conservation ledger; a list of
        Explanations, one per method, when ``method`` is a list.

    Raises
    ------
    RelpropError
        Every error that leaves this function (its subclasses ``InputError``, ``TargetError``,
        ``MethodError``, ``UnsupportedOperation``, ... say what was wrong and what to do).

    Notes
    -----
    What each argument does in detail: docs/inputs-and-targets.md (inputs, targets, special tokens),
    docs/methods.md and docs/presets.md (methods, presets, ``fast_path``), docs/performance.md
    (``memory``, ``keep_blocks``, ``records_budget``, ``precision``), docs/models.md (``wrt``).

    Examples
    --------
    >>> exp = relprop.explain(model, tokenizer("a fine film", return_tensors="pt"), target="positive")
    >>> exp.scores          # [batch, tokens], special tokens and padding at 0
    >>> exps = relprop.explain(vit, pixels, method=["transformer_attribution", "rollout"])
    """
    model, inputs, tokenizer, target, wrt = raw_inputs.adapt(model, inputs, tokenizer, image_processor, target, wrt)
    infos, many = opt.check_methods(method)
    return _checked_explain(model, inputs, target, infos, many, preset, options, eps, unsupported,
                            special_tokens_mask, tokenizer, fast_path, memory, wrt, keep_blocks, precision,
                            records_budget)


def explain_settings(model: torch.nn.Module, inputs: Any, settings: Sequence[Dict[str, Any]], target: Any = None,
                     method: str = "transformer_attribution", preset: Any = None, *, eps: float = DEFAULT_EPS,
                     unsupported: str = "error", special_tokens_mask: Optional[torch.Tensor] = None,
                     tokenizer: Any = None, memory: str = "default", wrt: Optional[str] = None) -> list:
    """:func:`explain` of one ``method`` once per options dict of ``settings``, all from one
    forward/backward pass: the per-block records of one trace serve every setting (the survey's
    §1.4, aggregation as hyperparameters, evaluated by :func:`relprop.evaluation.tune`).

    Returns one :class:`relprop.Explanation` per setting, in order; each setting's options are
    checked as :func:`explain` checks them, all before any work.
    """
    infos, many = opt.check_methods(method)
    if many:
        raise MethodError(f"explain_settings explains one method, not {list(method)}")
    settings = [dict(s) for s in settings]
    if not settings:
        raise OptionError("settings=[] names no setting; give at least one options dict ({} for the defaults)")
    return _checked_explain(model, inputs, target, infos * len(settings), True, preset, settings, eps, unsupported,
                            special_tokens_mask, tokenizer, None, memory, wrt)


def _checked_explain(model, inputs, target, infos, many, preset, options, eps, unsupported, special_tokens_mask,
                     tokenizer, fast_path, memory, wrt, keep_blocks=True, precision="float32", records_budget=None):
    """The shared body of :func:`explain` and :func:`explain_settings`: ``options`` is the method
    options (a dict), or one dict per entry of ``infos`` (settings of one method)."""
    preset = opt.check_preset(preset)
    for info in infos:
        if info.preset:
            get_preset(info.preset)
    opt.check_arguments(eps=eps, unsupported=unsupported, memory=memory, fast_path=fast_path,
                        keep_blocks=keep_blocks, precision=precision, records_budget=records_budget)
    inputs, batch_mask = split_tokenizer_keys(inputs)
    mask_source = "special_tokens_mask=" if special_tokens_mask is not None else "the batch's special_tokens_mask"
    special_tokens_mask = opt.check_special_tokens_mask(special_tokens_mask if special_tokens_mask is not None
                                                        else batch_mask)
    if isinstance(options, dict):
        per_method = opt.method_options(infos, options, many)
        jobs = [(i, per_method[i.name]) for i in infos]
    else:
        jobs = [(i, opt.method_options([i], o, False)[i.name]) for i, o in zip(infos, options)]
    prepared = prepare(model, inputs, wrt)
    validation.warn_left_padding(model, prepared.kwargs)
    if special_tokens_mask is None and tokenizer is not None:
        ids = prepared.kwargs[prepared.captured.primary]
        if torch.is_tensor(ids) and not ids.is_floating_point():
            special_tokens_mask = mask_from_tokenizer(tokenizer, ids)
            mask_source = f"tokenizer= ({type(tokenizer).__name__}'s special ids)"
    try:
        return _explain(model, prepared, target, jobs, many, preset,
                        dict(eps=eps, unsupported=unsupported, memory=memory, fast_path=fast_path,
                             keep_blocks=keep_blocks, precision=precision, records_budget=records_budget),
                        (special_tokens_mask, mask_source), tokenizer)
    except RelpropError:
        raise
    except Exception as e:  # noqa: BLE001 - every error that leaves explain() is a RelpropError
        raise RelpropError(f"relprop could not explain {type(model).__name__} with "
                           f"{sorted({i.name for i in infos})}: {type(e).__name__}: {str(e).strip()[:600]}. This is "
                           "relprop's failure, not yours: please report it with the model's name and this "
                           "message") from e


def _explain(model, prepared: "Prepared", target, jobs, many, preset, engine_options, special, tokenizer=None):
    """The body of :func:`explain` once every argument is checked and the graph captured."""
    special_tokens_mask, mask_source = special
    fast_path = engine_options.pop("fast_path")
    keep_blocks, budget = engine_options.pop("keep_blocks"), engine_options.pop("records_budget")
    # every form of target= through one path per head, with the mask of the output's positions: target_forms
    target = specify(target, model, tokenizer, prepared.kwargs)
    request = Request(prepared.captured, model, prepared.kwargs, resolve(target, prepared.batch,
                                                                          prepared.captured.primary),
                      **engine_options)
    runs = len({_preset_of(i, preset) for i, _ in jobs if i.needs_relevance})
    fold, note = fold_choice.choose(jobs, prepared.captured.analysis, prepared.batch,
                                    prepared.kwargs[prepared.captured.primary].device, keep_blocks, budget, runs)
    results = None
    if fold:
        try:
            results = _explain_folded(request, jobs, preset, special, note)
        except MethodError:  # refused: the full-record path below says why, with the methods that apply (refusals.py)
            note = ("not folded block by block (the folded path refused these inputs); the full-record path ran "
                    "and exp.blocks holds every block's records")
    if results is None:
        traces = _run_engine([i for i, _ in jobs], request, preset, fast_path)
        results = []
        for info, options in jobs:
            key = _preset_of(info, preset) if info.needs_relevance else next(iter(traces))
            trace = traces[key]
            try:
                out = apply(info, trace, options, key, type(model).__name__)
                results.append(build(info, key or preset, out, trace, special_tokens_mask, mask_source))
            except MethodError as e:  # a refusal names only the methods that run on this model
                name = type(model).__name__
                raise refusals.with_applicable(e, refusals.applicable(info.name, trace, preset, name, key),
                                               name) from None
            if note is not None:
                results[-1].notes.append(note)
    validation.check_result(results)
    for r in results:
        r.notes.extend(capture_notes(prepared.event, prepared.captured, type(model).__name__))
    return results if many else results[0]


def _explain_folded(request: Request, jobs, preset: Optional[str], special, note: Optional[str] = None) -> list:
    """``keep_blocks=False``: one folded run per preset the methods need (gradient-only methods ride
    on the first), each method a :class:`relprop.methods.fold_maps.RowFold` fed block by block from
    the output back; the Explanations have no ``blocks`` or ``matrix`` (:class:`NotKept`)."""
    a = request.captured.analysis
    mask = request.kwargs.get("attention_mask")
    keys = [_preset_of(info, preset) if info.needs_relevance else None for info, _ in jobs]
    folds = [fold_maps.RowFold(info, options, len(a.blocks), mask, key, a.token_mixing)
             for (info, options), key in zip(jobs, keys)]
    wanted = list(dict.fromkeys(k for k in keys if k is not None)) or [None]
    keys = [k if k is not None else wanted[0] for k in keys]
    outputs = {}
    for p in wanted:
        mine = [i for i, k in enumerate(keys) if k == p]
        req = request.but(preset=p or preset or DEFAULT_PRESET, relevance=p is not None,
                          folds=tuple(folds[i] for i in mine))
        trace = run(req)
        trace.notes.append(note or "keep_blocks=False: each attention block was folded into the scores during the "
                           "reverse walk and its records dropped (exp.blocks and exp.matrix are not kept)")
        for i, out in zip(mine, trace.folded):
            outputs[i] = (out, trace, p)
    special_tokens_mask, mask_source = special
    return [build(info, key or preset, outputs[j][0], outputs[j][1], special_tokens_mask, mask_source)
            for j, ((info, _), key) in enumerate(zip(jobs, keys))]


def _preset_of(info: MethodInfo, preset: Optional[str]) -> str:
    """An explicit preset wins over the method's own, which wins over :data:`DEFAULT_PRESET`."""
    return preset if preset is not None else (info.preset or DEFAULT_PRESET)


def _run_engine(infos: List[MethodInfo], request: Request, preset: Optional[str],
                fast_path: Optional[bool]) -> Dict[Optional[str], Trace]:
    """One trace per preset whose relevance the methods need (gradient-only methods reuse any); the
    one-backward fast path when every method reads only the input relevance."""
    wanted = list(dict.fromkeys(_preset_of(i, preset) for i in infos if i.needs_relevance))
    input_only = all(i.needs_relevance and not i.needs_blocks for i in infos)
    request = request.but(input_gradient=any(i.needs_input_gradient for i in infos))
    traces: Dict[Optional[str], Trace] = {}
    for p in wanted:
        note = None
        if fast_path is not False and input_only:
            try:
                traces[p] = run_fast(request.but(preset=p))
                continue
            except FastPathUnavailable as why:
                note = (f"the one-backward fast path was not taken under preset '{p}' ({why}); the graph was "
                        "walked rule by rule instead (same relevance, slower)")
                if fast_path is True:
                    warnings.warn(note, RelpropWarning, stacklevel=3)
        traces[p] = run(request.but(preset=p))
        if note is not None:
            traces[p].notes.append(note)
    if not traces:
        traces[None] = run(request.but(preset=preset or DEFAULT_PRESET, relevance=False))
    return traces


def coverage(model: torch.nn.Module, inputs: Any, preset: Any = "chefer2021", *, wrt: Optional[str] = None) -> Coverage:
    """Every op of ``model``'s captured graph on ``inputs`` and how ``preset`` handles it.

    Parameters
    ----------
    model, inputs, wrt : as for :func:`explain` (the capture is shared with it and cached; the
        model is not modified and nothing is run but the capture).
    preset : the rules to report, a name or a :class:`relprop.Preset` (``relprop.presets()`` lists them).

    Returns
    -------
    Coverage : ``print(report)`` shows every op with its module path and handling (rule and preset,
        shape-only, missing, ...), the attention blocks found and a summary; ``report.missing`` lists
        the ops explain() has no rule for, ``report.complete`` is True when there are none.
    """
    name = opt.check_preset(preset)
    if name is None:
        name = DEFAULT_PRESET
    prepared = prepare(model, inputs, wrt)
    return report(prepared.captured, name, type(model).__name__)
