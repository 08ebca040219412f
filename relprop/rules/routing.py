"""Shape-only ops: relevance is routed to where each output element came from, never changed.

These ops only move, copy or select elements (view, permute, slice, cat, expand, ...). Their
relevance rule is the adjoint of the index map: the same as their gradient's vector-Jacobian
product, which sums the relevance of copies (``expand``) and puts zeros where nothing was selected
(``slice``, ``select``). The total relevance is unchanged except for elements a selection drops,
which receive none ("shape-only ops route relevance without changing it").
Registered in the ``"base"`` preset, shared by every preset.
"""
from __future__ import annotations

import operator

import torch

from .rule_registry import rule

aten = torch.ops.aten


def _first_only(ctx, r):
    return (r,) + (None,) * (len(ctx.args) - 1)


@rule(aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.flatten.using_ints,
      aten.unflatten.int, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.view_as.default,
      aten.unsqueeze.default, aten.alias.default, aten.clone.default, aten.contiguous.default,
      aten.detach.default, aten.lift_fresh_copy.default, aten._to_copy.default, aten.to.dtype,
      aten.dropout.default, aten.native_dropout.default, aten.view_copy.default, preset="base")
def reshape_route(ctx, relevance):
    """View-like ops and copies: the relevance is reshaped back to the input's shape.

    ``dropout`` is here too: the graph is captured in eval mode, where it is the identity.
    """
    x = ctx.args[0]
    return _first_only(ctx, relevance.reshape(x.shape))


@rule(aten.permute.default, preset="base")
def permute_route(ctx, relevance):
    """Inverse permutation of the relevance."""
    dims = [d % relevance.dim() for d in ctx.args[1]]
    inverse = [0] * len(dims)
    for i, d in enumerate(dims):
        inverse[d] = i
    return (relevance.permute(inverse), None)


@rule(aten.transpose.int, preset="base")
def transpose_route(ctx, relevance):
    """Transpose the relevance back."""
    return (relevance.transpose(ctx.args[1], ctx.args[2]), None, None)


@rule(aten.t.default, aten.numpy_T.default, preset="base")
def t_route(ctx, relevance):
    """Transpose the relevance back."""
    return (relevance.t() if relevance.dim() <= 2 else relevance.permute(*reversed(range(relevance.dim()))),)


@rule(aten.expand.default, aten.expand_as.default, aten.expand_copy.default, preset="base")
def expand_route(ctx, relevance):
    """Copies made by broadcasting: their relevance is summed back onto the original."""
    x = ctx.args[0]
    r = relevance
    while r.dim() > x.dim():
        r = r.sum(0)
    return _first_only(ctx, r.sum_to_size(x.shape))


@rule(aten.slice.Tensor, aten.slice_copy.Tensor, preset="base")
def slice_route(ctx, relevance):
    """Relevance goes back to the selected elements; dropped elements receive none."""
    x = ctx.args[0]
    dim = ctx.args[1] if len(ctx.args) > 1 else 0
    start = ctx.args[2] if len(ctx.args) > 2 else None
    end = ctx.args[3] if len(ctx.args) > 3 else None
    step = ctx.args[4] if len(ctx.args) > 4 else 1
    out = relevance.new_zeros(x.shape).slice_scatter(relevance, dim, start, end, step)
    return _first_only(ctx, out)


@rule(aten.select.int, aten.select_copy.int, preset="base")
def select_route(ctx, relevance):
    """Relevance goes back to the selected index (e.g. the class token the head reads)."""
    x = ctx.args[0]
    out = relevance.new_zeros(x.shape).select_scatter(relevance, ctx.args[1], ctx.args[2])
    return (out, None, None)


@rule(aten.cat.default, aten.concat.default, preset="base")
def cat_route(ctx, relevance):
    """Each concatenated piece gets back its slice of the relevance (e.g. [CLS] ; patches)."""
    tensors = ctx.args[0]
    dim = ctx.args[1] if len(ctx.args) > 1 else 0
    dim = dim % relevance.dim()
    pieces = []
    offset = 0
    for t in tensors:
        if t.dim() == 1 and t.numel() == 0:  # legacy empty tensors are skipped by cat
            pieces.append(None)
            continue
        n = t.shape[dim]
        pieces.append(relevance.narrow(dim, offset, n))
        offset += n
    return (pieces,) + (None,) * (len(ctx.args) - 1)


@rule(aten.stack.default, preset="base")
def stack_route(ctx, relevance):
    """Each stacked tensor gets back its slice."""
    dim = ctx.args[1] if len(ctx.args) > 1 else 0
    return ([r for r in relevance.unbind(dim)],) + (None,) * (len(ctx.args) - 1)


@rule(aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int, aten.chunk.default,
      aten.tensor_split.sections, aten.split_with_sizes_copy.default, aten.unsafe_split.Tensor, preset="base")
def split_route(ctx, relevance):
    """List outputs: ``relevance`` is a list (zeros for unused pieces); the pieces are glued back."""
    op = ctx.node.target
    dim = ctx.args[1] if op in (aten.unbind.int,) and len(ctx.args) > 1 else (ctx.args[2] if len(ctx.args) > 2 else 0)
    if op is aten.unbind.int:
        dim = ctx.args[1] if len(ctx.args) > 1 else 0
        out = torch.stack(list(relevance), dim)
    else:
        out = torch.cat(list(relevance), dim)
    return _first_only(ctx, out)


@rule(aten.index_select.default, preset="base")
def index_select_route(ctx, relevance):
    """Selected rows get their relevance back (summed where an index repeats)."""
    x, dim, index = ctx.args[:3]
    out = relevance.new_zeros(x.shape).index_add(dim, index, relevance)
    return (out, None, None)


@rule(aten.gather.default, preset="base")
def gather_route(ctx, relevance):
    """Gathered elements get their relevance back (summed where an index repeats)."""
    x, dim, index = ctx.args[:3]
    out = relevance.new_zeros(x.shape).scatter_add(dim, index, relevance)
    return (out, None, None)


@rule(aten.index.Tensor, preset="base")
def index_route(ctx, relevance):
    """Advanced indexing (e.g. picking the last non-padding token, ``x[:, idx]``): adjoint of the index
    map; the index list may hold None for the dimensions taken whole."""
    x, indices = ctx.args[0], ctx.args[1]
    out = aten.index_put.default(relevance.new_zeros(x.shape), list(indices), relevance, True)
    return (out, None)


@rule(operator.getitem, preset="base")
def getitem_route(ctx, relevance):  # pragma: no cover - handled by the interpreter directly
    """Element of a list output; the interpreter routes it to the list's slot."""
    return (relevance, None)

