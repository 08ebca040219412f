"""What the engine is asked to do: one :class:`Request`, and the choices its fields take."""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import torch

from ..errors import OptionError
from ..graph.capture import Captured
from ..rules.stabilize import DEFAULT_EPS
from ..targets import Target

#: the values of ``explain(..., memory=...)`` (see :func:`relprop.explain`)
MEMORY_MODES = ("default", "low", "high")
#: the values of ``explain(..., unsupported=...)``: raise for an op without a rule, or apply the
#: generic gradient × input rule to it
UNSUPPORTED_MODES = ("error", "z_rule")


@dataclasses.dataclass(frozen=True)
class Request:
    """One run of the engine over a captured graph.

    Attributes
    ----------
    captured : the captured program (:mod:`relprop.graph.capture`).
    model : the model whose current parameters the program is evaluated with.
    kwargs : the model's inputs, by name.
    target : what is explained (:class:`relprop.targets.Target`).
    preset : the name of the preset whose rules the walk applies.
    relevance : walk the relevance back (else only the forward pass and the gradients).
    eps : the rules' denominator stabilizer.
    unsupported : ``"error"`` or ``"z_rule"`` (:data:`UNSUPPORTED_MODES`).
    memory : ``"default"``, ``"low"`` or ``"high"`` (:data:`MEMORY_MODES`).
    stream : folds, each called with every block's :class:`relprop.engine.trace.BlockRecord` from
        the output block back, as soon as the reverse walk has its A, dA and R_A; the records are
        dropped after the calls (:func:`relprop.engine.run.run`; each fold's ``result()`` goes to
        ``Trace.streamed``). Empty: every block's records are kept in ``Trace.blocks``.
    input_gradient : take the gradient at the input (``Trace.input_gradient``). False (no method
        reads it) lets the gradient pass stop at the first block's input, below which only the
        input gradient needs it: e.g. a vision transformer's patch embedding is not back-propagated.
    """

    captured: Captured
    model: torch.nn.Module
    kwargs: Mapping[str, Any]
    target: Target
    preset: str = "chefer2021"
    relevance: bool = True
    eps: float = DEFAULT_EPS
    unsupported: str = "error"
    memory: str = "default"
    stream: tuple = ()
    input_gradient: bool = True

    def but(self, **changes) -> "Request":
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)


def check_options(*, eps: Any, unsupported: Any, memory: Any) -> None:
    """Raise :class:`OptionError` naming the choices when an engine option has a value it does not take."""
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
        raise OptionError(f"eps={eps!r} is not a choice here: the denominators' stabilizer is a finite number >= 0 "
                          f"(default {DEFAULT_EPS})")
    if not isinstance(unsupported, str) or unsupported not in UNSUPPORTED_MODES:
        raise OptionError(f"unsupported={unsupported!r} is not a choice here. Choices: {list(UNSUPPORTED_MODES)}")
    if not isinstance(memory, str) or memory not in MEMORY_MODES:
        raise OptionError(f"memory={memory!r} is not a choice here. Choices: {list(MEMORY_MODES)}")
