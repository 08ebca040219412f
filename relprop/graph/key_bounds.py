"""How many keys each chunk of query rows attends to: the causal (or padding) bound of a row-local
attention core, from its additive mask.

A causal decoder's query row i attends to keys 0..i only: the mask adds a large negative number
(``torch.finfo(dtype).min``, or -inf) to every later key's score, and the softmax gives those keys
exactly 0 (CVPR 2021 Eq. 1: A = softmax(Q·Kᵀ/√d + M)). A chunk of query rows lo..hi-1 then reads
no key at or after hi: its scores, softmax, A·V, gradients and relevance on those keys are 0
(every rule of the core gives a zero share where A is 0, and ∂A/∂scores is 0 there). The
row-chunked walk evaluates each chunk on its first keys only (:func:`key_bounds`,
:func:`relprop.graph.attention_core.evaluate_rows`), which halves its work on a causal model, and
puts the zeros back where a whole-width tensor is needed.

The bound is read from the mask's values, never assumed: a key is *closed* for a row where the mask
is ≤ :data:`CLOSED` (so exp underflows to exactly 0 next to any open key), *open* where it is
≥ :data:`OPEN`. A chunk keeps every key up to its last open one. All keys are kept (nothing is
cut) where the core has no single additive mask before its softmax, where a mask value lies between
the two thresholds, or where a row of the chunk has no open key (its softmax would not be 0 on the
closed keys: a fully masked row is uniform, or zero under the safe softmax).
"""
from __future__ import annotations

from typing import Callable, List, Optional

import torch
import torch.fx

from .attention_core import AttentionCore
from .run_memo import remembered

aten = torch.ops.aten

#: a mask value at or below this closes its key: exp(s + m - max) is exactly 0 next to an open key
CLOSED = -1e30
#: a mask value at or above this opens its key (a bias, 0 for a visible key)
OPEN = -1e15
_SOFTMAX = {aten.softmax.int, aten._softmax.default, aten._safe_softmax.default}


def additive_mask(core: AttentionCore) -> Optional[torch.fx.Node]:
    """The operand M of the core's one additive mask (``scores + M`` before the softmax), or None
    where the core has no softmax, several, another operand from outside before the softmax, or an
    operand after it other than V and a factor (a product keeps A's zeros; a sum would not)."""
    inside = set(core.nodes)
    softmax = [n for n in core.nodes if n.target in _SOFTMAX]
    if len(softmax) != 1:
        return None
    cut = core.nodes.index(softmax[0])
    masks = []
    for i, node in enumerate(core.nodes):
        outside = [a for a in node.all_input_nodes if a not in inside]
        if not outside or node is core.nodes[0] or node is core.nodes[-1] and outside == [node.args[1]]:
            continue
        if i < cut and node.target == aten.add.Tensor and len(outside) == 1:
            masks.append(outside[0])
        elif i < cut or node.target != aten.mul.Tensor:
            return None
    return masks[0] if len(masks) == 1 else None


def key_bounds(core: AttentionCore, value: Callable[[torch.fx.Node], torch.Tensor], chunks: List[tuple]) -> List[int]:
    """For each chunk (lo, hi) of query rows, how many of the first keys it attends to (all of them
    where nothing can be cut, module docstring). ``value(n)``: the whole value of an operand."""
    read = _reading(core, value, chunks)
    return [b for b, _ in read] if read is not None else [value(core.nodes[0].args[1]).shape[-1]] * len(chunks)


def rows_open(core: AttentionCore, value: Callable[[torch.fx.Node], torch.Tensor], chunks: List[tuple]) -> List[bool]:
    """For each chunk (lo, hi) of query rows, whether every row of it has an open key in the core's
    additive mask (True for every chunk where the core has no mask: its scores are finite; False
    where the mask cannot be read as :func:`key_bounds` reads it). A fully masked row is where the
    decomposed safe softmax (0) and a fused attention kernel (uniform weights) differ."""
    if additive_mask(core) is None:
        return [True] * len(chunks)
    read = _reading(core, value, chunks)
    return [o for _, o in read] if read is not None else [False] * len(chunks)


def _reading(core: AttentionCore, value, chunks: List[tuple]) -> Optional[List[tuple]]:
    """(bound, every row open) of each chunk, read once per run for each mask source
    (:func:`mask_source`); None where the core has no additive float mask over its keys."""
    keys = value(core.nodes[0].args[1]).shape[-1]
    node = additive_mask(core)
    mask = value(node) if node is not None else None
    if not (torch.is_tensor(mask) and mask.is_floating_point() and mask.dim() >= 2 and mask.shape[-1] == keys
            and keys > 1):
        return None
    key = ("key_bounds", mask_source(node), mask.dtype, keys, tuple(chunks))
    return list(remembered(key, lambda: _read(mask, keys, chunks)))


def mask_source(node: torch.fx.Node):
    """What a mask node's value is computed from, as a key that two nodes computing the same value
    share: ``where(m, a, b)`` of one boolean node ``m`` and two numbers, the form each block of an
    exported SDPA gives its own copy of the model's mask, is (where, m, a, b); any other node is
    itself. A node's value is the same throughout an engine run (a recomputed segment computes it
    alike), so the bounds are read once per run for each source (:func:`relprop.graph.run_memo.remembered`)."""
    if node.target is aten.where.self and len(node.args) == 3 and not node.kwargs \
            and isinstance(node.args[0], torch.fx.Node):
        branches = tuple(_number(a) for a in node.args[1:])
        if None not in branches:
            return (aten.where.self, node.args[0], *branches)
    return node


def _number(a):
    """A number as a key: ``a`` itself, or the number and options of a ``scalar_tensor`` node made
    from one (an exported SDPA's ``where(mask, scalar_tensor(0), scalar_tensor(min))``); None for
    anything else."""
    if isinstance(a, torch.fx.Node) and a.target is aten.scalar_tensor.default and len(a.args) == 1:
        a = (a.args[0], tuple(sorted((k, str(v)) for k, v in a.kwargs.items())))
        return a if isinstance(a[0], (int, float)) and not isinstance(a[0], bool) else None
    return (type(a), a) if isinstance(a, (int, float)) and not isinstance(a, bool) else None


def _read(mask: torch.Tensor, keys: int, chunks: List[tuple]) -> List[tuple]:
    """(bound, every row open) of each chunk (:func:`key_bounds`, :func:`rows_open`), read from
    ``mask`` one chunk of rows at a time (no temporary as large as the mask)."""
    split = mask.shape[-2] > 1
    out = []
    with torch.no_grad():
        for lo, hi in chunks:
            m = mask[..., lo:hi, :] if split else mask
            opened = m >= OPEN
            every_row = bool(opened.any(-1).all())
            if not bool((opened | (m <= CLOSED)).all()) or not every_row:
                out.append((keys, every_row))
                continue
            cols = opened.reshape(-1, keys).any(0)
            out.append((int(cols.nonzero().max()) + 1, True))
    return out
