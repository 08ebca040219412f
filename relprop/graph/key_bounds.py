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
from .host_reads import expect, speculating
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
    return list(remembered(key, lambda: _read_or_assume(node, mask, keys, chunks)))


def _read_or_assume(node: torch.fx.Node, mask: torch.Tensor, keys: int, chunks: List[tuple]) -> List[tuple]:
    """(bound, every row open) of each chunk: read from the mask (:func:`_read`), or, within a call that
    reads nothing on the host until its end (:mod:`relprop.graph.host_reads`), as the last careful read at
    this size found it, kept in the node's ``meta``: a chunk whose every row had an open key and no key at
    or after its last row open (a causal mask) is assumed so again, verified on the device
    (:func:`_not_causal`); the other chunks keep every key. The first such call at a size reads."""
    memo = node.meta.setdefault("relprop_causal_chunks", {})
    at = (mask.dtype, keys, tuple(chunks))
    causal = memo.get(at)
    if not speculating() or causal is None:
        out = _read(mask, keys, chunks)
        memo[at] = tuple(b == min(hi, keys) and every for (lo, hi), (b, every) in zip(chunks, out))
        return out
    assumed = [(lo, hi) for (lo, hi), c in zip(chunks, causal) if c]
    if assumed:
        expect(_not_causal(mask, keys, assumed), "the attention mask is causal on the chunks of query rows where "
                                                 "it was at the last call of this size")
    return [(min(hi, keys), True) if c else (keys, False) for (lo, hi), c in zip(chunks, causal)]


def _not_causal(mask: torch.Tensor, keys: int, chunks: List[tuple]) -> torch.Tensor:
    """True (a 0-d tensor) unless, on each chunk (lo, hi) of query rows, every mask value is closed or open
    (:data:`CLOSED`, :data:`OPEN`), every row has an open key and no key at or after ``hi`` is open."""
    split = mask.shape[-2] > 1
    bad = torch.zeros((), dtype=torch.bool, device=mask.device)
    with torch.no_grad():
        for lo, hi in chunks:
            m = mask[..., lo:hi, :] if split else mask
            opened = m >= OPEN
            bad = bad | ~(opened | (m <= CLOSED)).all() | ~opened.any(-1).all()
            if hi < keys:
                bad = bad | opened[..., hi:].any()
    return bad


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
    """(bound, every row open) of each chunk (:func:`key_bounds`, :func:`rows_open`), from ``mask`` one
    chunk of rows at a time (no temporary as large as the mask), read on the host once for all chunks."""
    split = mask.shape[-2] > 1
    facts = []
    with torch.no_grad():
        cols = torch.arange(1, keys + 1, device=mask.device)
        for lo, hi in chunks:
            m = mask[..., lo:hi, :] if split else mask
            opened = m >= OPEN
            every_row = opened.any(-1).all()
            classified = (opened | (m <= CLOSED)).all()
            last = torch.where(opened.reshape(-1, keys).any(0), cols, 0).amax()  # (last open key) + 1
            facts.append(torch.stack([every_row.long(), classified.long(), last]))
    out = []
    for every_row, classified, last in torch.stack(facts).tolist() if facts else []:
        out.append((keys, bool(every_row)) if not (classified and every_row) else (int(last), True))
    return out
