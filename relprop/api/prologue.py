"""The prologue :func:`relprop.explain` and :func:`relprop.coverage` share: the model and its inputs
checked, the inputs bound to the model's forward and the graph captured (and cached)."""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional

import torch

from . import validation
from ..graph.capture import CACHE, Captured, CaptureEvent
from ..graph.inputs import bind_inputs, primary_input


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
