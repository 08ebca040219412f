"""Token ids rearranged before their embedding lookup: look them up first, rearrange the vectors after.

relprop's text sources are the embedding lookups of the explained ids (:mod:`relprop.graph.analysis`):
the relevance that reaches a lookup, summed over the embedding size, is one score per id it looked up.
That is a score per *input position* only when the lookup reads the ids in the input's own layout. Some
models rearrange the ids first: HF XLNet permutes ``input_ids`` to [tokens, batch] before its lookup,
others transpose, flatten, slice or expand them. A lookup commutes with every such rearrangement of its
indices: ``embedding(W, f(ids)) = f'(embedding(W, ids))``, where ``f'`` is the same rearrangement of the
leading axes of the looked-up vectors (their last axis, the embedding size, untouched). :func:`commute_lookups`
rewrites the exported graph that way, once per capture: the lookup reads the explained ids themselves, its
output is laid out like them (samples, positions, features), and the rearrangement follows it as ops on
floating values, which have relevance rules and derivatives (the relevance goes back through them to the
lookup, in the input's layout). A lookup whose ids come in the input's layout already (directly, or through
views that keep the shape) is left as it is.
"""
from __future__ import annotations

from typing import List, Optional

import torch
import torch.fx

from .analysis import INDEX_ROUTING

aten = torch.ops.aten

#: rearrangements of the ids a lookup commutes with (each maps to the same op on the looked-up vectors): the
#: analysis's routing of ids to their lookup, and the rearrangements that move their axes
ID_ROUTING = INDEX_ROUTING | {aten.permute.default, aten.transpose.int, aten.select.int}
#: rearrangements that keep the layout when the shape comes out the same
_KEEPING = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.clone.default,
            aten._to_copy.default, aten.contiguous.default, aten.alias.default}
#: longest chain of rearrangements followed
_DEPTH = 16


def id_chain(index, primary: torch.fx.Node) -> Optional[List[torch.fx.Node]]:
    """The rearrangements from ``primary`` (the explained ids) to ``index`` (a lookup's index argument),
    nearest the lookup first; [] when the lookup reads the ids directly; None when ``index`` is not the
    ids rearranged."""
    chain: List[torch.fx.Node] = []
    n = index
    while n is not primary:
        if not isinstance(n, torch.fx.Node) or n.op != "call_function" or n.target not in ID_ROUTING \
                or len(chain) >= _DEPTH:
            return None
        chain.append(n)
        n = n.args[0]
    return chain


def _val(n):
    return n.meta.get("val") if isinstance(n, torch.fx.Node) else n


def _keeps_layout(chain: List[torch.fx.Node], primary: torch.fx.Node) -> bool:
    if not all(c.target in _KEEPING for c in chain):
        return False
    a, b = _val(chain[0]) if chain else None, _val(primary)
    return a is None or (torch.is_tensor(a) and torch.is_tensor(b) and tuple(a.shape) == tuple(b.shape))


def _routed_args(node: torch.fx.Node, x, rank: int, width):
    """``node``'s arguments for the same rearrangement of ``x``, which has one more (trailing) axis of size
    ``width`` than ``node``'s input of ``rank`` axes; None for a dtype cast (not applied to the vectors)."""
    t, args = node.target, list(node.args)

    def axis(d):
        return d % rank if isinstance(d, int) else d

    if t in (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default):
        return (x, list(args[1]) + [width]) + tuple(args[2:])
    if t is aten.permute.default:
        return (x, [axis(d) for d in args[1]] + [rank])
    if t is aten.transpose.int:
        return (x, axis(args[1]), axis(args[2]))
    if t is aten.unsqueeze.default:
        d = args[1]
        return (x, d if d >= 0 else d + rank + 1)
    if t in (aten.squeeze.dim, aten.select.int, aten.slice.Tensor):
        return (x, axis(args[1]) if len(args) > 1 else 0) + tuple(args[2:])
    if t is aten.flatten.using_ints:
        return (x, axis(args[1]) if len(args) > 1 else 0, axis(args[2]) if len(args) > 2 else rank - 1)
    if t is aten._to_copy.default:
        return None
    return (x,) + tuple(args[1:])  # clone, contiguous, alias


def commute_lookups(graph: torch.fx.Graph, primary: torch.fx.Node) -> int:
    """Rewrite every embedding lookup of ``primary``'s ids rearranged (see the module docstring) into the
    lookup of the ids themselves followed by the rearrangement; returns how many were rewritten. The new
    nodes carry the fake values (``meta["val"]``) and the module stack of the lookup they replace."""
    count = 0
    if primary is None:
        return 0
    for emb in list(graph.nodes):
        if emb.op != "call_function" or emb.target is not aten.embedding.default or len(emb.args) < 2:
            continue
        chain = id_chain(emb.args[1], primary)
        if chain is None or not chain or _keeps_layout(chain, primary):
            continue
        weight_val = _val(emb.args[0])
        fake_mode = getattr(weight_val, "fake_mode", None) or getattr(_val(primary), "fake_mode", None)
        meta = {k: v for k, v in emb.meta.items() if k not in ("val", "tensor_meta")}

        def add(target, args, kwargs=None):
            with graph.inserting_before(emb):
                node = graph.call_function(target, tuple(args), kwargs or {})
            node.meta.update(meta)
            vals = [_val(a) if not isinstance(a, (list, tuple)) else [_val(b) for b in a] for a in args]
            if fake_mode is not None:
                with fake_mode:
                    node.meta["val"] = target(*vals, **(kwargs or {}))
            return node

        out = add(aten.embedding.default, [emb.args[0], primary] + list(emb.args[2:]), dict(emb.kwargs))
        for c in reversed(chain):  # nearest the ids first
            rank = _val(c.args[0]).dim()
            routed = _routed_args(c, out, rank, weight_val.shape[-1])
            if routed is None:
                continue
            out = add(c.target, routed, dict(c.kwargs))
        emb.replace_all_uses_with(out)
        graph.erase_node(emb)
        for c in chain:  # the rearranged ids, where nothing else reads them
            if not c.users:
                graph.erase_node(c)
        count += 1
    return count
