"""One call of ``explain`` / ``explain_settings`` checked into a frozen :class:`Call`: the engine options
and the special-tokens mask checked, the inputs prepared (``relprop.api.prologue``), the target resolved;
and :func:`reported`, which turns every other error that leaves ``explain`` into a ``RelpropError``.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Optional, Tuple

import torch

from . import options as opt
from . import validation
from ..engine import Request, Tuning
from ..errors import RelpropError
from ..explanation import mask_from_tokenizer, split_tokenizer_keys
from ..models import PLAIN, ModelAdapter, adapter_for
from ..rules import Preset, get_preset
from ..targets.target_forms import specify
from ..targets import Target, resolve
from .options import DEFAULT_PRESET, Job
from .prologue import Prepared, prepare


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
    fast_path, keep_blocks, records_budget, tuning : how the engine is run (see :func:`explain`).
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
    layout: Any = None  # what the family's adapter needs back to compose the results (Adapted.layout)
    tuning: Tuning = Tuning()
    adapter: ModelAdapter = PLAIN  # the model family's adapter (relprop.models.adapter_for)

    def request(self, preset: Preset, **fields) -> Request:
        """The engine's Request for one run under ``preset`` (``fields``: ``folds``, ``input_gradient``);
        how it runs is the schedule the engine's chooser makes (``relprop.api.method_runs``)."""
        return Request(self.prepared.captured, self.model, self.prepared.kwargs, self.target, preset=preset,
                       eps=self.eps, unsupported=self.unsupported, precision=self.precision, **fields)


def check_call(model, inputs, target, jobs: Tuple[Job, ...], many: bool, preset: Optional[Preset], *, tokenizer,
               special_tokens_mask, wrt, eps, unsupported, memory, fast_path, keep_blocks, precision,
               records_budget, image_processor=None, given_target=None, tuning=None, adapter=None) -> Call:
    """The :class:`Call` of ``explain`` and ``explain_settings``: the engine options and
    the special-tokens mask checked, the inputs prepared (:func:`prepare`) and the target resolved
    (the methods and their presets are checked already: ``jobs``). ``adapter``: the model's family adapter
    where the caller has looked it up (:func:`relprop.models.adapter_for`)."""
    opt.check_arguments(eps=eps, unsupported=unsupported, memory=memory, fast_path=fast_path,
                        keep_blocks=keep_blocks, precision=precision, records_budget=records_budget, tuning=tuning)
    encodings = getattr(inputs, "encodings", None)  # a fast tokenizer's output knows its token strings
    inputs, batch_mask = split_tokenizer_keys(inputs)
    mask_source = "special_tokens_mask=" if special_tokens_mask is not None else "the batch's special_tokens_mask"
    special_tokens_mask = opt.check_special_tokens_mask(special_tokens_mask if special_tokens_mask is not None
                                                        else batch_mask)
    adapter = adapter if adapter is not None else adapter_for(model)
    adapted = adapter.prepare(model, inputs, [j.info for j in jobs], wrt)  # the family's inputs as captured
    model, inputs, wrt = adapted.model, adapted.inputs, adapted.wrt
    prepared = prepare(model, inputs, wrt)
    validation.warn_left_padding(model, prepared.kwargs)
    if special_tokens_mask is None and tokenizer is not None:
        ids = prepared.kwargs[prepared.captured.primary]
        if torch.is_tensor(ids) and not ids.is_floating_point():
            special_tokens_mask = mask_from_tokenizer(tokenizer, ids)
            mask_source = f"tokenizer= ({type(tokenizer).__name__}'s special ids)"
    with reported(model, jobs):
        # every form of target= through one path per head, with the mask of the output's positions: target_forms
        spec = specify(target, model, tokenizer, prepared.kwargs)
        resolved = resolve(spec, prepared.batch, prepared.captured.primary)
    return Call(model, prepared, resolved, jobs, many, preset, preset if preset is not None else get_preset(
        DEFAULT_PRESET), special_tokens_mask, mask_source, eps, unsupported, memory, precision, fast_path,
        keep_blocks, records_budget, tokenizer, image_processor, given_target if given_target is not None
        else target, spec, encodings, adapted.layout, tuning if tuning is not None else Tuning(), adapter)


@contextlib.contextmanager
def reported(model, jobs: Tuple[Job, ...]):
    """Every error that leaves ``explain`` is a :class:`RelpropError`: one that is not is
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
