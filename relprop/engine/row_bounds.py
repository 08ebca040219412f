"""How many positions of a node's relevance can be non-zero, known from the target and carried through
the walk without reading a value: the bound of :attr:`relprop.rules.context.RuleContext.relevant_rows`.

A decoder explained at its last position seeds relevance on one row of its [batch, positions,
vocabulary] logits per sample (``Target.rows``). A rule of relprop's own is linear in the relevance and
gives a zero share where the relevance is zero, so through an op that keeps each position's row apart
(a linear layer's input, an element-wise op, a norm, softmax or sum over the last axis) an operand's
relevance is non-zero at most on the positions where the output's is; the first op that mixes positions
(an attention product, a reshape of the positions) ends the bound. The rules of the layers next to the
output then compute on those rows only, found on the device (:func:`relprop.rules.stabilize.on_relevant_rows`).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.fx

from ..rules.preset_table import BUILTIN

aten = torch.ops.aten

#: ops whose every output position (all axes but the last) is computed from the same position of each
#: of the listed operands (None: every tensor operand) and nothing else
ROW_LOCAL = {
    aten.linear.default: (0,), aten.addmm.default: (1,), aten.layer_norm.default: (0,),
    aten.rms_norm.default: (0,), aten.gelu.default: None, aten.silu.default: None, aten.tanh.default: None,
    aten.relu.default: None, aten.sigmoid.default: None, aten.exp.default: None, aten.rsqrt.default: None,
    aten.sqrt.default: None, aten.neg.default: None, aten.pow.Tensor_Scalar: None, aten.add.Tensor: None,
    aten.sub.Tensor: None, aten.mul.Tensor: None, aten.div.Tensor: None, aten.add.Scalar: None,
    aten.mul.Scalar: None, aten.div.Scalar: None, aten.sub.Scalar: None, aten._to_copy.default: None,
    aten.clone.default: None, aten.dropout.default: None, aten.alias.default: None,
    aten.contiguous.default: None, aten.hardswish.default: None, aten.mish.default: None,
}
#: reductions and normalizations over the last axis: row-local when their axis is the last
LAST_AXIS = {aten.mean.dim: 1, aten.sum.dim_IntList: 1, aten.softmax.int: 1, aten._softmax.default: 1,
             aten.amax.default: 1}

_OWN: dict = {}


def _own(spec) -> bool:
    """Whether ``spec`` is one of relprop's built-in rules (linear in the relevance; a user's may not be)."""
    if not _OWN:
        _OWN.update({id(s): s for table in BUILTIN.values() for s in table.values()})
    return id(spec) in _OWN and _OWN[id(spec)] is spec


def operand_bound(node: torch.fx.Node, spec, position: int, bound: Optional[int], out_shape, arg_shape
                  ) -> Optional[int]:
    """The bound of the relevance ``node``'s rule ``spec`` gives its operand at ``position`` (of shape
    ``arg_shape``), from the ``bound`` of the node's own relevance (of shape ``out_shape``): the same
    where the op keeps rows apart for that operand and the operand has the output's positions, else None."""
    if bound is None or spec is None or spec.operands is not None or not _own(spec):
        return None
    if node.target in ROW_LOCAL:
        kept = ROW_LOCAL[node.target]
        if kept is not None and position not in kept:
            return None
    elif node.target in LAST_AXIS:
        dims = node.args[LAST_AXIS[node.target]] if len(node.args) > LAST_AXIS[node.target] else None
        dims = [dims] if isinstance(dims, int) else list(dims or ())
        if position != 0 or not dims or any(d not in (-1, len(arg_shape) - 1) for d in dims):
            return None
    else:
        return None
    if len(arg_shape) < 2 or len(out_shape) < 2 or tuple(arg_shape[:-1]) != tuple(out_shape[:-1]):
        return None
    return bound


def joined(a: Optional[int], b: Optional[int]) -> Optional[int]:
    """The bound of a sum of two relevances with bounds ``a`` and ``b``."""
    return None if a is None or b is None else a + b
