"""How :func:`relprop.evaluation.evaluate` evaluates: one frozen, validated :class:`EvaluationConfig`."""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional, Sequence, Tuple

from ..errors import OptionError
from . import _util
from .perturbation_protocol import DEFAULT_STEPS, MODES, UNITS
from .text_metrics import AOPC_STEPS

#: the values of ``target``: explain and score the predicted class, or the dataset's labels
TARGETS = ("predicted", "label")


@dataclasses.dataclass(frozen=True)
class EvaluationConfig:
    """Every setting of an evaluation, with the papers' defaults; an unknown setting or a value a
    setting does not take is an ``relprop.OptionError`` that names the choices.

    Attributes
    ----------
    target
        ``"predicted"`` (explain and score the predicted class: the paper's "predicted" rows)
        or ``"label"`` (the dataset's labels: its "target" rows).
    batch_size
        samples explained together.
    perturbation, modes, steps, baseline, normalization, unit, removal
        the perturbation tests
        (``relprop.evaluation.perturbation_curve``); ``normalization`` defaults to the dataset's.
    tokenizer
        texts: where the [PAD]/[MASK] ids come from (default: the dataset's).
    perturbation_batch_size
        perturbed copies per forward pass (default 64).
    segmentation
        score the maps against the masks (images with masks).
    rationale_k
        the k of token-F1 and Precision@K (texts with rationales).
    aopc, aopc_removal, log_odds_removal, aopc_steps
        AOPC (deletion) and log-odds ([PAD]) for texts.
    kendall
        texts: Kendall-τ between the scores for the explained class and the runner-up class
        (the highest-scoring other class), which costs one more explain call per batch.
    conservation
        collect the conservation report of each relevance preset.
    progress
        a tqdm progress bar over the samples.
    explain_options
        more keyword arguments for ``relprop.explain`` (method options, ``eps``, …).
    preset
        the relevance preset (``relprop.explain``): None lets each method use its own.
    """

    target: str = "predicted"
    batch_size: int = 8
    perturbation: bool = True
    modes: Tuple[str, ...] = MODES
    steps: Tuple[float, ...] = tuple(DEFAULT_STEPS)
    baseline: Any = None
    normalization: Any = None
    unit: str = "pixel"
    removal: Any = "pad"
    tokenizer: Any = None
    perturbation_batch_size: Optional[int] = None
    segmentation: bool = True
    rationale_k: Tuple[int, ...] = (5,)
    aopc: bool = True
    aopc_removal: Any = "delete"
    log_odds_removal: Any = "pad"
    aopc_steps: Tuple[float, ...] = tuple(AOPC_STEPS)
    kendall: bool = True
    conservation: bool = True
    progress: bool = True
    explain_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    preset: Optional[str] = None

    def __post_init__(self):
        _choice("target", self.target, TARGETS)
        _choice("unit", self.unit, UNITS)
        modes = (self.modes,) if isinstance(self.modes, str) else tuple(self.modes)
        for m in modes:
            _choice("mode", m, MODES)
        object.__setattr__(self, "modes", modes)
        _positive_int("batch_size", self.batch_size)
        if self.perturbation_batch_size is not None:
            _positive_int("perturbation_batch_size", self.perturbation_batch_size)
        object.__setattr__(self, "steps", tuple(float(s) for s in _util.check_fractions(self.steps)))
        object.__setattr__(self, "aopc_steps", tuple(float(s) for s in _util.check_fractions(self.aopc_steps)))
        ks = (self.rationale_k,) if isinstance(self.rationale_k, int) else tuple(self.rationale_k)
        for k in ks:
            _positive_int("rationale_k", k)
        object.__setattr__(self, "rationale_k", ks)
        for name in ("perturbation", "segmentation", "aopc", "kendall", "conservation", "progress"):
            if not isinstance(getattr(self, name), bool):
                raise OptionError(f"{name}={getattr(self, name)!r} is not a choice here. Choices: [True, False]")
        if not isinstance(self.explain_options, Mapping):
            raise OptionError(f"explain_options must be a dict of keyword arguments of relprop.explain, not "
                              f"{type(self.explain_options).__name__}")
        if self.preset is not None and not isinstance(self.preset, str):
            object.__setattr__(self, "preset", getattr(self.preset, "name", self.preset))

    @classmethod
    def of(cls, config: Optional["EvaluationConfig"] = None, **settings) -> "EvaluationConfig":
        """``config`` (default: the defaults) with ``settings`` replacing its fields."""
        fields = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(settings) - set(fields))
        if unknown:
            raise OptionError(f"{unknown} {'is not a setting' if len(unknown) == 1 else 'are not settings'} of "
                              f"relprop.evaluation.evaluate. Settings: {fields}")
        if config is not None and not isinstance(config, cls):
            raise OptionError(f"config must be an EvaluationConfig, not {type(config).__name__}")
        return dataclasses.replace(config or cls(), **settings)

    def to_dict(self) -> dict:
        """The settings as a dict (for manifests and reports)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def _choice(name: str, value: Any, choices: Sequence) -> None:
    if not isinstance(value, str) or value not in choices:
        raise OptionError(f"{name} {value!r} is not a choice. Choices: {list(choices)}")


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise OptionError(f"{name} must be a positive int, not {value!r}")
