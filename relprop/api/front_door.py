"""The front door: :func:`explain` and :func:`coverage`.

Both check every argument first (``relprop.api.options``), then share one prologue (``prepare``: inputs
checked and bound to the model's forward, graph captured and cached). ``explain`` checks everything once
into a frozen ``Call`` (the resolved Preset, each method's options, the engine options), which flows down
unchanged: one engine run per preset the methods need (``Call.request``), the methods applied and the
Explanations built.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from . import options as opt
from . import (qwen_images, raw_inputs, refusals, remembered, remembered_prompt, validation, vision_language,
               vlm_anyres, vlm_tiles)
from ..engine import FastPathUnavailable, Request, Trace, fast_memory, run, run_fast, run_fast_low
from ..errors import MethodError, OptionError, RelpropError, warn
from ..graph import progress_line
from ..explanation import build, mask_from_tokenizer, split_tokenizer_keys
from ..graph.capture import CACHE, Captured, CaptureEvent, capture_notes
from ..graph.inputs import bind_inputs, primary_input
from ..methods import apply, fold_choice, fold_maps
from ..rules import Preset, get_preset
from ..rules.stabilize import DEFAULT_EPS
from ..targets.target_forms import specify
from ..targets import Target, resolve
from .options import DEFAULT_PRESET, Job

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


@dataclasses.dataclass(frozen=True)
class Call:
    """One call of ``explain`` / ``explain_settings``, every argument checked, flowing down unchanged.

    Attributes
    ----------
    model, prepared : the model, and its inputs bound and its graph captured (:func:`prepare`).
    target : what is explained (:class:`relprop.targets.Target`, every form of ``target=`` resolved).
    jobs : the methods, each with its options and the :class:`relprop.rules.Preset` it reads
        (:class:`relprop.api.options.Job`); ``many``: a list of Explanations is returned.
    preset : the preset asked for (None: each method's own); ``fallback``: the preset of a run that
        reads no relevance (``preset``, else :data:`DEFAULT_PRESET`).
    special_tokens_mask, mask_source : positions left out of text scores, and where they came from.
    eps, unsupported, memory, precision : the engine options (:class:`relprop.engine.Request`).
    fast_path, keep_blocks, records_budget : how the engine is run (see :func:`explain`).
    tokenizer, image_processor, given_target, spec, encodings : what the Explanations remember to draw
        themselves (``relprop.api.remembered``): tokenizer, image processor, ``target=`` as given and as
        specified, a fast tokenizer's ``BatchEncoding.encodings`` (token strings without ``tokenizer=``).
    """

    model: torch.nn.Module
    prepared: Prepared
    target: Target
    jobs: Tuple[Job, ...]
    many: bool
    preset: Optional[Preset]
    fallback: Preset
    special_tokens_mask: Optional[torch.Tensor]
    mask_source: str
    eps: float
    unsupported: str
    memory: str
    precision: str
    fast_path: Optional[bool]
    keep_blocks: Optional[bool]
    records_budget: Optional[float]
    tokenizer: Any = None
    image_processor: Any = None
    given_target: Any = None
    spec: Any = None
    encodings: Any = None
    tile_grid: Any = None  # (rows, cols) of a tiled vision-language model's image (relprop.api.vlm_tiles)

    def request(self, preset: Preset, **fields) -> Request:
        """The engine's Request for one run under ``preset`` (``fields``: ``relevance``,
        ``input_gradient``, ``stream``)."""
        return Request(self.prepared.captured, self.model, self.prepared.kwargs, self.target, preset=preset,
                       eps=self.eps, unsupported=self.unsupported, memory=self.memory, precision=self.precision,
                       **fields)


def explain(model: torch.nn.Module, inputs: Any, target: Any = None, method: Any = "transformer_attribution",
            preset: Any = None, *, eps: float = DEFAULT_EPS, unsupported: str = "error",
            special_tokens_mask: Optional[torch.Tensor] = None, tokenizer: Any = None,
            fast_path: Optional[bool] = None, memory: str = "default", wrt: Optional[str] = None,
            image_processor: Any = None, keep_blocks: Optional[bool] = None, precision: str = "float32",
            records_budget: Optional[float] = None, progress: Optional[bool] = None, **options):
    """Explain the score of class ``target`` of an unmodified ``model`` on ``inputs``.

    Captures the model's graph (``torch.export``, cached per model), runs it forward and back, walks
    relevance back through it with the rules of ``preset`` and aggregates the per-block records with
    ``method``; the default is Transformer Attribution (Chefer, Gur & Wolf, *Transformer
    Interpretability Beyond Attention Visualization*, CVPR 2021, Eq. 13-14). The model's parameters,
    buffers, mode and hooks are the same afterwards, also when this function raises.

    Parameters
    ----------
    model
        a ``transformers`` or ``timm`` model (any ``nn.Module`` ``torch.export`` can capture), or a
        HuggingFace text/image classification or zero-shot ``pipeline`` (docs/inputs-and-targets.md).
    inputs
        what the model's forward takes (a tensor, a tuple, a dict such as a tokenizer's output), or
        raw inputs: strings, PIL images or image paths (``relprop.api.raw_inputs``).
    target
        None (the predicted class; a language model's next token), a class index or one per sample,
        a label name, ``relprop.contrast``, or a callable ``target(outputs) -> [batch]``.
    method
        a name from ``relprop.methods()``, or a list of names sharing one forward pass.
    preset
        relevance rules, a name from ``relprop.presets()`` or a ``relprop.Preset``; None: each
        method's own preset, else ``"chefer2021"``.
    eps
        denominator stabilizer of the rules (finite, >= 0).
    unsupported
        ``"error"`` refuses an op without a rule; ``"z_rule"`` gives it gradient x input.
    special_tokens_mask
        [batch, positions] bool, True at positions left out of text scores; None: from
        the batch, ``tokenizer`` or the model's config (``exp.notes`` says which).
    tokenizer
        tokenizes raw text, marks special tokens, turns string targets into token ids.
    fast_path
        None takes AttnLRP/CP-LRP's one-backward form when it applies; True also warns when it
        does not; False always walks rule by rule (with the conservation ledger).
    memory
        ``"default"``, ``"low"`` (block by block, lower peak, about one more forward pass; on the
        fast path also the attention cores in chunks of query rows) or ``"high"`` (keeps a memo
        of |W| with the model for later calls).
    wrt
        name of the input to explain onto when the model takes several (CLIP: ``"pixel_values"``).
    image_processor
        a HuggingFace image processor for raw images.
    keep_blocks
        None keeps the per-block records while they fit ``records_budget`` and folds the
        rollout-style methods block by block beyond it; True always keeps them, False always folds.
    precision
        ``"float32"`` evaluates a half-precision model in float32; ``"model"`` keeps its dtype.
    records_budget
        bytes the kept records may take; None: 1 GiB or a quarter of the free memory.
    progress
        a progress line on stderr once the call has lasted 2 s (first capture, many methods, SmoothGrad's
        samples); None: as ``RELPROP_PROGRESS`` says, else when stderr is a terminal. It changes no result.
    **options
        method options (``start_block=``, ``normalize_rows=``, ...), each given to the methods that take it.

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
    opt.check_progress(progress)
    with progress_line.line(f"explaining {type(model).__name__}", progress):
        given_target = target
        if raw_inputs.is_pipeline(model) and image_processor is None:
            image_processor = getattr(model, "image_processor", None)
        model, inputs, tokenizer, target, wrt = raw_inputs.adapt(model, inputs, tokenizer, image_processor, target, wrt)
        infos, many = opt.check_methods(method)
        preset = opt.check_preset(preset)
        per_method = opt.method_options(infos, options, many)
        jobs = opt.check_jobs([(i, per_method[i.name]) for i in infos], preset)
        call = _check(model, inputs, target, jobs, many, preset, tokenizer=tokenizer,
                      special_tokens_mask=special_tokens_mask, wrt=wrt, eps=eps, unsupported=unsupported, memory=memory,
                      fast_path=fast_path, keep_blocks=keep_blocks, precision=precision, records_budget=records_budget,
                      image_processor=image_processor, given_target=given_target)
        with _reported(call.model, call.jobs):
            return _explain(call)


def explain_settings(model: torch.nn.Module, inputs: Any, settings: Sequence[Dict[str, Any]], target: Any = None,
                     method: str = "transformer_attribution", preset: Any = None, *, eps: float = DEFAULT_EPS,
                     unsupported: str = "error", special_tokens_mask: Optional[torch.Tensor] = None,
                     tokenizer: Any = None, memory: str = "default", wrt: Optional[str] = None) -> list:
    """``explain`` of one ``method`` once per options dict of ``settings``, all from one
    forward/backward pass: the per-block records of one trace serve every setting (the survey's
    §1.4, aggregation as hyperparameters, evaluated by ``relprop.evaluation.tune``).

    Returns one ``relprop.Explanation`` per setting, in order; each setting's options are
    checked as ``explain`` checks them, all before any work.
    """
    infos, many = opt.check_methods(method)
    if many:
        raise MethodError(f"explain_settings explains one method, not {list(method)}")
    settings = [dict(s) for s in settings]
    if not settings:
        raise OptionError("settings=[] names no setting; give at least one options dict ({} for the defaults)")
    preset = opt.check_preset(preset)
    info = infos[0]
    jobs = opt.check_jobs([(info, opt.method_options(infos, s, False)[info.name]) for s in settings], preset)
    call = _check(model, inputs, target, jobs, True, preset, tokenizer=tokenizer,
                  special_tokens_mask=special_tokens_mask, wrt=wrt, eps=eps, unsupported=unsupported, memory=memory,
                  fast_path=None, keep_blocks=True, precision="float32", records_budget=None)
    with _reported(call.model, call.jobs):
        return _explain(call)


def _check(model, inputs, target, jobs: Tuple[Job, ...], many: bool, preset: Optional[Preset], *, tokenizer,
           special_tokens_mask, wrt, eps, unsupported, memory, fast_path, keep_blocks, precision,
           records_budget, image_processor=None, given_target=None) -> Call:
    """The :class:`Call` of :func:`explain` and :func:`explain_settings`: the engine options and
    the special-tokens mask checked, the inputs prepared (:func:`prepare`) and the target resolved
    (the methods and their presets are checked already: ``jobs``)."""
    opt.check_arguments(eps=eps, unsupported=unsupported, memory=memory, fast_path=fast_path,
                        keep_blocks=keep_blocks, precision=precision, records_budget=records_budget)
    encodings = getattr(inputs, "encodings", None)  # a fast tokenizer's output knows its token strings
    inputs, batch_mask = split_tokenizer_keys(inputs)
    inputs, tile_grid = vlm_tiles.split_grid_keys(model, inputs)
    vlm_tiles.check(model, inputs, tile_grid)  # a tile layout relprop cannot verify is refused before any work
    inputs = vlm_anyres.plain_sizes(model, inputs)  # LLaVA-NeXT: checked, image_sizes as ints (traceable)
    mask_source = "special_tokens_mask=" if special_tokens_mask is not None else "the batch's special_tokens_mask"
    special_tokens_mask = opt.check_special_tokens_mask(special_tokens_mask if special_tokens_mask is not None
                                                        else batch_mask)
    wrt = vision_language.explained_input(model, inputs, [j.info for j in jobs], wrt)
    model, inputs = qwen_images.explained_call(model, inputs)  # Qwen-VL: one image as pixels [1, C, H, W]
    prepared = prepare(model, inputs, wrt)
    validation.warn_left_padding(model, prepared.kwargs)
    if special_tokens_mask is None and tokenizer is not None:
        ids = prepared.kwargs[prepared.captured.primary]
        if torch.is_tensor(ids) and not ids.is_floating_point():
            special_tokens_mask = mask_from_tokenizer(tokenizer, ids)
            mask_source = f"tokenizer= ({type(tokenizer).__name__}'s special ids)"
    with _reported(model, jobs):
        # every form of target= through one path per head, with the mask of the output's positions: target_forms
        spec = specify(target, model, tokenizer, prepared.kwargs)
        resolved = resolve(spec, prepared.batch, prepared.captured.primary)
    return Call(model, prepared, resolved, jobs, many, preset, preset if preset is not None else get_preset(
        DEFAULT_PRESET), special_tokens_mask, mask_source, eps, unsupported, memory, precision, fast_path,
        keep_blocks, records_budget, tokenizer, image_processor, given_target if given_target is not None
        else target, spec, encodings, tile_grid)


@contextlib.contextmanager
def _reported(model, jobs: Tuple[Job, ...]):
    """Every error that leaves :func:`explain` is a :class:`RelpropError`: one that is not is
    relprop's failure, reported as such with the model and the methods."""
    try:
        yield
    except RelpropError:
        raise
    except Exception as e:  # noqa: BLE001 - every error that leaves explain() is a RelpropError
        raise RelpropError(f"relprop could not explain {type(model).__name__} with "
                           f"{sorted({j.info.name for j in jobs})}: {type(e).__name__}: {str(e).strip()[:600]}. "
                           "This is relprop's failure, not yours: please report it with the model's name and this "
                           "message") from e


def _label(key: Optional[Preset], call: Call) -> Optional[str]:
    """The preset an Explanation names: the one its relevance came from, else the call's (None: none)."""
    p = key if key is not None else call.preset
    return p.name if p is not None else None


def _explain(call: Call):
    """The body of :func:`explain` once every argument is checked into ``call``."""
    captured, batch, model_name = call.prepared.captured, call.prepared.batch, type(call.model).__name__
    pairs = [(j.info, j.options) for j in call.jobs]
    runs = len({j.preset for j in call.jobs if j.preset is not None})
    fold, note = fold_choice.choose(pairs, captured.analysis, batch, call.prepared.kwargs[captured.primary].device,
                                    call.keep_blocks, call.records_budget, runs)
    results = None
    if fold:
        try:
            results = _explain_folded(call, note)
        except MethodError:  # refused: the full-record path below says why, with the methods that apply (refusals.py)
            note = ("not folded block by block (the folded path refused these inputs); the full-record path ran "
                    "and exp.blocks holds every block's records")
    if results is None:
        traces = _run_engine(call)
        results = []
        for job in call.jobs:
            key = job.preset if job.preset is not None else next(iter(traces))
            trace = traces[key]
            try:
                with progress_line.step(f"method {job.info.name}"):
                    out = apply(job.info, trace, job.options, key.name if key is not None else None, model_name)
                results.append(build(job.info, _label(key, call), out, trace, call.special_tokens_mask,
                                     call.mask_source))
            except MethodError as e:  # a refusal names only the methods that run on this model
                raise refusals.with_applicable(e, refusals.applicable(job.info.name, trace, call.preset,
                                                                      model_name, key), model_name) from None
            if note is not None:
                results[-1].notes.append(note)
    validation.check_result(results)
    vision_language.place_image_tokens(results, call.model, call.prepared.kwargs, captured.primary)
    vlm_tiles.compose(results, call.model, call.prepared.kwargs, captured.primary, call.tile_grid)
    vlm_anyres.compose(results, call.model, call.prepared.kwargs, captured.primary)
    remembered.remember(results, model=call.model, inputs=call.prepared.kwargs, primary=captured.primary,
                        tokenizer=call.tokenizer, image_processor=call.image_processor, target=call.given_target,
                        spec=call.spec, encodings=call.encodings)
    remembered_prompt.remember_prompt(results, model=call.model, inputs=call.prepared.kwargs, tokenizer=call.tokenizer)
    for r in results:
        r.notes.extend(capture_notes(call.prepared.event, captured, model_name))
    return results if call.many else results[0]


def _explain_folded(call: Call, note: Optional[str] = None) -> list:
    """``keep_blocks=False``: one folded run per preset the methods need (gradient-only methods ride
    on the first), each method a :class:`relprop.methods.fold_maps.RowFold` fed block by block from
    the output back; the Explanations have no ``blocks`` or ``matrix`` (:class:`NotKept`)."""
    a = call.prepared.captured.analysis
    mask = call.prepared.kwargs.get("attention_mask")
    keys = [j.preset for j in call.jobs]
    folds = [fold_maps.RowFold(j.info, j.options, len(a.blocks), mask, k.name if k is not None else None,
                               a.token_mixing)
             for j, k in zip(call.jobs, keys)]
    wanted = list(dict.fromkeys(k for k in keys if k is not None)) or [None]
    keys = [k if k is not None else wanted[0] for k in keys]
    outputs = {}
    for p in wanted:
        mine = [i for i, k in enumerate(keys) if k is p]
        req = call.request(p if p is not None else call.fallback, relevance=p is not None,
                           folds=tuple(folds[i] for i in mine))
        trace = run(req)
        trace.notes.append(note or "keep_blocks=False: each attention block was folded into the scores during the "
                           "reverse walk and its records dropped (exp.blocks and exp.matrix are not kept)")
        for i, out in zip(mine, trace.folded):
            outputs[i] = (out, trace)
    return [build(j.info, _label(key, call), outputs[i][0], outputs[i][1], call.special_tokens_mask,
                  call.mask_source)
            for i, (j, key) in enumerate(zip(call.jobs, keys))]


def _run_engine(call: Call) -> Dict[Optional[Preset], Trace]:
    """One trace per preset whose relevance the methods need (gradient-only methods reuse any); the
    one-backward fast path when every method reads only the input relevance."""
    infos = [j.info for j in call.jobs]
    wanted = list(dict.fromkeys(j.preset for j in call.jobs if j.preset is not None))
    input_only = all(i.needs_relevance and not i.needs_blocks for i in infos)
    input_gradient = any(i.needs_input_gradient for i in infos)
    traces: Dict[Optional[Preset], Trace] = {}
    for p in wanted:
        with progress_line.step(f"forward and backward pass, relevance under preset '{p.name}'"):
            traces[p] = _run_preset(call, p, input_only, input_gradient)
    if not traces:
        traces[None] = run(call.request(call.fallback, relevance=False, input_gradient=input_gradient))
    return traces


def _run_preset(call: Call, p: Preset, input_only: bool, input_gradient: bool) -> Trace:
    """The trace of one preset: the one-backward fast path when every method reads only the input
    relevance and it applies (else a note says why not), else the rule-by-rule walk."""
    note = None
    if call.fast_path is not False and input_only:
        try:
            return _run_fast(call, p, input_gradient)
        except FastPathUnavailable as why:
            note = (f"the one-backward fast path was not taken under preset '{p.name}' ({why}); the graph was "
                    "walked rule by rule instead, which gives the preset's relevance more slowly")
            if call.fast_path is True:
                warn(note)
    trace = run(call.request(p, input_gradient=input_gradient))
    if note is not None:
        trace.notes.append(note)
    return trace


def _run_fast(call: Call, p: Preset, input_gradient: bool) -> Trace:
    """The fast path whole, or segment by segment with row-chunked attention cores when ``memory="low"``
    or its attention maps would exceed the budget (:func:`relprop.engine.fast_memory.choose`)."""
    request = call.request(p, input_gradient=input_gradient)
    captured = call.prepared.captured
    segmented, note = fast_memory.choose(call.memory, captured.analysis.blocks, call.prepared.batch,
                                         call.prepared.kwargs[captured.primary].device, call.records_budget)
    if not segmented:
        return run_fast(request)
    try:
        trace = run_fast_low(request)
    except FastPathUnavailable:
        if note is None:  # memory="low" asked for it: the caller says why it was not taken
            raise
        return run_fast(request)  # chosen for memory only: the whole fast path where segments do not apply
    if note is not None:
        trace.notes.append(note)
    return trace
