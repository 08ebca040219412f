"""Where every axis of a value comes from: the explained input's axes, its batch, or a weight.

Sizes do not say what an axis is: a [batch, 16, 16] softmax may be attention between 16 tokens or between
the 16 channels of a head (XCiT's and DaViT's channel attention), and a [T·B, E] matrix may hold the rows
of a sample together (batch-major) or interleaved (``torch.nn.MultiheadAttention``'s sequence-major rows
t·B + b). :func:`provenance` follows every value on the live path from the explained input: each axis is
a list of *factors*, major to minor, each a kind and a size. The kinds are

* ``"batch"`` — the samples (the explained input's batch axis);
* ``"input"`` — an axis of the explained input other than the batch (positions: tokens, pixels, time,
  frequency), followed through every view, permute, reshape, slice, gather and lookup (an embedding
  lookup keeps the ids' axes);
* ``"feature"`` — an axis a weight makes (a linear layer's or a convolution's output features, a lookup's
  embedding size): features, channels, heads;
* ``"param"`` — an axis of a parameter, buffer or constant itself (a bias's features, but also learned
  tokens: Perceiver's latents, a class token, registers);
* ``"?"`` — provenance lost (an op this module does not follow).

A reshape splits and merges factors in order (``[T, B, E] → [T·B, E]`` gives the axis ``[input T, batch
B]``: rows t·B + b), a permute moves them, a linear map replaces the last axis by a ``"feature"`` one, an
element-wise op joins its operands' axes (the explained input's kinds before a weight's: ``x +
pos_embed`` keeps ``x``'s positions). The attention blocks are read from it
(:mod:`relprop.graph.attention_blocks`: a softmax whose keys come from a weight's axis is attention
between channels, not tokens) and so are the ledger's per-sample rows (:func:`batch_layout`).
"""
from __future__ import annotations

import operator
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.fx

aten = torch.ops.aten

Factor = Tuple[str, int]
Axes = List[List[Factor]]

_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.flatten.using_ints,
          aten.unflatten.int, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.unsqueeze.default,
          aten.view_copy.default}
_SAME = {aten.clone.default, aten._to_copy.default, aten.contiguous.default, aten.alias.default,
         aten.detach.default, aten.dropout.default, aten.native_dropout.default}
#: ops that resize axes without moving them (pooling, padding, resampling): each axis keeps its kind
_RESIZE = {aten.max_pool2d_with_indices.default, aten.max_pool2d.default, aten.avg_pool2d.default,
           aten.max_pool1d.default, aten.avg_pool1d.default, aten.adaptive_avg_pool2d.default,
           aten._adaptive_avg_pool2d.default, aten.adaptive_avg_pool1d.default, aten.constant_pad_nd.default,
           aten.upsample_bilinear2d.vec, aten.upsample_nearest2d.vec, aten.upsample_bicubic2d.vec,
           aten.max_pool3d_with_indices.default, aten.avg_pool3d.default, aten.reflection_pad2d.default,
           aten.replication_pad2d.default}
#: tuple-valued ops that select or reorder along one dim (values, indices), -> the position of that dim's argument
_SELECT_ALONG = {aten.topk.default: 2, aten.sort.default: 1, aten.max.dim: 1, aten.min.dim: 1,
                 aten.kthvalue.default: 2, aten.mode.default: 1}
#: kinds in the order an element-wise op prefers them when its operands disagree on an axis
_RANK = {"batch": 0, "input": 1, "feature": 2, "param": 3, "?": 4, "unit": 5}


def _size(s) -> Optional[int]:
    if isinstance(s, int):
        return s
    hint = getattr(getattr(s, "node", None), "hint", None)
    if hint is not None:
        return int(hint)
    try:
        return int(s)
    except Exception:  # noqa: BLE001 - a symbol without a hint
        return None


def _shape(n) -> Optional[List[int]]:
    v = n.meta.get("val") if isinstance(n, torch.fx.Node) else None
    if not isinstance(v, torch.Tensor):
        return None
    sizes = [_size(s) for s in v.shape]
    return None if any(s is None for s in sizes) else sizes


def _unknown(shape: Sequence[int], kind: str = "?") -> Axes:
    return [[("unit", 1)] if s == 1 else [(kind, s)] for s in shape]


def kinds(axes_of_node: Optional[Axes], axis: int) -> set:
    """The kinds of the factors of ``axis`` (an empty set when unknown)."""
    if axes_of_node is None or axis >= len(axes_of_node) or axis < -len(axes_of_node):
        return set()
    return {k for k, s in axes_of_node[axis] if k != "unit"}


def _reshape(axes: Axes, out: Sequence[int]) -> Axes:
    """Factors of ``axes`` regrouped into the axes of sizes ``out`` (same elements, same order)."""
    flat = [f for a in axes for f in a if f[1] != 1 or f[0] == "batch"]  # (a batch of one is still the batch)
    result: Axes = []
    i = 0
    for size in out:
        if size == 1:
            if i < len(flat) and flat[i] == ("batch", 1):
                result.append([flat[i]])
                i += 1
            else:
                result.append([("unit", 1)])
            continue
        group, prod = [], 1
        while prod < size and i < len(flat):
            kind, s = flat[i]
            need = size // prod
            if s <= need and need % s == 0:
                group.append((kind, s))
                prod *= s
                i += 1
            elif s % need == 0:  # split the factor: its major part here, the rest to the next axes
                group.append((kind, need))
                prod *= need
                flat[i] = (kind, s // need)
            else:
                return _unknown(out)
        if prod != size:
            return _unknown(out)
        result.append(group)
    return result if i == len(flat) else _unknown(out)


def _join(parts: List[Optional[Axes]], out: Sequence[int]) -> Axes:
    """An element-wise op's axes: per output axis (aligned from the right), the operand axes of its size
    (not broadcast), the explained input's kinds first."""
    result: Axes = []
    rank = len(out)
    for j, size in enumerate(out):
        best = None
        for p in parts:
            if p is None:
                continue
            k = j - (rank - len(p))
            if k < 0:
                continue
            a = p[k]
            if _prod(a) == 1 and (size != 1 or (len(p) < rank and any(kd == "batch" for kd, _ in a))):
                continue  # a broadcast axis of size 1 (a batch of one in an operand of lower rank lines up by chance)
            if _prod(a) != size:
                continue
            score = min(_RANK[kd] for kd, _ in a)
            if best is None or score < best[0]:
                best = (score, a)
        result.append(list(best[1]) if best is not None else ([("unit", 1)] if size == 1 else [("?", size)]))
    return result


def _prod(a: List[Factor]) -> int:
    p = 1
    for _, s in a:
        p *= s
    return p


def _dims(d, rank) -> List[int]:
    ds = d if isinstance(d, (list, tuple)) else [d]
    return sorted({int(x) % rank for x in ds})


def provenance(graph: torch.fx.Graph, primary: torch.fx.Node, batch_axis: Optional[int],
               live: set, other_inputs: Optional[Dict[torch.fx.Node, int]] = None) -> Dict[torch.fx.Node, Axes]:
    """Node → its axes' factors (see the module docstring), for the explained input, every value computed
    from it and every live node whose shape relprop can read. ``other_inputs`` (the model's other inputs →
    their batch axis: an encoder-decoder's decoder ids, a second stream, masks) carry the samples too: their
    batch axis is ``"batch"`` (the samples are the same), their other axes are not the explained input's."""
    out: Dict[torch.fx.Node, Axes] = {}
    shape = _shape(primary)
    if shape is None:
        return out
    out[primary] = [[("batch", s)] if i == batch_axis else ([("unit", 1)] if s == 1 else [("input", s)])
                    for i, s in enumerate(shape)]
    for n, d in (other_inputs or {}).items():
        s = _shape(n)
        if n is not primary and s is not None and 0 <= d < len(s):
            out[n] = [[("batch", z)] if i == d else ([("unit", 1)] if z == 1 else [("param", z)])
                      for i, z in enumerate(s)]

    def axes_of(n) -> Optional[Axes]:
        if not isinstance(n, torch.fx.Node):
            return None
        if n in out:
            return out[n]
        s = _shape(n)
        return None if s is None else _unknown(s, "param")  # a weight, a buffer, a constant

    # the values computed from the model's inputs, live or not: token ids are integers (not live), and the ops
    # that rearrange them before a lookup (a view, XLNet's permute) carry their axes to the embedding
    reach = set(out)
    for n in graph.nodes:
        if n.op == "call_function" and any(m in reach for m in n.all_input_nodes):
            reach.add(n)
    for n in graph.nodes:
        if n.op != "call_function" or (n not in live and n not in reach):
            continue
        shp = _shape(n)
        if shp is None:
            continue
        t = n.target
        args = n.args
        x = axes_of(args[0]) if args else None
        try:
            res = _rule(t, n, args, x, shp, axes_of)
        except Exception:  # noqa: BLE001 - an argument layout this module does not know: provenance lost
            res = None
        out[n] = res if res is not None and len(res) == len(shp) else _unknown(shp)
    return out


def _resized(x: Axes, shp) -> Optional[Axes]:
    if len(x) != len(shp):
        return None
    return [list(a) if _prod(a) == s else ([("unit", 1)] if s == 1 else [(a[0][0] if a else "?", s)])
            for a, s in zip(x, shp)]


def _rule(t, n, args, x, shp, axes_of) -> Optional[Axes]:
    if t in _RESIZE and x is not None:
        return _resized(x, shp)
    if t in _SAME and x is not None:
        return [list(a) for a in x]
    if t in _VIEWS and x is not None:
        return _reshape(x, shp)
    if t is aten.permute.default and x is not None:
        return [list(x[d % len(x)]) for d in args[1]]
    if t is aten.transpose.int and x is not None:
        y = [list(a) for a in x]
        i, j = args[1] % len(x), args[2] % len(x)
        y[i], y[j] = y[j], y[i]
        return y
    if t in (aten.t.default, aten.numpy_T.default) and x is not None:
        return [list(a) for a in reversed(x)]
    if t is aten.expand.default and x is not None:
        lead = len(shp) - len(x)
        y = _unknown(shp[:lead], "param")
        for a, s in zip(x, shp[lead:]):
            y.append(list(a) if _prod(a) == s else [("param", s)])
        return y
    if t in (aten.slice.Tensor, aten.narrow.default, aten.index_select.default) and x is not None:
        d = (args[1] if len(args) > 1 else 0) % len(x)
        y = [list(a) for a in x]
        y[d] = [(k, shp[d]) for k, _ in x[d][:1]] if shp[d] != 1 else [("unit", 1)]
        return y
    if t is aten.select.int and x is not None:
        d = args[1] % len(x)
        return [list(a) for i, a in enumerate(x) if i != d]
    if t in (aten.linear.default,) and x is not None:
        return [list(a) for a in x[:-1]] + [[("feature", shp[-1])]]
    if t is aten.embedding.default:
        idx = axes_of(args[1])
        return None if idx is None else [list(a) for a in idx] + [[("feature", shp[-1])]]
    if t is aten.convolution.default and x is not None:
        return [list(x[0]), [("feature", shp[1])]] + [[(k, s) for k, _ in a[:1]] if s != 1 else [("unit", 1)]
                                                  for a, s in zip(x[2:], shp[2:])]
    if t in (aten.matmul.default, aten.bmm.default, aten.mm.default, aten.baddbmm.default):
        a, b = (axes_of(args[0]), axes_of(args[1])) if t is not aten.baddbmm.default else \
            (axes_of(args[1]), axes_of(args[2]))
        if a is None or b is None or len(a) < 2 or len(b) < 2:
            return None
        lead = _join([a[:-2], b[:-2]], shp[:-2]) if len(shp) > 2 else []
        return lead + [list(a[-2]), list(b[-1])]
    if t in (aten.sum.dim_IntList, aten.mean.dim, aten.amax.default, aten.amin.default, aten.logsumexp.default) \
            and x is not None and len(args) > 1 and args[1] is not None:
        dims = _dims(args[1], len(x))
        keep = len(args) > 2 and bool(args[2])
        return [([("unit", 1)] if i in dims else list(a)) for i, a in enumerate(x) if keep or i not in dims]
    if t in (aten.cat.default,):
        parts = [axes_of(p) for p in args[0]]
        d = (args[1] if len(args) > 1 else 0) % len(shp)
        known = [p for p in parts if p is not None and len(p) == len(shp)]
        if not known:
            return None
        y = _join(known, [s if i != d else 0 for i, s in enumerate(shp)])
        kinds_d = sorted({k for p in known for k, _ in p[d] if k != "unit"}, key=_RANK.get)
        y[d] = [(kinds_d[0] if kinds_d else "?", shp[d])]
        return y
    if t is aten.stack.default:
        parts = [axes_of(p) for p in args[0]]
        d = (args[1] if len(args) > 1 else 0) % len(shp)
        rest = shp[:d] + shp[d + 1:]
        y = _join([p for p in parts if p is not None], rest)
        return y[:d] + [[("feature", shp[d])]] + y[d:]
    if t is operator.getitem:  # a piece of a split, or an output of a tuple-valued op (a norm's y)
        src = args[0]
        if not isinstance(src, torch.fx.Node) or not src.args:
            return None
        base = axes_of(src.args[0])
        if base is None:
            return None
        if src.target in (aten.split.Tensor, aten.split_with_sizes.default, aten.split_with_sizes_copy.default,
                          aten.chunk.default, aten.tensor_split.indices):
            d = (src.args[2] if len(src.args) > 2 else src.kwargs.get("dim", 0)) % len(base)
            y = [list(a) for a in base]
            y[d] = [(k, shp[d]) for k, _ in base[d][:1]] if shp[d] != 1 else [("unit", 1)]
            return y
        if src.target in _RESIZE:
            return _resized(base, shp)
        if src.target in _SELECT_ALONG:  # topk / sort / max over a dim: that dim keeps its kind, resized
            d = (src.args[_SELECT_ALONG[src.target]] if len(src.args) > _SELECT_ALONG[src.target]
                 else (-1 if src.target in (aten.topk.default, aten.sort.default) else 0)) % len(base)
            keep = len(shp) == len(base)
            y = [list(a) for a in base]
            if not keep:
                return [a for i, a in enumerate(y) if i != d]
            y[d] = [(k, shp[d]) for k, _ in base[d][:1]] if shp[d] != 1 else [("unit", 1)]
            return y
        if src.target is aten.unbind.int:
            d = (src.args[1] if len(src.args) > 1 else 0) % len(base)
            return [list(a) for i, a in enumerate(base) if i != d]
        return [list(a) for a in base] if [_prod(a) for a in base] == list(shp) else None
    # element-wise and everything whose output is shaped like its operands (softmax, norms, activations)
    tensors = [axes_of(a) for a in n.all_input_nodes]
    tensors = [p for p in tensors if p is not None and len(p) <= len(shp)]
    if tensors:
        return _join(tensors, shp)
    return None


def batch_layout(axes: Optional[Axes]) -> Optional[Tuple[int, int, int]]:
    """(axis, outer, inner) of the batch within one value's axes: the axis holding the ``"batch"`` factor,
    the product of the factors before it in that axis and of those after (rows ``o·(B·inner) + b·inner + i``);
    None when no axis holds exactly one batch factor."""
    if axes is None:
        return None
    found = [(i, j) for i, a in enumerate(axes) for j, (k, _) in enumerate(a) if k == "batch"]
    if len(found) != 1:
        return None
    i, j = found[0]
    a = axes[i]
    return i, _prod(a[:j]), _prod(a[j + 1:])


def fully_known(axes: Optional[Axes]) -> bool:
    """Whether every factor of ``axes`` was followed (no ``"?"``, the batch in one axis at most): then a value
    without a ``"batch"`` factor has no samples' axis, whatever its sizes."""
    return axes is not None and all(k != "?" for a in axes for k, _ in a) \
        and sum(k == "batch" for a in axes for k, _ in a) <= 1  # (the batch in two axes: not followed either)


#: ops through which the explained input's axes are followed to the first weight that reads it
_FOLLOWED = _SAME | {aten.permute.default, aten.transpose.int, aten.mul.Tensor, aten.add.Tensor, aten.sub.Tensor,
                     aten.div.Tensor, aten.mul.Scalar, aten.div.Scalar, aten.add.Scalar, aten.sub.Scalar}


def input_feature_axis(graph: torch.fx.Graph, primary: torch.fx.Node, live: set) -> Optional[int]:
    """The axis of a [batch, a, b] floating input that its first weight contracts: the channels of a
    convolution that reads it (Whisper's log-mel features [batch, mel, frames]: axis 1, the frames are the
    positions), the last axis for a linear layer (input embeddings [batch, tokens, size]: 2). Followed
    through permutes, transposes and element-wise ops with constants; None when no such weight is found."""
    shape = _shape(primary)
    if shape is None or len(shape) != 3:
        return None
    perm = {primary: [0, 1, 2]}  # node -> which input axis each of its axes is
    for n in graph.nodes:
        if n.op != "call_function" or n not in live or not n.args or n.args[0] not in perm:
            continue
        p = perm[n.args[0]]
        if n.target is aten.convolution.default:
            return p[1]
        if n.target in (aten.linear.default, aten.matmul.default, aten.mm.default):
            return p[-1]
        if n.target is aten.permute.default:
            perm[n] = [p[d % 3] for d in n.args[1]]
        elif n.target is aten.transpose.int:
            q = list(p)
            i, j = n.args[1] % 3, n.args[2] % 3
            q[i], q[j] = q[j], q[i]
            perm[n] = q
        elif n.target in _FOLLOWED and _shape(n) is not None and len(_shape(n)) == 3:
            perm[n] = list(p)
    return None
