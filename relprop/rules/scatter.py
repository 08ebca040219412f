"""Writes into a tensor (``index_put``, ``slice_scatter``, ``select_scatter``) and reductions that are
homogeneous of degree one (``linalg_vector_norm``, ``amax``/``amin``, ``max.dim``/``min.dim``).

Writes
------
``index_put(x, indices, v)`` (``x[indices] = v``: Wav2Vec2 zeroes or replaces masked frames with a boolean
mask whenever an attention mask is given), ``slice_scatter(x, src, ...)`` (``x[..., a:b] = src``: Funnel's
relative attention) and ``select_scatter`` copy elements: each output element comes from exactly one
input element. Their rule is the adjoint of that index map, which is also their gradient: R_x is R with
the written positions zeroed, R_v = R at the written positions (summed over v's broadcast copies). Every
element's relevance goes to where it came from: conservative (``"base"``, every preset).

``masked_scatter(x, mask, src)`` (``x[mask] = src`` in order: vision-language models write the projected image
features into the placeholder positions of the text embeddings this way) is such a copy too: the k-th
``True`` position of the (broadcast) mask takes the k-th element of ``src``. R_x is R with the masked
positions zeroed; R_src holds, at its first k elements, the relevance of the k masked positions in order
(zeros at src's unused tail). Its gradient is the same map (``"base"``, every preset).

``index_put(..., accumulate=True)`` (``x[indices] += v``; ``F.fold`` adds overlapping patches this way)
is a sum, y = x + scatter(v): the z-rule of a sum (Bach et al. 2015, Eq. 56–58), R_x = x ⊙ R / y and
R_v = v ⊙ (R / y)[indices], in the paper presets; the ε-rule (AttnLRP Eq. 8, the same with y + ε·sign y)
in AttnLRP's. Both conserve where y ≠ 0.

Homogeneous reductions
----------------------
A p-norm ‖x‖_p, a maximum and a minimum (over some dimensions) are positively homogeneous of degree
one: f(t x) = t f(x) for t > 0, so by Euler's theorem Σ_i x_i ∂f/∂x_i = f(x). Gradient × input,

    R_i = x_i · ∂f/∂x_i · R / f(x),

therefore hands out exactly R (where f(x) ≠ 0): for the 2-norm R_i = x_i² / ‖x‖² · R, for a p-norm
|x_i|^p / ‖x‖_p^p · R, for a maximum all of R to the maximal element (as the gradient: ``amax`` splits a
tie evenly, ``max.dim`` gives it to the index it returns). In a one-backward preset the op's own
gradient is this rule. ``max.dim`` / ``min.dim`` return (values, indices); only the values carry
relevance.
"""
from __future__ import annotations

import dataclasses

import torch

from .attnlrp import ATTNLRP
from .generic import gradient_times_input
from .gradient_forms import epsilon_stabilized, plain
from .rule_registry import rule
from .spec import GradientForm
from .stabilize import promote, safe_divide

aten = torch.ops.aten
PAPER_PRESETS = ("chefer2021", "lrp")

#: the reductions that are positively homogeneous of degree one
HOMOGENEOUS = (aten.linalg_vector_norm.default, aten.amax.default, aten.amin.default, aten.max.dim, aten.min.dim)


def _indices(ctx):
    return [i for i in ctx.args[1]]


def _accumulates(args) -> bool:
    return len(args) > 3 and bool(args[3])


def _to_values(ctx, at: torch.Tensor, full: torch.Tensor):
    """The share of the written values ``v``: ``at`` (the written positions' relevance, shaped like
    ``x[indices]``) summed to v's shape when v carries relevance on; else ``full`` (the same relevance
    in the output's shape), which the walk books per sample as absorbed by the constant (a learned fill
    vector, zeros)."""
    v = ctx.args[2]
    if ctx.live[2] is True:
        return at.sum_to_size(v.shape) if tuple(at.shape) != tuple(v.shape) else at
    return full


def _routed(ctx, relevance):
    """``x[indices] = v``: R_x = R with the written positions zeroed; R_v = R there (module docstring)."""
    v = ctx.args[2]
    idx = _indices(ctx)
    zero = torch.zeros((), dtype=relevance.dtype, device=relevance.device)
    r_x = aten.index_put.default(relevance, idx, zero)
    r_v = _to_values(ctx, aten.index.Tensor(relevance, idx), relevance - r_x) if torch.is_tensor(v) else None
    return (r_x, None, r_v) + (None,) * (len(ctx.args) - 3)


def _summed(ctx, relevance):
    """``x[indices] += v`` as a sum y = x + scatter(v): R_x = x ⊙ S, R_v = v ⊙ S[indices] with S = R / y
    (stabilized by ε; 0 where y = 0)."""
    x, _, v = ctx.args[:3]
    idx = _indices(ctx)
    y = promote(ctx.out)
    s = safe_divide(promote(relevance), y, ctx.eps)
    r_x = promote(x) * s
    r_v = None
    if torch.is_tensor(v):
        at = aten.index.Tensor(s, idx)
        vals = promote(v).expand_as(at)
        r_v = _to_values(ctx, vals * at, aten.index_put.default(torch.zeros_like(s), idx, vals, True) * s)
    return (r_x, None, r_v) + (None,) * (len(ctx.args) - 3)


def index_put_shares(ctx, relevance):
    """``x[indices] = v`` (boolean masks included): relevance goes back to where each element came
    from; ``x[indices] += v``: the z-rule (ε-rule) of the sum (module docstring)."""
    if _accumulates(ctx.args):
        return _summed(ctx, relevance)
    return _routed(ctx, relevance)


_EPSILON = epsilon_stabilized()


def _index_put_replacement(node, live, eps):
    """One-backward form of ``index_put``: its own gradient when it writes (routing); the ε-rule when
    it adds (``accumulate=True``)."""
    return _EPSILON(node, live, eps) if _accumulates(node.args) else None


def _index_put_lost(node, args, out, relevance, eps):
    """What the ε-rule's stabilizer keeps when ``index_put`` adds; nothing when it writes."""
    return _EPSILON.lost(node, args, out, relevance, eps) if _accumulates(args) else None


_index_put_form = GradientForm(_index_put_replacement, lost=_index_put_lost)


@rule(aten.index_put.default, aten.index_put_.default, preset=PAPER_PRESETS)
def index_put_z(ctx, relevance):
    """``x[indices] = v``: routed (module docstring); ``x[indices] += v``: the z-rule of the sum."""
    return index_put_shares(ctx, relevance)


@rule(aten.index_put.default, aten.index_put_.default, preset=ATTNLRP, gradient_form=_index_put_form)
def index_put_epsilon(ctx, relevance):
    """``x[indices] = v``: routed; ``x[indices] += v``: the ε-rule of the sum (AttnLRP Eq. 8)."""
    return index_put_shares(ctx, relevance)


@rule(aten.slice_scatter.default, preset="base")
def slice_scatter_route(ctx, relevance):
    """``slice_scatter(x, src, dim, start, end, step)``: the slice's relevance goes to ``src``, the
    rest to ``x`` (module docstring)."""
    x, src = ctx.args[:2]
    dim = ctx.args[2] if len(ctx.args) > 2 else ctx.kwargs.get("dim", 0)
    start = ctx.args[3] if len(ctx.args) > 3 else ctx.kwargs.get("start")
    end = ctx.args[4] if len(ctx.args) > 4 else ctx.kwargs.get("end")
    step = ctx.args[5] if len(ctx.args) > 5 else ctx.kwargs.get("step", 1)
    r_src = aten.slice.Tensor(relevance, dim, start, end, step)
    r_x = relevance.slice_scatter(torch.zeros_like(r_src), dim, start, end, step)
    return (r_x, r_src) + (None,) * (len(ctx.args) - 2)


@rule(aten.select_scatter.default, preset="base")
def select_scatter_route(ctx, relevance):
    """``select_scatter(x, src, dim, index)``: the selected slice's relevance goes to ``src``."""
    dim, index = ctx.args[2], ctx.args[3]
    r_src = relevance.select(dim, index)
    r_x = relevance.select_scatter(torch.zeros_like(r_src), dim, index)
    return (r_x, r_src, None, None)


@rule(aten.masked_scatter.default, preset="base")
def masked_scatter_route(ctx, relevance):
    """``masked_scatter(x, mask, src)``: the masked positions' relevance goes, in order, to the elements of
    ``src`` that filled them; the rest to ``x`` (module docstring)."""
    x, mask, src = ctx.args[:3]
    mask = mask.expand(relevance.shape) if tuple(mask.shape) != tuple(relevance.shape) else mask
    zero = torch.zeros((), dtype=relevance.dtype, device=relevance.device)
    r_x = relevance.masked_fill(mask, zero)
    r_x = r_x.sum_to_size(x.shape) if tuple(x.shape) != tuple(relevance.shape) else r_x
    taken = relevance[mask]
    r_src = relevance.new_zeros(src.numel())
    r_src[:taken.numel()] = taken
    return (r_x, None, r_src.reshape(src.shape)) + (None,) * (len(ctx.args) - 3)


def homogeneous_shares(ctx, relevance):
    """R_i = x_i ∂f/∂x_i · R / f(x) for the op's input (argument 0); nothing to its other arguments
    (``ord``, ``dim``, ``keepdim``). Exact by Euler's theorem (module docstring)."""
    live = (ctx.live[0],) + (False,) * (len(ctx.args) - 1)
    shares = gradient_times_input(dataclasses.replace(ctx, live=live), relevance)
    return (shares[0],) + (None,) * (len(ctx.args) - 1)


@rule(*HOMOGENEOUS, preset=PAPER_PRESETS + (ATTNLRP,), gradient_form=plain)
def homogeneous_reduction(ctx, relevance):
    """‖x‖_p, max, min over some dimensions: gradient × input, which hands out exactly R (module docstring)."""
    return homogeneous_shares(ctx, relevance)
