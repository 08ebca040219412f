"""What the engine is asked to do: one :class:`Request`, and the choices its fields take."""
from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from typing import Any, Mapping, Optional, Union

import torch

from ..errors import OptionError
from ..graph.capture import Captured
from ..rules.rule_registry import Preset, get_preset
from ..rules.stabilize import DEFAULT_EPS
from ..targets import Target

#: the values of ``explain(..., memory=...)`` (see :func:`relprop.explain`)
MEMORY_MODES = ("default", "low", "high")
#: the values of ``explain(..., unsupported=...)``: raise for an op without a rule, or apply the
#: generic gradient × input rule to it
UNSUPPORTED_MODES = ("error", "z_rule")
#: the values of ``explain(..., precision=...)``: a half-precision model evaluated in float32 (its
#: weights cast layer by layer as the graph reads them), or in its own dtype (less memory)
PRECISIONS = ("float32", "model")


@dataclasses.dataclass(frozen=True)
class Request:
    """What one run of the engine explains (how it runs is a :class:`relprop.engine.schedule.Schedule`).

    Attributes
    ----------
    captured : the captured program (:mod:`relprop.graph.capture`).
    model : the model whose current parameters the program is evaluated with.
    kwargs : the model's inputs, by name.
    target : what is explained (:class:`relprop.targets.Target`).
    preset : the :class:`relprop.rules.Preset` whose rules the walk applies, resolved once by the
        caller (:func:`relprop.explain` hands down the object it checked); a name given here is
        resolved when the Request is made, and the engine never looks a preset up again.
    eps : the rules' denominator stabilizer.
    unsupported : ``"error"`` or ``"z_rule"`` (:data:`UNSUPPORTED_MODES`).
    folds : the folds of a schedule with ``records="folded"``, each called with every block's
        :class:`relprop.engine.trace.BlockRecord` from the output block back, as soon as the reverse
        walk has its A, dA and R_A; the records are dropped after the calls
        (:func:`relprop.engine.execute.execute`; each fold's ``result()`` goes to ``Trace.folded``).
    input_gradient : take the gradient at the input (``Trace.input_gradient``). False (no method
        reads it) lets the gradient pass stop at the first block's input, below which only the
        input gradient needs it: e.g. a vision transformer's patch embedding is not back-propagated.
    precision : ``"float32"`` or ``"model"`` (:data:`PRECISIONS`); see :attr:`compute`.
    """

    captured: Captured
    model: torch.nn.Module
    kwargs: Mapping[str, Any]
    target: Target
    preset: Union[Preset, str] = "chefer2021"
    eps: float = DEFAULT_EPS
    unsupported: str = "error"
    folds: tuple = ()
    input_gradient: bool = True
    precision: str = "float32"

    def __post_init__(self):
        if not isinstance(self.preset, Preset):
            object.__setattr__(self, "preset", get_preset(self.preset))

    @functools.cached_property
    def compute(self) -> Optional[torch.dtype]:
        """The dtype the graph is evaluated in when it is not the model's own: float32 for a model
        whose floating parameters or buffers are float16/bfloat16 under ``precision="float32"``
        (every forward value, gradient and relevance in float32; the weights are cast as the graph
        reads them, never all at once), else None (the model's own dtype). Read once per request."""
        if self.precision != "float32":
            return None
        return torch.float32 if model_in_half(self.model) else None

    def but(self, **changes) -> "Request":
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)


def model_in_half(model: torch.nn.Module) -> bool:
    """Whether some floating parameter or buffer of ``model`` is float16 or bfloat16."""
    for t in itertools.chain(model.parameters(), model.buffers()):
        if t.is_floating_point() and t.dtype in (torch.float16, torch.bfloat16):
            return True
    return False


def check_options(*, eps: Any, unsupported: Any, memory: Any, precision: Any = "float32") -> None:
    """Raise :class:`OptionError` naming the choices when an engine option has a value it does not take."""
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
        raise OptionError(f"eps={eps!r} is not a choice here: the denominators' stabilizer is a finite number >= 0 "
                          f"(default {DEFAULT_EPS})")
    if not isinstance(unsupported, str) or unsupported not in UNSUPPORTED_MODES:
        raise OptionError(f"unsupported={unsupported!r} is not a choice here. Choices: {list(UNSUPPORTED_MODES)}")
    if not isinstance(memory, str) or memory not in MEMORY_MODES:
        raise OptionError(f"memory={memory!r} is not a choice here. Choices: {list(MEMORY_MODES)}")
    if not isinstance(precision, str) or precision not in PRECISIONS:
        raise OptionError(f"precision={precision!r} is not a choice here. Choices: {list(PRECISIONS)} ('float32': a "
                          "float16/bfloat16 model is evaluated in float32; 'model': in its own dtype, less memory)")
