"""The front door: :func:`explain` and :func:`explain_settings`.

Both check every argument first (``relprop.api.options``), then ``relprop.api.checked_call`` checks
everything once into a frozen ``Call`` (the resolved Preset, each method's options, the engine options;
its prologue, shared with ``coverage``, is ``relprop.api.prologue``: inputs checked and bound to the
model's forward, graph captured and cached). The ``Call`` flows down unchanged into
``relprop.api.method_runs``: one engine run per preset the methods need (``Call.request``), the methods
applied and the Explanations built.
"""
from __future__ import annotations

import itertools
from typing import Any, Dict, Optional, Sequence

import torch
import torch.utils._pytree as pytree

from . import options as opt
from . import raw_inputs
from ..errors import MethodError, OptionError
from ..engine import Tuning
from ..graph import host_reads, progress_line
from ..models import adapter_for
from ..rules.stabilize import DEFAULT_EPS
from .checked_call import check_call, reported
from .method_runs import run_methods


def explain(model: torch.nn.Module, inputs: Any, target: Any = None, method: Any = "transformer_attribution",
            preset: Any = None, *, eps: float = DEFAULT_EPS, unsupported: str = "error",
            special_tokens_mask: Optional[torch.Tensor] = None, tokenizer: Any = None,
            fast_path: Optional[bool] = None, memory: str = "default", wrt: Optional[str] = None,
            image_processor: Any = None, keep_blocks: Optional[bool] = None, precision: str = "float32",
            records_budget: Optional[float] = None, progress: Optional[bool] = None, tuning: Any = None,
            compile: bool = False, **options):
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
        raw inputs: strings, PIL images or image paths (``relprop.api.raw_inputs``). A batch that the
        model's family explains sample by sample (its adapter's ``split_batch``, ``relprop.models``) is
        explained so and joined into one batch Explanation.
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
        of |W| with the model for later calls). ``"default"`` runs the fast path as ``"low"`` does
        when its attention maps would exceed ``records_budget`` (``exp.notes`` says so); so does the
        rule-by-rule walk of methods that read only the input relevance (``lrp`` under ``"lrp"`` or
        ``"chefer2021"``), which then keeps no block records (``exp.blocks`` empty, as on the fast path).
    wrt
        name of the input to explain onto when the model takes several (an image tower: ``"pixel_values"``).
    image_processor
        a HuggingFace image processor for raw images.
    keep_blocks
        None keeps the per-block records while they fit ``records_budget`` and folds the
        rollout-style methods block by block beyond it; True always keeps them, False always folds.
    precision
        ``"float32"`` evaluates a half-precision model in float32; ``"model"`` keeps its dtype.
    records_budget
        bytes the kept records (or the fast path's attention maps) may take; None: 1 GiB or a
        quarter of the free memory.
    progress
        a progress line on stderr once the call has lasted 2 s (first capture, many methods, SmoothGrad's
        samples); None: as ``RELPROP_PROGRESS`` says, else when stderr is a terminal. It changes no result.
    tuning
        a ``relprop.Tuning``: how the runs are carried out where that changes no number beyond
        float rounding (the chunks of query rows of a segmented run's attention cores, fused kernels, when
        values are read on the host); None: the defaults (docs/performance.md).
    compile
        True: the relevance walk as one program per input size, compiled by ``torch.compile`` at the
        first call of that size (minutes on a CPU; ``exp.notes`` gives the seconds), then reused: the same
        numbers to float32 rounding, fewer kernels. The same as ``tuning=relprop.Tuning(compile=True)``.
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
    tuning = opt.with_compile(tuning, compile)
    with progress_line.line(f"explaining {type(model).__name__}", progress):
        def body():
            return _explain(model, inputs, target, method, preset, eps=eps, unsupported=unsupported,
                            special_tokens_mask=special_tokens_mask, tokenizer=tokenizer, fast_path=fast_path,
                            memory=memory, wrt=wrt, image_processor=image_processor, keep_blocks=keep_blocks,
                            precision=precision, records_budget=records_budget, progress=progress, tuning=tuning,
                            **options)
        return _with_one_read(body, model, inputs, tuning)


def _with_one_read(body, model, inputs, tuning):
    """``body()``; where the call reads values on the host once (``Tuning.host_reads``: by default on an
    accelerator), with its host reads deferred to its end and read together
    (:func:`relprop.graph.host_reads.one_read`), and, where an assumption it was computed under did not
    hold, computed again carefully, with a note."""
    opt.check_tuning(tuning)
    if not (tuning or Tuning()).reads_once(_device(model, inputs)):
        return body()
    result, retried = host_reads.one_read(body)
    if retried:
        note = (f"relprop computed this call twice: the first run assumed that {'; '.join(retried)}, which did not "
                "hold on these inputs; the second read the values it needed on the host (the same results, about "
                "one more run of time)")
        for r in result if isinstance(result, list) else [result]:
            r.notes.append(note)
    return result


def _explain(model, inputs, target, method, preset, *, eps, unsupported, special_tokens_mask, tokenizer, fast_path,
             memory, wrt, image_processor, keep_blocks, precision, records_budget, progress, tuning, **options):
    """The body of :func:`explain`, within one call's scope of host reads."""
    given_target = target
    if raw_inputs.is_pipeline(model) and image_processor is None:
        image_processor = getattr(model, "image_processor", None)
    model, inputs, tokenizer, target, wrt = raw_inputs.adapt(model, inputs, tokenizer, image_processor, target, wrt)
    infos, many = opt.check_methods(method)
    preset = opt.check_preset(preset)
    per_method = opt.method_options(infos, options, many)
    jobs = opt.check_jobs([(i, per_method[i.name]) for i in infos], preset)
    adapter = adapter_for(model)
    if adapter.splits(model, inputs):  # a batch the family explains sample by sample (relprop.models)
        with reported(model, jobs):
            samples, length = adapter.split_batch(model, inputs, target, special_tokens_mask)
        rest = dict(eps=eps, unsupported=unsupported, tokenizer=tokenizer, fast_path=fast_path, memory=memory,
                    wrt=wrt, image_processor=image_processor, keep_blocks=keep_blocks, precision=precision,
                    records_budget=records_budget, progress=progress, tuning=tuning, **options)
        runs = [explain(model, s.inputs, s.target, method, preset, special_tokens_mask=s.special_tokens_mask,
                        **rest) for s in samples]
        with reported(model, jobs):
            return adapter.join(runs, samples, length, many, model)
    call = check_call(model, inputs, target, jobs, many, preset, tokenizer=tokenizer,
                      special_tokens_mask=special_tokens_mask, wrt=wrt, eps=eps, unsupported=unsupported,
                      memory=memory, fast_path=fast_path, keep_blocks=keep_blocks, precision=precision,
                      records_budget=records_budget, image_processor=image_processor, given_target=given_target,
                      tuning=tuning, adapter=adapter)
    with reported(call.model, call.jobs):
        return run_methods(call)


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

    def body():
        call = check_call(model, inputs, target, jobs, True, preset, tokenizer=tokenizer,
                          special_tokens_mask=special_tokens_mask, wrt=wrt, eps=eps, unsupported=unsupported,
                          memory=memory, fast_path=None, keep_blocks=True, precision="float32", records_budget=None)
        with reported(call.model, call.jobs):
            return run_methods(call)
    return _with_one_read(body, model, inputs, None)


def _device(model, inputs) -> torch.device:
    """Where the call computes: the device of its first input tensor, else of the model's first parameter
    or buffer (not an offloaded one's meta device), else the CPU."""
    for t in pytree.tree_leaves(inputs):
        if torch.is_tensor(t):
            return t.device
    tensors = itertools.chain(model.parameters(), model.buffers()) if isinstance(model, torch.nn.Module) else ()
    for t in tensors:
        if t.device.type != "meta":
            return t.device
    return torch.device("cpu")
