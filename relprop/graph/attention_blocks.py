"""Attention blocks, found from the graph's structure, and what they imply for rollouts.

An attention block is a softmax whose probabilities multiply the values: the softmax output reaches
the left operand of a product with a live tensor through ops that keep each (query, key) entry of
the map apart — copies, masking ``where``, views, a constant head mask, and *head mixing*: talking-
heads attention (Shazeer et al. 2020; timm CaiT) permutes the heads to the last axis and mixes them
with a linear layer before (and after) the softmax. The attention A a block records is the tensor
that multiplies the values, after any head mixing.

* **Folded heads** — some models store the attention as [batch·heads, T, T] (HF DeBERTa-v2, PyTorch's
  ``nn.MultiheadAttention``): the block records how many heads are folded into the batch axis.
* **Token attention** — a softmax over the *channels* of the tokens (XCiT's cross-covariance
  attention: a [d, d] map per head, where d = channels / heads) is not attention between tokens;
  it is left out of the blocks, and :func:`token_mixing` reports the products that mix tokens.
* **Shape** — a block's attention is [queries × keys]. Self-attention is square; a block whose
  queries are fewer than its keys reads the token sequence into a new set of tokens (CaiT's and
  XCiT's class-attention, LeViT's attention downsampling, SigLIP's attention-pooling head).
* **Token mixing outside attention** — a rollout (CVPR 2021 Eq. 13–16) assumes that tokens mix only
  through the attention blocks (and the residual identity). :func:`token_mixing` names the first op
  between the first block's input and the last block's output that mixes token positions otherwise
  (a convolution or pooling over the token grid, a product over the token axis outside an attention
  block), so that the rollout methods refuse such models instead of returning a map that ignores it.
"""
from __future__ import annotations

import collections
import dataclasses
import re
from typing import Callable, Dict, List, Optional, Set, Tuple

import torch
import torch.fx

from .axis_provenance import kinds
from .nodes import ancestors, descendants, module_call, module_path, module_paths

aten = torch.ops.aten

SOFTMAX_OPS = {aten.softmax.int, aten._softmax.default, aten._safe_softmax.default}
#: the words of a left-out reason for an attention module split into several softmax products
SEPARATE = "separate softmax-times-values products over parts of the tokens"
MATMUL_OPS = {aten.matmul.default, aten.bmm.default}
#: ops between a softmax and the product with V that do not change what "the attention" is
TRANSPARENT_OPS = {aten.where.self, aten.clone.default, aten._to_copy.default, aten.dropout.default,
                   aten.alias.default, aten.detach.default, aten.contiguous.default, aten.view.default,
                   aten.reshape.default, aten.expand.default, aten._unsafe_view.default}
#: ops that move axes (followed while looking for head mixing)
_AXIS_OPS = {aten.permute.default, aten.transpose.int}
#: convolutions and pools that mix neighbouring positions of a token grid
_GRID_MIXING = {aten.convolution.default, aten.avg_pool2d.default, aten.max_pool2d_with_indices.default,
                aten.adaptive_avg_pool2d.default, aten._adaptive_avg_pool2d.default, aten.avg_pool1d.default,
                aten.max_pool2d.default, aten._adaptive_avg_pool3d.default}


@dataclasses.dataclass
class BlockInfo:
    """One attention block of the captured graph (numbered 0..B-1 from input to output)."""

    index: int
    name: str  # module path of the attention, e.g. "blocks.3.attn"
    layer: str  # module path of the enclosing transformer layer, e.g. "blocks.3"
    softmax: torch.fx.Node
    attention: torch.fx.Node  # A: the tensor multiplied with the values
    product: torch.fx.Node  # A @ V
    hidden: Optional[torch.fx.Node]  # h: hidden states entering the layer
    output: Optional[torch.fx.Node]  # hidden states leaving the layer
    value: Optional[torch.fx.Node] = None  # V, the right operand of A @ V
    features: Optional[torch.fx.Node] = None  # token features entering the attention module
    out_proj: Optional[torch.fx.Node] = None  # weight of the attention's output projection (W_O)
    queries: int = 0  # rows of A
    keys: int = 0  # columns of A
    folded_heads: Optional[int] = None  # heads folded into the batch axis ([batch·heads, T, T])
    scores: Optional[torch.fx.Node] = None  # Q·Kᵀ, the product the softmax is computed from
    #: groups of tokens folded into the batch axis ([batch·groups, heads, T, T]: windows, unfolded
    #: patches), each attending only within itself; None when the block attends over all its tokens
    groups: Optional[int] = None
    #: two-stream models (relprop.graph.streams): the input stream of the queries and of the keys,
    #: and the wave (blocks of one wave read the same relevancy state); None for one stream
    query_stream: Optional[str] = None
    key_stream: Optional[str] = None
    wave: Optional[int] = None

    @property
    def square(self) -> bool:
        """Self-attention: as many queries as keys."""
        return self.queries == self.keys


def _val(node):
    return node.meta.get("val")


def _shape(node) -> Optional[tuple]:
    v = _val(node) if isinstance(node, torch.fx.Node) else None
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


_LAYER = re.compile(r"\.\d+$")


def layer_path(node) -> str:
    """The innermost enclosing module path ending in an index (``blocks.3``), else the innermost."""
    paths = module_paths(node)
    for p in reversed(paths):
        if _LAYER.search(p):
            return p
    return paths[-1] if paths else ""


def _attention_of(softmax, live) -> Optional[Tuple[torch.fx.Node, torch.fx.Node]]:
    """(A, A @ V) for a softmax whose probabilities reach the left operand of a product with a live
    tensor, else None. Axis labels are followed through permutes so that a linear layer is allowed
    only over the heads axis (head mixing), never over the query or key axis."""
    ndim = len(_shape(softmax) or ())
    if ndim < 2:
        return None
    start = ["b"] * (ndim - 3) + ["h", "q", "k"] if ndim >= 3 else ["q", "k"]
    frontier = [(softmax, tuple(start))]
    for _ in range(10):
        nxt = []
        for cur, axes in frontier:
            for u in cur.users:
                if u.op != "call_function" or u not in live:
                    continue
                if u.target in MATMUL_OPS and u.args[0] is cur and u.args[1] in live and axes[-2:] == ("q", "k"):
                    return cur, u
                if u.target in TRANSPARENT_OPS:  # (the probabilities may be any operand of a masking where)
                    nxt.append((u, axes if len(_shape(u) or ()) == len(axes) else _relabel(axes, _shape(u))))
                elif u.target in _AXIS_OPS and u.args[0] is cur:
                    nxt.append((u, _moved(axes, u)))
                elif u.target is aten.unsqueeze.default and u.args[0] is cur:  # einsum's broadcast axis
                    d = u.args[1] % (len(axes) + 1)
                    nxt.append((u, axes[:d] + ("1",) + axes[d:]))
                elif u.target is aten.linear.default and u.args[0] is cur and axes[-1] == "h":
                    nxt.append((u, axes))  # talking heads: the heads mixed, each (q, k) entry apart
                elif u.target in (aten.mul.Tensor, aten.mul.Scalar) and u.args[0] is cur \
                        and not (isinstance(u.args[1], torch.fx.Node) and u.args[1] in live):
                    nxt.append((u, axes))  # a constant head mask or scale
        if not nxt:
            return None
        frontier = nxt
    return None


def _relabel(axes, shape):
    """Axis labels after a view that folds or splits leading axes (the last two kept) and drops the
    size-1 axes an unsqueeze added (label "1": einsum's broadcast axes)."""
    if shape is None or len(shape) < 2:
        return axes
    kept = tuple(a for a in axes if a != "1") if len(shape) < len(axes) else tuple(axes)
    return ("b",) * (len(shape) - 2) + kept[-2:]


def _moved(axes, node):
    if node.target is aten.permute.default:
        dims = [d % len(axes) for d in node.args[1]]
        return tuple(axes[d] for d in dims)
    a, b = (d % len(axes) for d in node.args[1:3])
    out = list(axes)
    out[a], out[b] = out[b], out[a]
    return tuple(out)


def _scores_of(softmax, live) -> Optional[torch.fx.Node]:
    """Q·Kᵀ: the product of two live tensors the softmax input comes from (through scaling,
    masking, views and head mixing)."""
    frontier, seen = [softmax.args[0]], set()
    for _ in range(10):
        nxt = []
        for n in frontier:
            if not isinstance(n, torch.fx.Node) or n in seen or n not in live or n.op != "call_function":
                continue
            seen.add(n)
            if n.target in MATMUL_OPS and all(isinstance(a, torch.fx.Node) and a in live for a in n.args[:2]):
                return n
            nxt.extend(m for m in n.all_input_nodes if m in live)
        frontier = nxt
    return None


def find_blocks(graph, live: Set[torch.fx.Node], fold_of: Callable[[torch.fx.Node], Optional[int]],
                axes: Optional[dict] = None) -> Tuple[List[BlockInfo], List[str]]:
    """The attention blocks, input → output, and a line for each softmax-times-values left out
    because it is not attention between tokens (see the module docstring).

    ``fold_of(node)`` is the number of groups a node folds into its batch axis (None: none); ``axes``: where
    each value's axes come from (:func:`relprop.graph.axis_provenance.provenance`)."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    found = []
    for sm in graph.nodes:
        if sm.op == "call_function" and sm.target in SOFTMAX_OPS and sm in live:
            hit = _attention_of(sm, live)
            if hit is not None:
                found.append((sm, *hit))
    found.sort(key=lambda t: order[t[0]])
    blocks, left_out = [], []
    # counted per call of a module, not per module: a module called twice (LXMERT's cross-attention, once per
    # direction) computes two whole attentions, one per call
    per_call = collections.Counter(module_call(attn) for _, attn, _ in found)
    for sm, attn, product in found:
        parts = per_call[module_call(attn)]
        if parts > 1:  # block-sparse attention (BigBird): one call of a module, several softmax-times-values products
            why = (f"'{module_path(attn)}': attention computed as {parts} {SEPARATE} (block-sparse attention, "
                   f"as BigBird's), which relprop does not assemble into one token-to-token map")
            if why not in left_out:
                left_out.append(why)
            continue
        layer = layer_path(attn)
        hidden, output = _layer_io(graph, layer, live)
        shape = _shape(attn)
        queries, keys = int(shape[-2]), int(shape[-1])
        value = product.args[1]
        folded = fold_of(attn) if len(shape) == 3 else None
        groups = fold_of(attn) if len(shape) >= 4 else None
        if _between_channels(attn, axes, shape, hidden, value, folded):
            left_out.append(f"'{module_path(attn)}': a softmax over the channels of the tokens ({keys} x {keys} per "
                            f"head), not attention between tokens")
            continue
        blocks.append(BlockInfo(len(blocks), module_path(attn), layer, sm, attn, product, hidden, output,
                                value=value, features=_features(graph, attn, live), out_proj=_out_proj(product),
                                queries=queries, keys=keys, folded_heads=folded, scores=_scores_of(sm, live),
                                groups=groups))
    return blocks, left_out


def _layer_io(graph, layer, live):
    """(h, output): the first live input of the layer from outside it, and its last live value that
    is read outside it."""
    in_scope = [n for n in graph.nodes if layer and layer in module_paths(n)]
    scope = set(in_scope)
    hidden = output = None
    for n in in_scope:
        for m in n.all_input_nodes:
            v = _val(m)
            if m in live and m not in scope and isinstance(v, torch.Tensor) and v.dim() >= 3:
                hidden = m
                break
        if hidden is not None:
            break
    for n in in_scope:
        if n in live and any(u not in scope for u in n.users):
            output = n
    return hidden, output


def _between_channels(attn, axes, shape, hidden, value, folded) -> bool:
    """Whether the map ``attn`` relates channels, not tokens: its keys' axis comes from a weight's axis (the
    output features of a linear layer, split into heads) and not from the explained input's positions
    (:mod:`relprop.graph.axis_provenance`: XCiT's and DaViT's channel attention, whatever the sizes). Where
    provenance is lost, the shapes decide (:func:`_channel_attention`)."""
    found = kinds(axes.get(attn), -1) if axes else set()
    if found and "?" not in found:
        return found == {"feature"}  # (learned tokens, Perceiver's latents, are a parameter's axis: tokens)
    return _channel_attention(shape, hidden, value, folded)


def _channel_attention(shape, hidden, value, folded) -> bool:
    """A [d, d] map over the channels of each head (XCiT): its keys are not the block's tokens but the
    channels per head, the values' contracted axis holds those channels and their last axis the
    tokens ([d, N] per head). The last condition tells it from cross-attention whose source length
    happens to equal the channels per head: there the values are [source, d] per head, and their
    last axis (d = source length) cannot equal the block's token count, which differs from the keys'."""
    h = _shape(hidden)
    v = _shape(value)
    if h is None or v is None or len(h) != 3 or len(v) < 2:
        return False
    tokens, channels = int(h[1]), int(h[2])
    keys = int(shape[-1])
    heads = folded if folded else (int(shape[-3]) if len(shape) >= 4 else 1)
    return keys != tokens and heads > 0 and channels % heads == 0 and keys == channels // heads \
        and int(v[-2]) == keys and int(v[-1]) == tokens


def _features(graph, attn, live):
    """The token features the attention module reads (its first live input from outside it):
    LN1(h) in pre-norm blocks (ViT), h itself in post-norm ones (BERT)."""
    paths = module_paths(attn)
    # the outermost enclosing module whose name contains "attn"/"attention" is the attention module
    scope_path = next((p for p in paths if re.search(r"(attn|attention)[^.]*$", p)), module_path(attn))
    for n in graph.nodes:
        if scope_path not in module_paths(n):
            continue
        for m in n.all_input_nodes:
            v = _val(m)
            if m in live and scope_path not in module_paths(m) and isinstance(v, torch.Tensor) and v.dim() >= 3:
                return m
    return None


#: ops through which the attention output reaches the output projection
_TO_PROJECTION = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default,
                  aten.unsqueeze.default, aten.clone.default, aten._to_copy.default, aten.contiguous.default,
                  aten.alias.default, aten.slice.Tensor, aten.squeeze.dim, aten.flatten.using_ints,
                  aten.permute.default, aten.transpose.int}


def _out_proj(product):
    """Weight node of the first linear layer the attention output reaches through shape-only ops."""
    frontier = [product]
    for _ in range(12):
        nxt = []
        for n in frontier:
            for u in n.users:
                if u.op != "call_function":
                    continue
                if u.target is aten.linear.default and u.args[0] is n:
                    return u.args[1]
                if u.target in _TO_PROJECTION:
                    nxt.append(u)
        if not nxt:
            return None
        frontier = nxt
    return None


def token_mixing(graph, live, blocks: List[BlockInfo], start=None, end=None) -> Optional[str]:
    """The first op that mixes token positions other than through an attention block, described in
    words; None if there is none. Looked for between ``start`` (nodes; default the first block's
    input) and ``end`` (nodes; default the last block's output): :mod:`relprop.graph.analysis` passes
    the token ids' embedding lookups and the model's outputs, so that a layer before the first or
    after the last attention block (a Mamba layer of Jamba) counts too. A pooling of every position
    into one (the head's mean or global average pool) reads the tokens and is not mixing."""
    if not blocks:
        return None
    start = list(start) if start else ([blocks[0].hidden] if blocks[0].hidden is not None else [])
    end = list(end) if end else ([blocks[-1].output] if blocks[-1].output is not None else [])
    if not start or not end:
        return None
    after = descendants(start, live)
    before = ancestors(end, live)
    inside = {b.product for b in blocks} | {b.scores for b in blocks if b.scores is not None}
    for n in graph.nodes:
        if n not in after or n not in before or n.op != "call_function" or n in inside:
            continue
        why = _mixes_tokens(n, live)
        if why:
            return f"{why} in '{module_path(n) or 'the model'}' ({n.target})"
    return None


def _mixes_tokens(n, live) -> Optional[str]:
    if n.target in _GRID_MIXING:
        out = _shape(n)
        if out is not None and len(out) >= 3 and all(int(d) == 1 for d in out[2:]):
            return None  # every position pooled into one: the head reads the tokens
        if n.target is aten.convolution.default:
            w = _shape(n.args[1])
            stride = n.args[3] if len(n.args) > 3 else [1]
            if w is not None and all(int(k) == 1 for k in w[2:]) and all(int(s) == 1 for s in stride):
                return None  # a 1x1 convolution is per position
            return "a convolution over the tokens" if w is not None and len(w) == 3 else \
                "a convolution over the token grid"
        return "a pooling over the token grid"
    if n.target in MATMUL_OPS and all(isinstance(a, torch.fx.Node) and a in live for a in n.args[:2]):
        return "a product of two input-dependent tensors outside an attention block"
    return None




def fold_counter(batch_dim: Dict[torch.fx.Node, Optional[int]], static_batch: Optional[int],
                 folds: Optional[Dict[torch.fx.Node, int]],
                 layouts: Optional[Dict[torch.fx.Node, Tuple[int, int, int]]] = None
                 ) -> Callable[[torch.fx.Node], Optional[int]]:
    """``node -> k`` when the node's batch axis holds k·batch groups, batch-major (k > 1), else None:
    ``folds`` gives k for a graph that takes every batch size; for a graph captured for ``static_batch``
    samples the axes' provenance (``layouts``: node -> (axis, outer, inner),
    :func:`relprop.graph.axis_provenance.batch_layout`) tells k, sample-major groups only (rows
    t·B + b interleave the samples: no fold), and the sizes where provenance is lost."""
    if folds is not None:
        return folds.get
    layouts = layouts or {}

    def fold_of(node):
        lay = layouts.get(node)
        if lay is not None:
            axis, outer, inner = lay
            return inner if outer == 1 and inner > 1 and batch_dim.get(node) == axis == 0 else None
        v = _val(node)
        if not isinstance(v, torch.Tensor) or batch_dim.get(node) != 0 or v.dim() == 0 or not static_batch:
            return None
        s = int(v.shape[0])
        k = s // static_batch if s % static_batch == 0 else None
        return k if k and k > 1 else None
    return fold_of
