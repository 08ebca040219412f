"""Applying one node's rule: the one function the reverse walk and the row-chunked walk of an attention
core both call (:mod:`relprop.engine.walk`, :mod:`relprop.engine.chunked_walk`).

A rule is ``fn(ctx, relevance) -> one share per argument`` (:mod:`relprop.rules.rule_registry`). Its
context holds the node's arguments (live ones in the relevance's precision), its output and what the
rule may do with them. An ε-rule (AttnLRP Eq. 8) passes Σ R ⊙ |z| / (|z| + ε) to its operands, not Σ R:
what its stabilizer keeps is returned with a ledger label, for the caller to book as absorbed.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Tuple

import torch
import torch.fx
import torch.utils._pytree as pytree

from ..errors import UnsupportedOperation
from ..graph.nodes import is_live, module_path, module_type
from ..rules.context import RuleContext
from ..rules.stabilize import promote
from .ledger import STABILIZER


@dataclasses.dataclass
class Applied:
    """What one rule gave: ``shares`` (one per entry of ``operands``, None where it gives none),
    ``operands`` (the node's arguments, or the operands of a function explained as a whole),
    ``kept`` ((ledger label, share) of what the rule did not pass on, or None) and ``deferred`` (the
    shares whose per-sample factors a chunk's rule deferred, :mod:`relprop.engine.deferred_shares`)."""

    shares: Tuple[Any, ...]
    operands: Tuple[Any, ...]
    kept: Optional[Tuple[str, torch.Tensor]]
    deferred: Optional[tuple] = None


def apply_rule(spec, node: torch.fx.Node, relevance, value: Callable[[torch.fx.Node], Any], live, *, batch: int,
               batch_dim, eps: float, preset, options, dead: Callable[[], bool] = lambda: False,
               book: bool = True, context=RuleContext, **fields) -> Applied:
    """Apply rule ``spec`` (a :class:`relprop.rules.spec.RuleSpec`) of ``node`` to its complete
    ``relevance``. ``value(n)``: the forward value of node ``n`` (whole, or on a chunk of query rows);
    ``live``: the input-dependent nodes; ``batch_dim``: the node's batch axis; ``dead()``: whether the
    node's value is dead once its rule has run, so that the rule may compute into its buffer (asked only
    of a rule that can); ``book``: compute what an ε-rule's stabilizer keeps (a counting pass does not);
    ``context``: the :class:`relprop.rules.context.RuleContext` class (with ``fields``: a chunk's).
    Raises :class:`UnsupportedOperation` when the rule gives no shares (it does not apply)."""
    operands = spec.operands
    arg_nodes, kw_nodes = (node.args, node.kwargs) if operands is None else (operands, {})
    args, kw = torch.fx.node.map_arg((arg_nodes, kw_nodes), lambda n: promote(value(n)) if n in live else value(n))
    flags = tuple(is_live(x, live) for x in arg_nodes)
    lost = spec.gradient_form.lost if spec.gradient_form is not None else None
    writable = lost is None and spec.writes_out and dead()
    ctx = context(node=node, args=tuple(args), kwargs=kw, out=pytree.tree_map(promote, value(node)), live=flags,
                  batch_dim=batch_dim, batch_size=batch, eps=eps, preset=preset, options=options,
                  out_writable=writable, **fields)
    shares = spec.fn(ctx, relevance)
    if shares is None:
        raise UnsupportedOperation(node.target, module_path(node), module_type(node), preset.name,
                                   detail="Its rule does not apply to these operands.")
    kept = None
    if lost is not None and book:  # an ε-rule: what its stabilizer keeps
        kept = lost(node, ctx.args, ctx.out, relevance, eps)
        if kept is not None and not isinstance(kept, tuple):
            kept = (STABILIZER, kept)
    return Applied(tuple(shares), tuple(arg_nodes), kept, getattr(ctx, "deferred", None))
