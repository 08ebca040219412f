"""The attention core of a block, and whether it can be evaluated in chunks of query rows.

The core of an attention block is every node on a path from the scores product Q·Kᵀ to the
product with the values A·V (CVPR 2021 Eq. 1–3: A = softmax(Q·Kᵀ/√d + mask), O = A·V): the scale,
the mask's sum or ``where``, casts, the softmax and its safe-softmax row test, dropout copies. Each
of these keeps the query rows apart when the softmax and every reduction run over the key axis:
row i of O depends only on row i of Q (and of a mask with a query axis) and on the whole of K and V.
Then the core may be evaluated one chunk of query rows at a time, and no tensor of
heads × queries × keys need exist at once (the row-chunked walk).

:func:`find_core` finds a block's core and checks, op by op, that it is row-local, or says why not;
:func:`evaluate_rows` evaluates the core on one chunk of rows. The row-chunked walk of a folded run
(:mod:`relprop.engine.chunked_walk`, off unless ``relprop.engine.chunked_core.ROW_CHUNK`` is set)
evaluates, differentiates, walks and folds each such core in chunks.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Optional, Tuple

import torch
import torch.fx

from ..errors import RelpropError
from .nodes import ancestors, descendants, evaluate

aten = torch.ops.aten

#: element-wise ops (and copies) that keep every (query, key) entry apart; their tensor operands are
#: split along the query axis where they have one, else read whole (broadcast)
ELEMENTWISE = {aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar, aten.add.Tensor, aten.add.Scalar,
               aten.sub.Tensor, aten.sub.Scalar, aten.where.self, aten.masked_fill.Scalar, aten.masked_fill.Tensor,
               aten.eq.Scalar, aten.eq.Tensor, aten.ne.Scalar, aten.logical_not.default, aten.full_like.default,
               aten.clone.default, aten._to_copy.default, aten.alias.default, aten.detach.default,
               aten.contiguous.default, aten.dropout.default, aten.tanh.default, aten.exp.default,
               aten.neg.default}
#: reductions and normalizations over one axis: row-local when that axis is the key axis (the last)
OVER_KEYS = {aten.softmax.int: 1, aten._softmax.default: 1, aten._safe_softmax.default: 1, aten.any.dim: 1,
             aten.amax.default: 1, aten.sum.dim_IntList: 1, aten.logsumexp.default: 1}
PRODUCTS = {aten.matmul.default, aten.bmm.default}
#: checks export leaves in the graph: they read a value and make none
CHECKS = {aten._assert_tensor_metadata.default}


@dataclasses.dataclass(frozen=True)
class AttentionCore:
    """The row-local core of one attention block (:func:`find_core`).

    Attributes
    ----------
    block : the block's index.
    nodes : the core's nodes in graph order, from the scores product to the product with V.
    rows : operands from outside the core split along the query axis (dim -2): Q, a mask with a
        query axis.
    whole : operands from outside the core read whole by every chunk: Kᵀ, V, broadcast masks.
    queries : the size of the query axis.
    """

    block: int
    nodes: Tuple[torch.fx.Node, ...]
    rows: Tuple[torch.fx.Node, ...]
    whole: Tuple[torch.fx.Node, ...]
    queries: int


def _shape(node) -> Optional[tuple]:
    v = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def _over_last(node) -> bool:
    """A reduction or softmax of ``node`` runs over the last axis of its operand only."""
    shape = _shape(node.args[0]) or ()
    pos = OVER_KEYS[node.target]
    dim = node.args[pos] if len(node.args) > pos else node.kwargs.get("dim")
    dims = list(dim) if isinstance(dim, (list, tuple)) else [dim]
    return len(shape) > 0 and len(dims) == 1 and isinstance(dims[0], int) and dims[0] % len(shape) == len(shape) - 1


def find_core(block, live) -> Tuple[Optional[AttentionCore], str]:
    """(the row-local core of ``block``, "") or (None, why it is not row-local).

    ``block`` is a :class:`relprop.graph.attention_blocks.BlockInfo`, ``live`` the graph's
    input-dependent nodes (the product must depend on the scores through them). The core is the
    scores product, the block's product with V and every node on a path between them (boolean ones
    included: the safe softmax's row test); it is row-local when each of its nodes is an element-wise
    op, a copy, or a softmax or reduction over the key axis (the last), every tensor it holds keeps the query axis
    at dim -2, no node but the product is read outside the core, and each operand from outside the
    core either has that query axis (it is split) or broadcasts over it (it is read whole).
    """
    if block.scores is None or block.product is None:
        return None, "the block has no scores product Q·Kᵀ"
    if block.groups:
        return None, "the block attends within groups of tokens (windows) folded into the batch axis"
    scores, product = block.scores, block.product
    within = set(scores.graph.nodes)  # (the safe softmax's row test is boolean: not live)
    between = descendants([scores], within) & ancestors([product], within)
    if product not in descendants([scores], live):
        return None, "the product with the values does not depend on the scores through input-dependent nodes"
    order = [n for n in scores.graph.nodes if n in between]
    queries = (_shape(scores) or (0, 0))[-2]
    rows, whole = [], []
    for node in order:
        shape = _shape(node)
        if shape is None or len(shape) < 2 or shape[-2] != queries:
            return None, f"{node.name} ({node.target}) does not keep the query axis at dim -2"
        if node in (scores, product):
            if node.target not in PRODUCTS:
                return None, f"{node.name} ({node.target}) is not a matmul"
        elif node.target in OVER_KEYS:
            if not _over_last(node):
                return None, f"{node.name} ({node.target}) reduces over another axis than the keys"
        elif node.target not in ELEMENTWISE:
            return None, f"{node.name} ({node.target}) is not known to keep the query rows apart"
        if node is not product:
            outside = [u for u in node.users if u not in between and u.target not in CHECKS]
            if outside:
                return None, f"{node.name} is also read outside the attention core (by {outside[0].name})"
        for i, arg in enumerate(node.all_input_nodes):
            if arg in between:
                continue
            if node is product or (node is scores and arg is node.args[1]):
                whole.append(arg)  # V, Kᵀ: every row reads all of them
                continue
            s = _shape(arg)
            if s is None or len(s) < 2 or s[-2] == 1:
                whole.append(arg)  # a scalar tensor, a vector over the keys, a mask without query axis
            elif s[-2] == queries and (node is not scores or arg is node.args[0]):
                rows.append(arg)
            else:
                return None, f"operand {arg.name} of {node.name} has {s[-2]} rows where the core has {queries}"
    if not rows:  # (CaiT's and XCiT's class attention: one query, read as a vector; nothing to split)
        return None, "no operand carries the query rows"
    return AttentionCore(block.index, tuple(order), tuple(dict.fromkeys(rows)), tuple(dict.fromkeys(whole)),
                         queries), ""


def key_axis(core: AttentionCore, node: torch.fx.Node, v, keys: int) -> Optional[int]:
    """The axis of operand ``node`` (value ``v``) of ``core`` that runs over the ``keys`` keys, or None
    where it has none (Q; an operand that broadcasts over the keys): -2 for V (the product's second operand), -1 for
    Kᵀ (the scores product's second operand) and for an element-wise operand (a mask, a bias) whose
    last axis has the keys' size."""
    if not torch.is_tensor(v) or v.dim() < 2 or node is core.nodes[0].args[0]:  # (Q: no keys' axis)
        return None
    if node is core.nodes[-1].args[1]:
        return -2
    if node is core.nodes[0].args[1] or (v.shape[-1] == keys and keys > 1):
        return -1
    return None


def first_keys(core: AttentionCore, node: torch.fx.Node, v, keys: int, kept: int):
    """``v``, an operand of ``core`` read with the keys' axis, cut to its first ``kept`` of ``keys``
    keys (:func:`key_axis`); unchanged where it has no keys' axis or ``kept`` is all of them."""
    if kept >= keys:
        return v
    axis = key_axis(core, node, v, keys)
    if axis is None:
        return v
    return v[..., :kept] if axis == -1 else v[..., :kept, :]


def pad_keys(t: Optional[torch.Tensor], keys: int) -> Optional[torch.Tensor]:
    """``t`` (rows of a map, or of a term of it, on the first keys: :func:`first_keys`) with zeros on
    the keys after them, up to ``keys`` (what the whole-width computation gives there)."""
    if t is None or t.shape[-1] == keys:
        return t
    return torch.nn.functional.pad(t, (0, keys - t.shape[-1]))


def _keys_axis(part_shape, shape, what: str) -> Optional[int]:
    """The one axis along which ``part_shape`` (a chunk's share or gradient of an operand, on the
    chunk's first keys) is shorter than ``shape`` (on all keys); None where they are equal."""
    differ = [d for d in range(len(shape)) if part_shape[d] != shape[d]] if len(part_shape) == len(shape) else None
    if differ is None or len(differ) > 1 or differ and part_shape[differ[0]] > shape[differ[0]]:
        raise RelpropError(f"{what} of shape {tuple(part_shape)} does not fit its operand's {tuple(shape)} "
                           "(a bug of relprop's row-chunked walk: please report it)")
    return differ[0] if differ else None


def keys_padded(part: torch.Tensor, shape, what: str) -> torch.Tensor:
    """``part`` (on the chunk's first keys) with zeros on the later keys, up to ``shape`` (what the
    whole-width computation gives there: the chunk attends to none of them)."""
    axis = _keys_axis(part.shape, shape, what)
    if axis is None:
        return part
    pad = [0, 0] * (part.dim() - axis % part.dim())
    pad[-1] = shape[axis] - part.shape[axis]
    return torch.nn.functional.pad(part, pad)


def add_on_first_keys(total: torch.Tensor, part: torch.Tensor, what: str) -> None:
    """Add ``part`` (on the chunk's first keys) into ``total`` (on all keys) in place: into the first
    keys, the later ones' terms being 0 (no padded copy of ``part``)."""
    axis = _keys_axis(part.shape, total.shape, what)
    (total if axis is None else total.narrow(axis, 0, part.shape[axis])).add_(part)


def evaluate_rows(core: AttentionCore, value: Callable[[torch.fx.Node], Any], lo: int, hi: int,
                  compute: Optional[torch.dtype] = None, sliced: bool = False,
                  leaf: Optional[torch.fx.Node] = None, fns: Optional[Dict[torch.fx.Node, Callable]] = None,
                  keys: Optional[tuple] = None, product: bool = True) -> Dict[torch.fx.Node, Any]:
    """The values of the core's nodes on query rows ``lo:hi``, from ``value(n)``, the whole value of
    each operand outside the core (rows of those in ``core.rows`` are taken here; ``sliced``: value
    gives those rows already). Row i of each value equals row ``lo + i`` of the node's whole value
    (the core is row-local), to the rounding of the products computed on fewer rows. ``leaf``: a core
    node whose value is detached and made to require grad, so that gradients can be taken with
    respect to it (under ``torch.enable_grad``). ``fns``: replacements of some nodes' ops (the
    modified-gradient functions of :mod:`relprop.engine.fast_path`), as :func:`evaluate` takes them.
    ``keys`` = (kept, all): the chunk's rows attend to none of the keys after the first ``kept`` of
    ``all`` (:func:`relprop.graph.key_bounds.key_bounds`), and the core is evaluated on those
    first keys only (:func:`first_keys`): every value then has ``kept`` keys, and equals the first
    ``kept`` keys of the whole one (the others' attention is exactly 0). ``product=False``: every
    node but the last (the product A·V) is evaluated."""
    split = set() if sliced else set(core.rows)
    out: Dict[torch.fx.Node, Any] = {}

    def val(n):
        if n in out:
            return out[n]
        v = value(n)
        v = v[..., lo:hi, :] if n in split else v
        return first_keys(core, n, v, keys[1], keys[0]) if keys is not None else v

    for node in core.nodes if product else core.nodes[:-1]:
        v = evaluate(node, val, fns.get(node) if fns else None, compute=compute)
        out[node] = v.detach().requires_grad_(True) if node is leaf else v
    return out
