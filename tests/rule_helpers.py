"""Helpers shared by the rule reference tests (``test_rules_reference``, ``test_rules_hybrid``,
``test_attnlrp``): the stabilized division on Python floats, seeded float64 tensors, and a
:class:`RuleContext` for calling one rule directly."""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.fx

from relprop.rules import rule_registry as registry
from relprop.rules.context import RuleContext

EPS = 1e-9


def sdiv(num: float, den: float, eps: float = EPS) -> float:
    """The safe_divide stabilizer on Python floats: 0 where den is 0/not finite, else num/(den ± eps)."""
    if den == 0 or not math.isfinite(den):
        return 0.0
    return num / (den + eps) if den >= 0 else num / (den - eps)


def rand(shape, seed, dtype=torch.float64):
    """A seeded standard normal tensor (float64 unless told)."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def np64(t) -> np.ndarray:
    """A float64 numpy copy of a tensor."""
    return t.detach().to(torch.float64).numpy().copy()


def make_ctx(op, args, out, live, *, preset="chefer2021", node=None, kwargs=None, options=None, batch_dim=0,
             eps=EPS) -> RuleContext:
    """The context the engine hands a rule for ``op`` applied to ``args`` with output ``out``."""
    if node is None:
        node = torch.fx.Graph().call_function(op, ())
    first = out[0] if isinstance(out, (tuple, list)) else out
    bs = first.shape[batch_dim] if (batch_dim is not None and torch.is_tensor(first) and first.dim()) else 1
    return RuleContext(node=node, args=tuple(args), kwargs=kwargs or {}, out=out, live=tuple(live),
                       batch_dim=batch_dim, batch_size=bs, eps=eps, preset=preset, options=options or {})


def rule_of(op, preset="chefer2021"):
    """The rule ``preset`` registers for ``op`` (asserting there is one)."""
    fn = registry.lookup(preset, op)
    assert fn is not None, f"no rule for {op} in {preset}"
    return fn
