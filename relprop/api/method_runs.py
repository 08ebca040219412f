"""The body of ``explain`` once every argument is checked into a :class:`relprop.api.checked_call.Call`:
one engine run per preset the methods need (``Call.request``; the one-backward fast path when it applies,
or one folded run when the records are not kept), the methods applied and the Explanations built and
finished (image tokens placed, tiles composed, what they remember to draw themselves, capture notes).
"""
from __future__ import annotations

from typing import Dict, Optional

from . import refusals, remembered, remembered_prompt, validation, vision_language, vlm_anyres, vlm_tiles
from ..engine import FastPathUnavailable, Trace, fast_memory, run, run_fast, run_fast_low
from ..engine.fold_hooks import foldable
from ..errors import MethodError, warn
from ..graph import progress_line
from ..explanation import build
from ..graph.capture import capture_notes
from ..methods import apply, fold_choice, fold_maps
from ..rules import Preset
from .checked_call import Call


def _label(key: Optional[Preset], call: Call) -> Optional[str]:
    """The preset an Explanation names: the one its relevance came from, else the call's (None: none)."""
    p = key if key is not None else call.preset
    return p.name if p is not None else None


def run_methods(call: Call):
    """The body of ``explain`` once every argument is checked into ``call``: the Explanation, or the list of
    them when ``call.many``."""
    captured, batch, model_name = call.prepared.captured, call.prepared.batch, type(call.model).__name__
    pairs = [(j.info, j.options) for j in call.jobs]
    runs = len({j.preset for j in call.jobs if j.preset is not None})
    fold, note = fold_choice.choose(pairs, captured.analysis, batch, call.prepared.kwargs[captured.primary].device,
                                    call.keep_blocks, call.records_budget, runs)
    results = None
    if fold:
        try:
            results = _run_folded(call, note)
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


def _run_folded(call: Call, note: Optional[str] = None) -> list:
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
    request = call.request(p, input_gradient=input_gradient)
    memory_note = None
    if input_only:
        request, memory_note = _walk_without_records(call, request)
    trace = run(request)
    trace.notes.extend(n for n in (note, memory_note) if n is not None)
    return trace


def _walk_without_records(call: Call, request):
    """(request, note) for the rule-by-rule walk of methods that read only the input relevance: with
    ``memory="low"``, or where the whole walk's attention maps would exceed ``records_budget``
    (:func:`relprop.engine.fast_memory.choose`), the segmented run that keeps no block records
    (``Request.keep_records=False``: the attention cores in chunks of query rows, each block's records
    freed as the walk leaves it; ``exp.blocks`` empty, as on the fast path). Not on window attention
    or two token streams, whose walk reads every block (there the records are kept, as before)."""
    if not foldable(call.prepared.captured.analysis):
        return request, None
    segmented, note = _memory_choice(call, path="the rule-by-rule walk")
    if not segmented:
        return request, None
    return request.but(memory="low", keep_records=False), note


def _memory_choice(call: Call, path: str = "the one-backward fast path"):
    """(segmented, note) of :func:`relprop.engine.fast_memory.choose` for the call's memory mode, blocks,
    batch, device and budget; ``path`` names the run in the note."""
    captured = call.prepared.captured
    return fast_memory.choose(call.memory, captured.analysis.blocks, call.prepared.batch,
                              call.prepared.kwargs[captured.primary].device, call.records_budget, path=path)


def _run_fast(call: Call, p: Preset, input_gradient: bool) -> Trace:
    """The fast path whole, or segment by segment with row-chunked attention cores when ``memory="low"``
    or its attention maps would exceed the budget (:func:`relprop.engine.fast_memory.choose`)."""
    request = call.request(p, input_gradient=input_gradient)
    segmented, note = _memory_choice(call)
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
