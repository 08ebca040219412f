"""An attention core recognized as softmax(Q·Kᵀ·s + M)·V, for torch's fused kernel in a forward pass.

A forward pass without autograd (``memory="low"``, the folded path, :mod:`relprop.engine.low_memory`)
needs only each core's output A·V, not A itself. Where the core's nodes are exactly those of
CVPR 2021 Eq. 1 (A = softmax(Q·Kᵀ·s + M)) and the product A·V, with nothing else in between
(:func:`sdpa_form`), that output is what :func:`torch.nn.functional.scaled_dot_product_attention`
computes (the function an ``attn_implementation="sdpa"`` model calls itself, and which the captured
graph decomposes into these nodes). :func:`sdpa_rows` evaluates a chunk of query rows so, on the
chunk's first keys (:mod:`relprop.graph.key_bounds`): the same numbers to float rounding, without
an attention-sized tensor and in fewer kernels.

What makes the two differ is checked, not assumed: the decomposed safe softmax gives 0 on a query
row whose every key is masked, a fused kernel gives it uniform weights, so a chunk with such a row
(:func:`relprop.graph.key_bounds.rows_open`) is evaluated node by node. Half precision evaluated in
float32 (``compute``), masks that are not one additive float tensor, and any other node in the core
(a cast, a dropout in training, a ``where`` with a boolean mask) keep the node-by-node evaluation.
The values the relevance walk reads (A, the scores) are always computed node by node.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch
import torch.fx

from .attention_core import AttentionCore, first_keys

aten = torch.ops.aten

_SOFTMAX = {aten.softmax.int, aten._softmax.default, aten._safe_softmax.default}
_COPIES = {aten.clone.default, aten.alias.default, aten.detach.default, aten.contiguous.default}
_SCALINGS = {aten.mul.Scalar, aten.mul.Tensor, aten.div.Scalar, aten.div.Tensor}  # (by a number)
_TEST = {aten.eq.Scalar, aten.logical_not.default, aten.any.dim, aten.full_like.default}
#: the row test's constant: a masked score equals it (finfo.min or -inf)
_MASKED = -1e30


@dataclasses.dataclass(frozen=True)
class SdpaForm:
    """The operands of a core that computes softmax(q·kT·scale + mask)·v (:func:`sdpa_form`)."""

    q: torch.fx.Node
    kt: torch.fx.Node
    v: torch.fx.Node
    mask: Optional[torch.fx.Node]
    scale: float


def sdpa_form(core: AttentionCore) -> Optional[SdpaForm]:
    """The :class:`SdpaForm` of ``core`` or None: its nodes must be, in order, the product q·kT,
    scalings by numbers (before the mask), at most one addition of an operand from outside the core (the mask) before
    a softmax over the keys, the decomposed safe softmax's row test and ``where`` (0 on a row whose
    every masked score equals a constant ≤ -1e30), copies, and the product with v."""
    key = "relprop_sdpa_form"
    product = core.nodes[-1]
    if key in product.meta:
        return product.meta[key]
    form = _read_form(core)
    product.meta[key] = form
    return form


def _read_form(core: AttentionCore) -> Optional[SdpaForm]:
    nodes, inside = core.nodes, set(core.nodes)
    first, product = nodes[0], nodes[-1]
    if len(first.args) != 2 or len(product.args) != 2 or first.kwargs or product.kwargs:
        return None
    q, kt = first.args
    v = product.args[1]
    if any(not isinstance(n, torch.fx.Node) or n in inside for n in (q, kt, v)):
        return None
    x, scale, mask, softmax, tested = first, 1.0, None, None, None
    test, pending = set(), set()
    for node in nodes[1:-1]:
        t, args = node.target, node.args
        if t in _TEST:  # (the safe softmax's row test: checked at its where)
            pending.add(node)
        elif t in _SCALINGS and args[0] is x and softmax is None and mask is None and len(args) == 2 \
                and isinstance(args[1], (int, float)) and not isinstance(args[1], bool) and args[1] != 0:
            scale = scale * args[1] if t in (aten.mul.Scalar, aten.mul.Tensor) else scale / args[1]
            x = node
        elif t is aten.add.Tensor and softmax is None and mask is None and len(args) == 2 and not node.kwargs \
                and x in args and isinstance(args[1] if args[0] is x else args[0], torch.fx.Node) \
                and (args[1] if args[0] is x else args[0]) not in inside:
            mask, x = (args[1] if args[0] is x else args[0]), node
            tested = node
        elif t in _SOFTMAX and softmax is None and args[0] is x and _over_last(node):
            softmax, x = node, node
        elif t is aten.where.self and softmax is not None and _row_test(node, x, tested or first, test):
            x = node
        elif t in _COPIES and args[0] is x and len(args) == 1:
            x = node
        elif t is aten.dropout.default and args[0] is x and len(args) == 3 and args[2] is False:
            x = node
        else:
            return None
    if softmax is None or product.args[0] is not x or not pending <= test:
        return None
    return SdpaForm(q, kt, v, mask, float(scale))


def _over_last(node) -> bool:
    """The softmax runs over the last axis, in the input's dtype."""
    args = node.args
    dim = args[1] if len(args) > 1 else node.kwargs.get("dim")
    val = args[0].meta.get("val") if isinstance(args[0], torch.fx.Node) else None
    if not (isinstance(dim, int) and isinstance(val, torch.Tensor) and dim % val.dim() == val.dim() - 1):
        return False
    extra = args[2] if len(args) > 2 else node.kwargs.get("dtype", node.kwargs.get("half_to_float"))
    if node.target is aten._softmax.default:
        return extra is False
    return extra is None or extra == val.dtype  # (softmax.int's dtype: a cast would change the result)


def _row_test(where, softmax, scores, test: set) -> bool:
    """``where`` is where(not any(not eq(scores, c), -1), full_like(softmax, 0), softmax) with c ≤ -1e30
    (the safe softmax's zero on fully masked rows); its test's nodes are added to ``test``."""
    if len(where.args) != 3:
        return False
    cond, full, sm = where.args
    if sm is not softmax or not isinstance(full, torch.fx.Node) or full.target is not aten.full_like.default \
            or full.args[:1] != (softmax,) or full.args[1] not in (0, 0.0):
        return False
    chain, n = [], cond
    for target in (aten.logical_not.default, aten.any.dim, aten.logical_not.default, aten.eq.Scalar):
        if not isinstance(n, torch.fx.Node) or n.target is not target:
            return False
        chain.append(n)
        n = n.args[0]
    anyn, eq = chain[1], chain[3]
    if n is not scores or not isinstance(eq.args[1], (int, float)) or eq.args[1] > _MASKED:
        return False
    dim = anyn.args[1] if len(anyn.args) > 1 else None
    val = scores.meta.get("val")
    if not isinstance(dim, int) or val is None or dim % val.dim() != val.dim() - 1:
        return False
    test.update(chain + [full])
    return True


def sdpa_rows(form: SdpaForm, core: AttentionCore, value: Callable[[torch.fx.Node], torch.Tensor], lo: int, hi: int,
              keys: tuple) -> Optional[torch.Tensor]:
    """A·V on query rows ``lo:hi`` on their first ``keys[0]`` of ``keys[1]`` keys by
    :func:`torch.nn.functional.scaled_dot_product_attention`, without autograd; None where the
    operands are not what the kernel takes (floating tensors of one dtype, float32 or float64, a mask
    of that dtype broadcasting to the scores). The caller checks that every row has an open key."""
    q, kt, v = value(form.q), value(form.kt), value(form.v)
    if not all(torch.is_tensor(t) and t.dim() >= 3 for t in (q, kt, v)) \
            or q.dtype not in (torch.float32, torch.float64) or kt.dtype != q.dtype or v.dtype != q.dtype \
            or q.device != kt.device or v.device != q.device:
        return None
    kept, every = keys
    q = q[..., lo:hi, :] if q.shape[-2] > 1 else q
    kt = first_keys(core, form.kt, kt, every, kept)
    v = first_keys(core, form.v, v, every, kept)
    mask = None
    if form.mask is not None:
        m = value(form.mask)
        if not torch.is_tensor(m) or m.dtype != q.dtype or m.dim() < 2 or m.device != q.device:
            return None
        m = m[..., lo:hi, :] if m.shape[-2] > 1 else m
        mask = first_keys(core, form.mask, m, every, kept)
    if q.shape[:-2] != kt.shape[:-2] or q.shape[:-2] != v.shape[:-2] or q.shape[-1] != kt.shape[-2] \
            or kt.shape[-1] != v.shape[-2]:
        return None
    if mask is not None:
        try:
            torch.broadcast_shapes(mask.shape, q.shape[:-1] + (kt.shape[-1],))
        except RuntimeError:
            return None
    with torch.no_grad():
        return torch.nn.functional.scaled_dot_product_attention(q, kt.transpose(-1, -2), v, attn_mask=mask,
                                                                scale=form.scale)
