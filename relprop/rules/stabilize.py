"""Numerical stabilization shared by the rules.

LRP rules divide relevance by a pre-activation ``z``. Where ``z`` is zero (or not finite, e.g. a
``-inf`` attention mask added to a score) the share is undefined; the authors' code returns zero
there and pushes other denominators away from zero by 1e-9. We do the same, but push in the
direction of ``z``'s sign, so that a small negative ``z`` is not pushed *through* zero.
"""
from __future__ import annotations

import torch

from ..graph.broadcasting import broadcast_shape
from ..graph.host_reads import scope

DEFAULT_EPS = 1e-9


def promote(t):
    """A floating tensor in the precision relevance is computed in: at least float32 (float16 and
    bfloat16 are upcast), float64 kept. Anything else (integer and boolean tensors, numbers, None)
    is returned as it is. Used wherever relevance or a rule's arithmetic is computed, instead of
    ``.float()``, so that a float64 model gets float64 relevance."""
    if torch.is_tensor(t) and t.is_floating_point() and t.dtype not in (torch.float32, torch.float64):
        return t.float()
    return t


def fit_to_shape(rel: torch.Tensor, shape) -> torch.Tensor:
    """A relevance share computed in a broadcast shape, summed onto the operand's ``shape`` (the
    leading axes broadcasting added, then the axes of size 1)."""
    if tuple(rel.shape) == tuple(shape):
        return rel
    while rel.dim() > len(shape):
        rel = rel.sum(0)
    return rel.sum_to_size(shape)


def relevance_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype relevance has for activations of ``dtype``: float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _zero_undefined(out: torch.Tensor, den: torch.Tensor, pushed: bool = True) -> torch.Tensor:
    """The quotient ``out`` with 0 where ``den`` is 0 and where it is NaN or ±inf: the shares that
    :func:`safe_divide` and :func:`safe_divide_nonnegative` leave undefined. ``out`` is the new
    result of the division, which no backward saves, so it is changed in place also under autograd.
    ``pushed``: the division was by ``den`` moved ε away from 0, so a zero ``den`` gave a finite
    quotient that must be masked; without ε (``pushed=False``) the quotient by ±0 is ±inf or NaN
    whatever the numerator, and zeroing the non-finite values zeroes it (no mask is needed)."""
    if pushed or not out.is_floating_point():
        out = out.masked_fill_(den == 0, 0.0)
    return torch.nan_to_num_(out, nan=0.0, posinf=0.0, neginf=0.0) if out.is_floating_point() else out


def scratch(*tensors: torch.Tensor) -> bool:
    """Whether a rule may overwrite fresh temporaries computed from ``tensors`` in place: autograd
    records none of them. (A rule never overwrites its inputs, the relevance or a forward value;
    only tensors it made itself, to save attention-sized allocations on long inputs.)"""
    return not (torch.is_grad_enabled() and any(torch.is_tensor(t) and t.requires_grad for t in tensors))


def times_fresh(fresh: torch.Tensor, other) -> torch.Tensor:
    """``fresh ⊙ other`` for a temporary ``fresh`` the rule made itself: into ``fresh``'s buffer where
    it has the result's shape and dtype and autograd records neither (the same values: IEEE
    multiplication commutes), else a new tensor."""
    if torch.is_tensor(other) and scratch(fresh, other) and tuple(fresh.shape) == broadcast_shape(
            fresh.shape, other.shape) and fresh.dtype == torch.promote_types(fresh.dtype, other.dtype):
        return fresh.mul_(other)
    return fresh * other


def _in_place_ok(num: torch.Tensor, den: torch.Tensor) -> bool:
    """Whether ``num / den`` may be computed into a tensor shaped like ``den``: same dtype, ``num``
    broadcasts to ``den``'s shape, and autograd records neither."""
    if num.dtype != den.dtype or not den.is_floating_point() or not scratch(num, den):
        return False
    return broadcast_shape(num.shape, den.shape) == tuple(den.shape)


def _stabilized_quotient(num: torch.Tensor, den: torch.Tensor, eps: float) -> torch.Tensor:
    """num / (den + ε·sign den) in one new tensor shaped like ``den``, 0 where ``den`` is 0 or not
    finite and where the quotient overflows. sign 0 = 0 leaves a zero ``den`` at 0, and the quotient
    by 0 (±inf, or NaN for 0/0) is then zeroed with the other non-finite ones: no mask of the zeros
    is needed. Elsewhere ε·sign den = copysign(ε, den), so the values are :func:`safe_divide`'s bit
    for bit (IEEE addition and multiplication commute)."""
    out = torch.sign(den)
    torch.add(den, out, alpha=eps, out=out)  # (den + ε·sign den in one pass: ε·(±1 or 0) is exact)
    torch.div(num, out, out=out)
    return torch.nan_to_num_(out, nan=0.0, posinf=0.0, neginf=0.0)


def safe_divide(num: torch.Tensor, den: torch.Tensor, eps: float = DEFAULT_EPS) -> torch.Tensor:
    """``num / den`` with ``den`` pushed ``eps`` away from 0; 0 where ``den`` is 0 or not finite.

    Never returns NaN or inf for finite ``num``; a quotient that
    overflows is set to 0 as well. The stabilized denominator, the quotient and the zeroing share one
    buffer where the shapes allow (:func:`_in_place_ok`, :func:`_stabilized_quotient`): one
    tensor-sized allocation instead of four and no mask of the zeros, the same values bit for bit
    (on attention-sized tensors each allocation is fresh memory the kernel faults in page by page).
    """
    if eps and torch.is_tensor(num) and _in_place_ok(num, den):
        return _stabilized_quotient(num, den, eps)
    if eps:
        out = num / (den + torch.copysign(torch.full((), eps, dtype=den.dtype, device=den.device), den))
    else:
        out = num / den
    return _zero_undefined(out, den, pushed=bool(eps))


def safe_divide_nonnegative(num: torch.Tensor, den: torch.Tensor, eps: float = DEFAULT_EPS) -> torch.Tensor:
    """:func:`safe_divide` for a denominator known to be ≥ 0 (bit for bit the same there, one pass
    fewer: ε is added rather than copied in the sign's direction). Where ``den`` < 0 the result is
    not :func:`safe_divide`'s: the caller must discard it."""
    if eps and torch.is_tensor(num) and _in_place_ok(num, den):
        return _stabilized_quotient(num, den, eps)  # den + ε where den > 0, as below
    return _zero_undefined(num / (den + eps) if eps else num / den, den, pushed=bool(eps))


def _row_has(flat: torch.Tensor) -> torch.Tensor:
    """[rows] bool: the rows of the 2-d ``flat`` with an entry other than ±0 (NaN counts). Long rows by
    their max and min (two reductions and no tensor-sized mask, a tenth of the time of
    ``(flat != 0).any(-1)`` on CPU), short ones by the mask."""
    if flat.shape[-1] >= SPARSE_ROW:
        return (flat.amax(-1) != 0) | (flat.amin(-1) != 0)
    return (flat != 0).any(-1)


def _nonzero_rows(flat: torch.Tensor) -> torch.Tensor:
    """The indices of the rows of the 2-d ``flat`` with an entry other than ±0 (read on the host)."""
    return ((flat.amax(-1) != 0) | (flat.amin(-1) != 0)).nonzero().squeeze(1)


#: rows (along the last dimension) at least this long are skipped by :func:`on_nonzero_rows` when
#: they hold only zeros (a language model's vocabulary-sized logits, seeded at one position)
SPARSE_ROW = 8192


def _on_bounded_rows(fn, flat: torch.Tensor, others, bound: int, reads) -> torch.Tensor:
    """``fn`` on the rows of ``flat`` with an entry other than 0, at most ``bound`` of them, found on the
    device (no host read: a fixed number of rows, the first ``bound`` by index, the ones past the last
    such row padded with a row of zero relevance, which ``fn`` maps to zero); 0 on the other rows.
    ``others``: tensors with ``flat``'s rows, gathered alike. That no more than ``bound`` rows have an
    entry is the assumption of the call's ``reads`` (:meth:`relprop.graph.host_reads.Reads.expect`)."""
    positions = flat.shape[0]
    key = torch.where(_row_has(flat), torch.arange(positions, device=flat.device), positions)
    first = key.topk(bound + 1, largest=False, sorted=True).values
    reads.expect(first[bound] != positions, f"the relevance of a layer reaches at most {bound} of its positions "
                                            "(the rows the target reads)")
    first = first[:bound]
    rows = first.clamp_max(positions - 1)
    r = flat.index_select(0, rows) * (first < positions)[:, None].to(flat.dtype)
    part = fn(r, *(t.index_select(0, rows) for t in others))
    out = part.new_zeros((positions, part.shape[-1]))
    return out.index_add_(0, rows, part)


def on_nonzero_rows(fn, g: torch.Tensor, *others: torch.Tensor, bound=None, reads=None) -> torch.Tensor:
    """``fn(g, *others)`` evaluated only on the rows (along the last dimension) where ``g`` is not
    all zero, 0 on the others, when the rows are long (≥ :data:`SPARSE_ROW`) and at most half of
    them are nonzero; else ``fn`` on everything. ``fn`` maps rows to rows (its output's last
    dimension may differ from g's: a gradient times a matrix) and must map a zero row of g to a
    zero row, such as a gradient divided by something after :func:`safe_divide` or multiplied by
    a finite stabilizer and a weight; ``others`` have g's shape. Equal to ``fn`` on everything up
    to the sign of zeros and, when ``fn`` contains a matrix product, float rounding (a product of
    fewer rows may sum in another order). It saves the passes over the rows the relevance never
    reaches: a decoder explained at its last position gets a seed that is zero at every other
    position of its [batch, positions, vocabulary] logits (Achtibat et al., ICML 2024, Eq. 8 at
    the output layer).

    Within a call that reads nothing on the host (``reads``: its
    :class:`relprop.graph.host_reads.Reads`, by default the open scope's) the rows are found on the
    device, at most ``bound`` of them (the rows the target reads: ``Target.rows``); without a bound
    every row is computed."""
    n = g.shape[-1] if g.dim() >= 2 else 0
    if n < SPARSE_ROW or any(t.shape != g.shape for t in others):
        return fn(g, *others)
    flat = g.reshape(-1, n)
    reads = reads if reads is not None else scope()
    if reads is not None:
        if bound is None or 2 * bound > flat.shape[0]:
            return fn(g, *others)
        part = _on_bounded_rows(fn, flat, [t.reshape(-1, n) for t in others], bound, reads)
        return part.reshape(*g.shape[:-1], part.shape[-1])
    rows = _nonzero_rows(flat)
    if 2 * rows.numel() > flat.shape[0]:
        return fn(g, *others)
    part = fn(flat[rows], *(t.reshape(-1, n)[rows] for t in others))
    out = torch.zeros((flat.shape[0], part.shape[-1]), dtype=part.dtype, device=part.device)
    out[rows] = part
    return out.reshape(*g.shape[:-1], part.shape[-1])


#: :func:`on_relevant_rows` computes on the rows with relevance only where there are at least this
#: many rows and at most half of them have any
RELEVANT_ROWS = 64


def on_relevant_rows(fn, relevance: torch.Tensor, *rows, bound=None) -> torch.Tensor:
    """``fn(relevance, *rows)`` computed only on the positions (all axes but the last) where
    ``relevance`` is not all zero, 0 at the others, when there are at least :data:`RELEVANT_ROWS`
    positions and at most half of them have relevance; else ``fn`` on everything. ``rows``: tensors
    (or None) with ``relevance``'s positions and their own last axis (a layer's input, its output),
    ``fn`` maps each position's row to a row (a linear layer's rule) and a zero relevance row to a
    zero row (a rule linear in the relevance: LRP-αβ's x ⊙ ((R / z) W) is 0 where R is). Equal to
    ``fn`` on everything up to the sign of zeros and float rounding (products of fewer rows may sum
    in another order). A decoder explained at its last position has relevance at that position
    only in its head and its last block's feed-forward layers and projections (CVPR 2021 Eq. 5 on
    one row instead of thousands).

    Within a call that reads nothing on the host (:mod:`relprop.graph.host_reads`) the positions are
    found on the device, at most ``bound`` of them (``RuleContext.relevant_rows``: the walk's bound on the
    positions the target's relevance reaches at this node); without a bound every position is computed."""
    n = relevance.shape[-1] if relevance.dim() >= 2 else 0
    positions = relevance.numel() // n if n else 0
    if positions < RELEVANT_ROWS or any(t is not None and t.shape[:-1] != relevance.shape[:-1] for t in rows):
        return fn(relevance, *rows)
    flat = relevance.reshape(-1, n)
    reads = scope()
    if reads is not None:
        if bound is None or 2 * bound > positions:
            return fn(relevance, *rows)
        given = [t for t in rows if t is not None]

        def on(r, *parts):
            it = iter(parts)
            return fn(r, *(None if t is None else next(it) for t in rows))
        part = _on_bounded_rows(on, flat, [t.reshape(-1, t.shape[-1]) for t in given], bound, reads)
        return part.reshape(*relevance.shape[:-1], part.shape[-1])
    keep = _nonzero_rows(flat)
    if 2 * keep.numel() > positions:
        return fn(relevance, *rows)
    part = fn(flat[keep], *(None if t is None else t.reshape(-1, t.shape[-1])[keep] for t in rows))
    out = part.new_zeros((positions, part.shape[-1]))
    out[keep] = part
    return out.reshape(*relevance.shape[:-1], part.shape[-1])


def finite(t: torch.Tensor) -> torch.Tensor:
    """``t`` with NaN and ±inf replaced by 0 (used on products of relevance with masks)."""
    return torch.nan_to_num(t, nan=0.0, posinf=0.0, neginf=0.0)
