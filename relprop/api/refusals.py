"""A method's refusal names only methods that run on the model.

When a method refuses a model (a :class:`relprop.MethodError` says why), :func:`explain` lists the
methods that apply. That list is not written by hand at the place that refuses: :func:`applicable`
tries every other method on the trace the refused one read, the way :func:`relprop.explain` would
run it, and lists the ones that give an explanation:

* methods that read only the attention records and gradients (raw attention, the rollouts, Grad-CAM,
  AttCAT, ...): run on the trace and turned into an :class:`Explanation` (which checks that their
  scores sit on the input's tokens or patch grid);
* methods that read the relevance of the attention maps (Transformer Attribution and its ablations,
  partial LRP): every op of the graph must have a rule in their preset (:func:`relprop.coverage`),
  and they run on the trace, with the trace's relevance when it came from that preset, else with
  zeros in its place (the structure they need is what is tested);
* ``lrp``: every op must have a rule in its preset;
* methods declared ``@method(..., checks_only=True)``, those that re-run the model (SmoothGrad,
  integrated gradients, ViT-CX, value zeroing) and input × gradient: the checks they make before any
  work.

:func:`with_applicable` replaces the list a refusal wrote (whatever follows "Methods that apply") with
the verified one.
"""
from __future__ import annotations

import dataclasses
import re
import warnings
from typing import List, Optional

import torch

from ..engine.coverage import report
from ..errors import MethodError, RelpropError
from ..explanation import build
from ..methods import all_methods
from ..methods.apply import apply
from ..methods.layout import grid_tokens
from ..methods.rollout_utils import rollout_blocks
from .options import DEFAULT_PRESET
from ..rules.rule_registry import Preset, get_preset

#: where a refusal's own list of methods begins (cut and replaced by :func:`with_applicable`)
_LIST = re.compile(r"\s*(Methods that apply|Methods for text:|Methods that need no patch grid|use input_x_gradient, "
                   r"smoothgrad or integrated_gradients instead|Use rollout or transformer_attribution instead).*$",
                   re.S)


def _preset_of(info, preset: Optional[Preset]) -> Optional[Preset]:
    """The preset method ``info`` would read under the call's ``preset``: that one, else the method's
    own, else the default (None: the method's own preset does not exist)."""
    if preset is not None:
        return preset
    try:
        return get_preset(info.preset or DEFAULT_PRESET)
    except RelpropError:
        return None


def _covered(captured, preset: Optional[Preset], cache: dict) -> bool:
    if preset is None:
        return False
    if preset not in cache:
        try:
            cache[preset] = not report(captured, preset).missing
        except RelpropError:
            cache[preset] = False
    return cache[preset]


def _without_relevance(trace):
    """The trace with zeros for the relevance of every block's attention (for a structural trial)."""
    blocks = [b if b.relevance is not None else dataclasses.replace(b, relevance=torch.zeros_like(b.attention))
              for b in trace.blocks]
    return dataclasses.replace(trace, blocks=blocks)


def _reruns_apply(name: str, trace) -> bool:
    if name == "vit_cx":  # the last block's patch features must sit on the patch grid
        if trace.modality != "vision" or trace.grid is None or not trace.blocks:
            return False
        last = trace.blocks[-1]
        feats = last.features if last.features is not None else last.hidden
        if feats is None:
            return False
        grid_tokens(trace, torch.zeros(feats.shape[:2]), name)
        return True
    if name == "value_zeroing":
        if not trace.blocks or any(b.value is None for b in trace.blocks):
            return False
        rollout_blocks(trace, name)
        return True
    return True


def applicable(refused: str, trace, preset: Optional[Preset], model_name: str,
               trace_preset: Optional[Preset] = None) -> List[str]:
    """The names of the methods other than ``refused`` that give an explanation of the model ``trace``
    was recorded on (see the module docstring); ``preset`` is the call's :class:`relprop.rules.Preset`
    (None: each method's own), ``trace_preset`` the one whose relevance the trace holds (None: none)."""
    captured = trace.session.captured
    coverage: dict = {}
    names = []
    for name, info in sorted(all_methods().items()):
        if name == refused:
            continue
        method_preset = _preset_of(info, preset)
        label = method_preset.name if method_preset is not None else (info.preset or DEFAULT_PRESET)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                if info.needs_relevance and not _covered(captured, method_preset, coverage):
                    continue
                if not info.needs_blocks and info.needs_relevance:  # lrp: the rules are what it needs
                    names.append(name)
                    continue
                t = trace
                if info.needs_relevance and trace_preset != method_preset:
                    t = _without_relevance(trace)
                if info.checks_only:  # @method(checks_only=True): judged by its checks, not run
                    apply_checks_only = dataclasses.replace(info, fn=lambda tr, **kw: None)
                    apply(apply_checks_only, t, {}, label, model_name)
                    if _reruns_apply(name, t):
                        names.append(name)
                    continue
                out = apply(info, t, {}, label, model_name)
                build(info, label, out, t, None, "")
            names.append(name)
        except Exception:  # noqa: BLE001 - any failure (a refusal, a crash) means: not listed
            continue
    return names


def with_applicable(error: MethodError, names: List[str], model_name: str) -> MethodError:
    """``error`` with the list of methods it wrote replaced by ``names`` (verified by :func:`applicable`)."""
    text = _LIST.sub("", str(error)).rstrip()
    if not text.endswith("."):
        text += "."
    tail = (f" Methods that apply to {model_name}: {names}" if names else
            f" No other method of relprop applies to {model_name}.")
    return MethodError(text + tail)
