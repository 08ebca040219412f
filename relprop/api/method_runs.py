"""The body of ``explain`` once every argument is checked into a :class:`relprop.api.checked_call.Call`:
one engine run per preset the methods need (``Call.request``; the one-backward fast path when it applies,
or one folded run when the records are not kept), the methods applied and the Explanations built and
finished (placed by the model family's adapter, what they remember to draw themselves, capture notes).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Dict, Optional

from . import refusals, remembered, validation
from ..engine import Asked, FastPathUnavailable, Schedule, Trace, choose, execute
from ..engine.schedule import fold_choice
from ..errors import MethodError
from ..graph import progress_line
from ..explanation import build
from ..graph.capture_notes import capture_notes, rerun_note
from ..methods import apply, fold_maps
from ..rules import Preset
from .checked_call import Call


def _label(key: Optional[Preset], call: Call) -> Optional[str]:
    """The preset an Explanation names: the one its relevance came from, else the call's (None: none)."""
    p = key if key is not None else call.preset
    return p.name if p is not None else None


def run_methods(call: Call):
    """The body of ``explain`` once every argument is checked into ``call``: the Explanation, or the list of
    them when ``call.many``."""
    started = time.perf_counter()
    captured, model_name = call.prepared.captured, type(call.model).__name__
    asked = _asked(call)
    fold, _ = fold_choice(captured, asked, call.prepared.batch, _device(call))
    results, note = None, None
    if fold:
        try:
            results = _run_folded(call, asked)
        except MethodError:  # refused: the full-record path below says why, with the methods that apply (refusals.py)
            note = ("not folded block by block (the folded path refused these inputs); the full-record path ran "
                    "and exp.blocks holds every block's records")
            asked = dataclasses.replace(asked, keep_blocks=True)
    if results is None:
        traces = _run_engine(call, asked)
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
            exports = getattr(trace.session, "exports", None) or []
            results[-1].notes.extend(rerun_note(e, model_name, job.info.name) for e in exports)
            del exports[:]  # (said once, by the method whose re-runs needed it)
            if note is not None:
                results[-1].notes.append(note)
    validation.check_result(results)
    call.adapter.compose(results, call.model, call.prepared.kwargs, captured.primary, call.layout, call.tokenizer)
    remembered.remember(results, model=call.model, inputs=call.prepared.kwargs, primary=captured.primary,
                        tokenizer=call.tokenizer, image_processor=call.image_processor, target=call.given_target,
                        spec=call.spec, encodings=call.encodings)
    first_run = time.perf_counter() - started
    for r in results:
        r.notes.extend(capture_notes(call.prepared.event, captured, model_name, first_run))
    return results if call.many else results[0]


def _device(call: Call):
    """Where the call's explained input is (the default budgets read the memory available there)."""
    return call.prepared.kwargs[call.prepared.captured.primary].device


def _presets(call: Call) -> list:
    """The presets whose relevance the methods need, in the order the methods name them."""
    return list(dict.fromkeys(j.preset for j in call.jobs if j.preset is not None))


def _asked(call: Call) -> Asked:
    """What the call asks of its engine runs (:class:`relprop.engine.schedule.Asked`): its options and
    what its methods read, whether they fold block by block (:func:`relprop.methods.fold_maps.why_not`)."""
    infos = [j.info for j in call.jobs]
    analysis = call.prepared.captured.analysis
    why = next((w for w in (fold_maps.why_not(j.info, j.options, analysis) for j in call.jobs) if w is not None),
               None)
    return Asked(memory=call.memory, fast_path=call.fast_path, keep_blocks=call.keep_blocks,
                 records_budget=call.records_budget, tuning=call.tuning,
                 input_only=all(i.needs_relevance and not i.needs_blocks for i in infos),
                 blocks=any(i.needs_blocks for i in infos), fold=why, runs=len(_presets(call)))


def _schedule(call: Call, preset: Optional[Preset], asked: Asked, request) -> Schedule:
    """The schedule of one run under ``preset`` (None: no relevance): the engine's one chooser."""
    return choose(call.prepared.captured, preset, call.eps, asked, call.prepared.batch, _device(call),
                  request.compute)


def _run_folded(call: Call, asked: Asked) -> list:
    """The folded runs: one per preset the methods need (gradient-only methods ride on the first), each
    method a :class:`relprop.methods.fold_maps.RowFold` fed block by block from the output back; the
    Explanations have no ``blocks`` or ``matrix`` (:class:`NotKept`)."""
    a = call.prepared.captured.analysis
    mask = call.prepared.kwargs.get("attention_mask")
    keys = [j.preset for j in call.jobs]
    folds = [fold_maps.RowFold(j.info, j.options, len(a.blocks), mask, k.name if k is not None else None,
                               a.token_mixing, asked.tuning.fold_chunk_bytes)
             for j, k in zip(call.jobs, keys)]
    wanted = _presets(call) or [None]
    keys = [k if k is not None else wanted[0] for k in keys]
    outputs = {}
    for p in wanted:
        mine = [i for i, k in enumerate(keys) if k is p]
        req = call.request(p if p is not None else call.fallback, folds=tuple(folds[i] for i in mine))
        trace = execute(req, _schedule(call, p, asked, req))
        for i, out in zip(mine, trace.folded):
            outputs[i] = (out, trace)
    return [build(j.info, _label(key, call), outputs[i][0], outputs[i][1], call.special_tokens_mask,
                  call.mask_source)
            for i, (j, key) in enumerate(zip(call.jobs, keys))]


def _run_engine(call: Call, asked: Asked) -> Dict[Optional[Preset], Trace]:
    """One trace per preset whose relevance the methods need (gradient-only methods reuse any), each run
    as the chooser schedules it (:func:`relprop.engine.schedule.choose`: the one-backward fast path when
    every method reads only the input relevance and the preset has gradient forms, ...)."""
    input_gradient = any(j.info.needs_input_gradient for j in call.jobs)
    traces: Dict[Optional[Preset], Trace] = {}
    for p in _presets(call):
        with progress_line.step(f"forward and backward pass, relevance under preset '{p.name}'"):
            request = call.request(p, input_gradient=input_gradient)
            schedule = _schedule(call, p, asked, request)
            try:
                traces[p] = execute(request, schedule)
            except FastPathUnavailable as why:  # (found only while running: the walk instead, with the note)
                if schedule.relevance != "gradient":
                    raise
                walked = _schedule(call, p, dataclasses.replace(asked, fast_path=False), request)
                note = (f"the one-backward fast path was not taken under preset '{p.name}' ({why}); the graph was "
                        "walked rule by rule instead, which gives the preset's relevance more slowly")
                warnings = (note,) if call.fast_path is True else ()
                traces[p] = execute(request, walked.but(notes=(note,) + walked.notes, warnings=warnings))
    if not traces:
        request = call.request(call.fallback, input_gradient=input_gradient)
        traces[None] = execute(request, _schedule(call, None, asked, request))
    return traces
