"""Memory planning: which forward values the engine keeps, frees, or computes again.

* :func:`last_uses` — the node after which each value is no longer read, so the forward pass and
  the reverse walk free values as soon as they can;
* :func:`rematerializable` — the attention-sized intermediates the forward pass frees and the walk
  recomputes when a rule reads them;
* :func:`read_after_walk` — what must survive the walk (block records, sources, window maps);
* :func:`segments` and :func:`crossing` — the cut of the graph into one segment per attention
  block that ``memory="low"`` recomputes one at a time (:mod:`relprop.engine.low_memory`).

Every plan is computed once per captured graph and kept in ``captured.plans``.
"""
from __future__ import annotations

from typing import Dict, List

import torch
import torch.fx

from ..graph.capture import Captured
from ..graph.nodes import live_outputs, module_paths

aten = torch.ops.aten


def last_uses(captured: Captured) -> Dict[torch.fx.Node, List[torch.fx.Node]]:
    """node -> the nodes whose last reader (in graph order) it is (a node nobody reads: itself)."""
    plans = captured.plans
    if "last_uses" not in plans:
        last = {}
        for node in captured.graph.nodes:
            for m in node.all_input_nodes:
                last[m] = node
            if not node.users:
                last[node] = node
        out: Dict[torch.fx.Node, List[torch.fx.Node]] = {}
        for m, node in last.items():
            out.setdefault(node, []).append(m)
        plans["last_uses"] = out
    return plans["last_uses"]


#: ops cheap enough to run again during the reverse walk rather than keep their output from the
#: forward pass: shape-only ops, element-wise arithmetic and comparisons (mask building, scaling,
#: the addition of the attention mask), constant fills, softmax, and the attention products when
#: both operands are activations (Q·Kᵀ and A·V; a product with a weight is a linear layer and is
#: kept). Deterministic ops only: a value computed again equals the first one bit for bit.
REMAT_OPS = {
    aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default,
    aten.permute.default, aten.transpose.int, aten.t.default, aten.unsqueeze.default, aten.squeeze.dim,
    aten.squeeze.dims, aten.squeeze.default, aten.alias.default, aten.slice.Tensor, aten.select.int,
    aten.clone.default, aten.contiguous.default, aten._to_copy.default, aten.flatten.using_ints,
    aten.unflatten.int,
    aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar, aten.mul.Tensor, aten.mul.Scalar,
    aten.div.Tensor, aten.div.Scalar, aten.neg.default, aten.where.self, aten.masked_fill.Scalar,
    aten.masked_fill.Tensor,
    aten.eq.Scalar, aten.eq.Tensor, aten.ne.Scalar, aten.ne.Tensor, aten.lt.Scalar, aten.lt.Tensor,
    aten.le.Scalar, aten.le.Tensor, aten.gt.Scalar, aten.gt.Tensor, aten.ge.Scalar, aten.ge.Tensor,
    aten.logical_not.default, aten.logical_and.default, aten.logical_or.default,
    aten.bitwise_and.Tensor, aten.bitwise_or.Tensor, aten.bitwise_not.default,
    aten.any.dim, aten.all.dim,
    aten.full_like.default, aten.zeros_like.default, aten.ones_like.default, aten.scalar_tensor.default,
    aten.full.default, aten.zeros.default, aten.ones.default, aten.new_zeros.default, aten.new_ones.default,
    aten.new_full.default,
    aten.softmax.int, aten._softmax.default, aten._safe_softmax.default,
}
_PRODUCTS = {aten.matmul.default, aten.bmm.default}


def transient(captured: Captured) -> frozenset:
    """Every node a re-run that reads only the outputs and the sources' values (and gradients) may
    free after its last forward use: all but the sources and the nodes the graph's output returns.
    Autograd keeps what it saved; dropping the rest keeps a re-run on a large batch (SmoothGrad,
    Integrated Gradients) from holding every intermediate value at once."""
    plans = captured.plans
    if "transient" not in plans:
        a = captured.analysis
        keep = set(a.sources)
        for node in captured.graph.nodes:
            if node.op == "output":
                keep.update(node.all_input_nodes)
        plans["transient"] = frozenset(n for n in captured.graph.nodes if n.op == "call_function" and n not in keep)
    return plans["transient"]


def rematerializable(captured: Captured) -> frozenset:
    """Nodes whose values the forward pass frees after their last forward use, and the reverse
    walk computes again when a rule reads them.

    The attention scores, the masked scores, the softmax and the masks built from them are each as
    large as an attention map (heads × tokens² per sample) and several of them exist per block;
    keeping them all from the forward pass is what made the peak memory several times that of a
    forward+backward pass. Computing them again costs one Q·Kᵀ product and a few element-wise
    passes per block. Values read after the walk (block records, sources, outputs) are never in
    this set.
    """
    plans = captured.plans
    if "remat" not in plans:
        a = captured.analysis
        keep = read_after_walk(a) | set(live_outputs(captured.graph, a.live)) | set(a.sources)
        out = set()
        for node in captured.graph.nodes:
            if node.op != "call_function" or node in keep or not isinstance(node.meta.get("val"), torch.Tensor):
                continue
            if node.target in REMAT_OPS or (node.target in _PRODUCTS and all(
                    isinstance(x, torch.fx.Node) and x in a.live for x in node.args[:2])):
                out.add(node)
        plans["remat"] = frozenset(out)
    return plans["remat"]


def read_after_walk(a) -> set:
    """Nodes whose forward values are read after the reverse walk (block records, sources, the
    nodes that map window attention onto the token grid); the walk frees every other value."""
    keep = set(a.sources) | {a.primary}
    for b in a.blocks:
        keep |= {n for n in (b.attention, b.hidden, b.value, b.features, b.out_proj, b.output) if n is not None}
    if a.tokens is not None:  # where the first block's tokens come from (relprop.graph.tokens)
        keep |= {a.tokens.start} | set(a.tokens.reads)
    for wm in (getattr(a, "windows", None) or {}).values():
        for n in [getattr(wm, "start", None), getattr(wm, "end", None)] + list(getattr(wm, "nodes", ())):
            if isinstance(n, torch.fx.Node):
                keep.add(n)
                keep.update(n.all_input_nodes)
    return keep


def segments(captured: Captured) -> List[List[torch.fx.Node]]:
    """The graph's nodes (the output node aside) cut into contiguous runs, one per attention block:
    a run starts at the first node of a block's layer (the prefix before block 1, the embeddings
    and mask building, joins block 0; the head joins the last block). Any cut of a topological
    order is valid; cutting at the blocks bounds what one run holds to about one layer."""
    plans = captured.plans
    if "segments" not in plans:
        nodes = [n for n in captured.graph.nodes if n.op != "output"]
        first = {}
        for i, n in enumerate(nodes):
            for b in captured.analysis.blocks:
                if b.layer and b.layer not in first and b.layer in module_paths(n):
                    first[b.layer] = i
        cuts, last = [], 0
        for b in captured.analysis.blocks[1:]:
            i = first.get(b.layer)
            if i is not None and i > last:
                cuts.append(i)
                last = i
        bounds = [0] + cuts + [len(nodes)]
        plans["segments"] = [nodes[i:j] for i, j in zip(bounds[:-1], bounds[1:]) if j > i]
    return plans["segments"]


def crossing(captured: Captured) -> frozenset:
    """Nodes whose values a later segment (or the output) reads: what the forward pass of
    ``memory="low"`` keeps."""
    plans = captured.plans
    if "crossing" not in plans:
        seg_of = {n: i for i, seg in enumerate(segments(captured)) for n in seg}
        out = set()
        for n, i in seg_of.items():
            if any(u.op == "output" or seg_of.get(u, i) != i for u in n.users):
                out.add(n)
        plans["crossing"] = frozenset(out)
    return plans["crossing"]
