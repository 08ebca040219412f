"""What relprop needs to know about a captured graph before interpreting it.

* **sources** — where relevance stops: the pixel input (a float user input), or the embedding
  lookups that read the token ids directly (word embeddings; position and token-type embeddings
  read other indices, so they are constants that absorb relevance).
* **live** nodes — floating-point values that depend on a source; only they carry relevance.
  Everything else (parameters, mask-building code, shapes) is a constant.
* **relevant** nodes — live nodes on a path to the output: the ones that need a rule.
* **batch_dim** — which dimension of each node indexes samples (from the symbolic batch size of a
  dynamic-batch capture), so that per-sample statistics never cross samples.
* **blocks** — attention blocks, found structurally (:mod:`relprop.graph.attention_blocks`): a softmax whose
  output is the left operand of a matmul with the values. Ordered input → output and named by
  ``nn_module_stack``; whether tokens also mix outside them.
* **tokens** — where the first block's tokens come from (:mod:`relprop.graph.tokens`), and the patch
  grid of a vision model.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Dict, List, Optional, Set, Tuple, Union

import torch
import torch.fx

from . import streams, window_attention as windows
from .attention_blocks import SEPARATE, BlockInfo, find_blocks, fold_counter, token_mixing
from .axis_provenance import batch_layout, fully_known, input_feature_axis, provenance
from .nodes import CONSTANT_PRODUCING, module_paths, output_node
from .tokens import TokenPlan, plan_tokens

aten = torch.ops.aten

#: ops that follow a token-id input to its embedding lookup
INDEX_ROUTING = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default,
                 aten.unsqueeze.default, aten.clone.default, aten._to_copy.default, aten.contiguous.default,
                 aten.alias.default, aten.slice.Tensor, aten.squeeze.dim, aten.flatten.using_ints}


#: ops that move or copy the pixels without changing them: a convolution behind them still reads pixels
PIXEL_REARRANGING = INDEX_ROUTING | {aten.permute.default, aten.transpose.int}


def _pixel_bounds(x, primary, batch_dim, static_batch, layouts) -> Union[bool, str]:
    """How the z^B rule bounds the input of a convolution that reads ``x`` (CVPR 2021 supplementary
    §B: l = min, h = max of the sample's pixels): True, per sample along axis 0; ``"whole"``, over the
    whole input, when the convolution's axis 0 is not the sample axis (patches cut from one image,
    as Qwen2-VL's) and the call has one sample; False, the convolution does not read the pixels."""
    start, hops = x, 0
    while x is not primary and isinstance(x, torch.fx.Node) and x.op == "call_function" \
            and x.target in PIXEL_REARRANGING and hops < 16:
        x, hops = x.args[0], hops + 1
    if x is not primary:
        return False
    lay = layouts.get(start)  # (axis, outer, inner): a batch folded with the patches is not one sample per row
    if hops and (batch_dim.get(start) != 0 or (lay is not None and lay[1:] != (1, 1))) and static_batch == 1:
        return "whole"
    return True


@dataclasses.dataclass
class GraphAnalysis:
    primary: torch.fx.Node
    modality: str  # "vision" | "text" | "embeddings"
    sources: List[torch.fx.Node]
    live: Set[torch.fx.Node]
    relevant: Set[torch.fx.Node]
    batch_dim: Dict[torch.fx.Node, Optional[int]]
    pixel_convs: Dict[str, Union[bool, str]]  # convolution -> how z^B bounds its pixels (_pixel_bounds)
    blocks: List[BlockInfo]
    grid: Optional[Tuple[int, int]]
    outputs: List[torch.fx.Node]
    #: window attention (Swin): block index → how its windows sit in the stage's token grid, and
    #: block index → the token merging that follows it (relprop.graph.window_attention)
    windows: dict = dataclasses.field(default_factory=dict)
    stage_links: dict = dataclasses.field(default_factory=dict)
    #: where the first block's tokens come from (None: constants first, then the grid, row-major)
    tokens: Optional[TokenPlan] = None
    #: the first op that mixes tokens outside the attention blocks, in words (None: none)
    token_mixing: Optional[str] = None
    #: softmax-times-values products left out of the blocks or not mapped onto the tokens, and why
    left_out: List[str] = dataclasses.field(default_factory=list)
    #: two-stream models (encoder–decoder, co-attention; :mod:`relprop.graph.streams`): stream name
    #: (the input's name) -> its relevance sources, the explained input's stream first; {} otherwise
    streams: Dict[str, List[torch.fx.Node]] = dataclasses.field(default_factory=dict)
    #: the two streams are merged into one token sequence (a vision-language model writes the image
    #: features into the text's placeholder positions; :func:`relprop.graph.streams.merges`), not
    #: connected by cross-attention: the nodes that merge them ([] otherwise)
    merges: List[torch.fx.Node] = dataclasses.field(default_factory=list)
    #: where each live value's axes come from (:mod:`relprop.graph.axis_provenance`)
    axes: Dict[torch.fx.Node, list] = dataclasses.field(default_factory=dict, repr=False)
    #: node -> k where its batch axis interleaves the samples (rows o·batch·... + b·...: k factors before it)
    interleaved: Dict[torch.fx.Node, int] = dataclasses.field(default_factory=dict, repr=False)
    #: a [batch, a, b] floating input: the axis its first weight contracts (features: summed in a score per
    #: position), 2 (the last) unless a convolution reads it channels-first (Whisper's mel bins: 1)
    feature_axis: Optional[int] = None

    @property
    def unmapped(self) -> Optional[str]:
        """Why the blocks' attention cannot be read per sample as token-to-token maps (None: it can)."""
        return next((why for why in self.left_out if "groups of tokens" in why or SEPARATE in why), None)

    def nodes_in(self, layer: str) -> List[torch.fx.Node]:
        return [n for n in self.relevant if layer in module_paths(n)]


def _val(node):
    return node.meta.get("val")


def _is_float(v) -> bool:
    """A value that can carry the input's influence: floating point or complex (a rotary embedding computed
    in complex numbers, ``view_as_complex(q) * freqs``, is the input's value, not a constant)."""
    if isinstance(v, (list, tuple)):
        return any(_is_float(x) for x in v)
    return isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex())


def _input_nodes(node) -> List[torch.fx.Node]:
    return list(node.all_input_nodes)


def analyze(graph: torch.fx.Graph, bindings, primary_name: str, static_batch: Optional[int],
            batch_axes: Optional[Tuple[Dict[torch.fx.Node, Optional[int]], Dict[torch.fx.Node, int]]] = None
            ) -> GraphAnalysis:
    """What relprop needs to know about ``graph`` (see the module docstring). ``static_batch`` is the
    batch size of a graph captured for one batch size; a graph that takes every batch size comes with
    ``batch_axes``: each node's batch axis and, where its first axis folds k groups per sample into
    the batch, that k (:func:`relprop.graph.specialize.batch_axes`). A model called with a
    second token stream (:func:`relprop.graph.streams.second_stream`) is analysed with the sources of
    both streams; when an attention block connects them (queries of one, keys of the other), that
    analysis is kept, each block labelled with its query and key streams. When the explained input is
    an image whose features are written into the other stream's token sequence (a vision-language
    model, :func:`relprop.graph.streams.merges`), that analysis is kept too, with the merging nodes
    (``merges``) and no block labels. Otherwise the second input is a constant of the explanation, as
    for a model with one stream."""
    extra = streams.second_stream(bindings, primary_name)
    if extra is not None:
        two = _analyze(graph, bindings, primary_name, static_batch, batch_axes, extra)
        if any(b.query_stream and b.key_stream and b.query_stream != b.key_stream for b in two.blocks):
            return two
        if primary_name in streams.MERGED_INTO_TEXT:
            merged = streams.merges(graph, two.live, two.streams)
            if merged:
                for b in two.blocks:
                    b.query_stream = b.key_stream = None
                return dataclasses.replace(two, merges=merged)
    return _analyze(graph, bindings, primary_name, static_batch, batch_axes, None)


def _analyze(graph, bindings, primary_name, static_batch, batch_axes, extra) -> GraphAnalysis:
    placeholders = {n: (kind, tgt) for n, kind, tgt in bindings}
    primary = next(n for n, (kind, tgt) in placeholders.items() if kind == "user" and tgt == primary_name)
    primary_val = _val(primary)
    sources: List[torch.fx.Node] = []
    pixel_convs: Dict[str, Union[bool, str]] = {}

    def traces_to_primary(n) -> bool:
        seen = 0
        while n is not primary:
            if not isinstance(n, torch.fx.Node) or n.op != "call_function" or n.target not in INDEX_ROUTING \
                    or seen > 16:
                return False
            n = n.args[0]
            seen += 1
        return True

    if primary_val.is_floating_point():
        sources.append(primary)
        modality = "vision" if primary_val.dim() == 4 else "embeddings"
    else:
        modality = "text"
        for n in graph.nodes:
            if n.op == "call_function" and n.target is aten.embedding.default and traces_to_primary(n.args[1]):
                sources.append(n)

    stream_of: Dict[torch.fx.Node, str] = {}
    if extra is not None:
        stream_of = {n: primary_name for n in sources}
        extra_sources = streams.stream_sources(graph, extra[1], INDEX_ROUTING)
        stream_of.update({n: extra[0] for n in extra_sources})
        sources = sources + [n for n in extra_sources if n not in sources]
    live: Set[torch.fx.Node] = set(sources)
    for n in graph.nodes:
        if n in live or n.op != "call_function":
            continue
        if n.target in CONSTANT_PRODUCING:
            continue
        v = _val(n)
        if n.target is operator.getitem:
            src = n.args[0]
            if src in live and _is_float(v):
                live.add(n)
            continue
        if _is_float(v) and any(m in live for m in _input_nodes(n)):
            live.add(n)

    outputs = [o for o in _top_level_outputs(graph) if isinstance(o, torch.fx.Node)]

    relevant: Set[torch.fx.Node] = set()
    stack = [o for o in outputs if o in live]
    while stack:
        n = stack.pop()
        if n in relevant:
            continue
        relevant.add(n)
        if n in sources:
            continue
        stack.extend(m for m in _input_nodes(n) if m in live)

    # batch dimension of every node
    if batch_axes is not None:
        batch_dim, folds = batch_axes
        batch_dim = {n: batch_dim.get(n) for n in graph.nodes}
    else:
        folds = None
        batch_dim = {}
        for n in graph.nodes:
            v = _val(n)
            ok = isinstance(v, torch.Tensor) and v.dim() > 0 and static_batch is not None and v.shape[0] == static_batch
            batch_dim[n] = 0 if ok else None

    other_inputs = {n: batch_dim[n] for n, (kind, _) in placeholders.items()
                    if kind == "user" and n is not primary and batch_dim.get(n) is not None}
    axes = provenance(graph, primary, batch_dim.get(primary), live, other_inputs)
    layouts = {n: lay for n in live if (lay := batch_layout(axes.get(n))) is not None}
    if batch_axes is None and static_batch is not None:
        # a graph captured at one batch size: the samples' axis of a live value is where its provenance puts
        # the batch (Swin's windows [batch·windows, ...], heads folded into the batch, and sequence-major
        # [tokens, batch, ...] whose token count equals the batch size); sizes decide only where the
        # provenance is lost
        for n in live:
            lay = layouts.get(n)
            if lay is not None:
                batch_dim[n] = lay[0]
            elif fully_known(axes.get(n)):
                batch_dim[n] = None

    # convolutions reading the pixels (z^B rule), also through rearrangements of them (Qwen2-VL cuts the
    # image into rows of patches: reshape, permute, expand)
    if modality == "vision":
        for n in graph.nodes:
            if n.op == "call_function" and n.target is aten.convolution.default:
                pixel_convs[n.name] = _pixel_bounds(n.args[0], primary, batch_dim, static_batch, layouts)
    # values whose batch axis interleaves the samples (rows t·B + b: sequence-major rows flattened): node -> the
    # factor before the batch, for the ledger's per-sample sums (computed here once, not at every walk)
    interleaved = {n: lay[1] for n, lay in layouts.items() if lay[1] > 1 and lay[0] == batch_dim.get(n)}
    blocks, left_out = find_blocks(graph, live, fold_counter(batch_dim, static_batch, folds, layouts), axes)
    named: Dict[str, List[torch.fx.Node]] = {}
    if stream_of:
        labels = streams.label_blocks(graph, live, blocks, stream_of)
        for b in blocks:
            b.query_stream, b.key_stream = labels[b.index]
        for b, w in zip(blocks, streams.waves(blocks, live)):
            b.wave = w
        for n, name in stream_of.items():
            named.setdefault(name, []).append(n)
    grid = None
    for n in graph.nodes:
        if pixel_convs.get(n.name):
            shape = _val(n).shape
            if len(shape) == 4:
                grid = (int(shape[2]), int(shape[3]))
            break
    tokens = plan_tokens(graph, live, blocks, sources, modality)
    if tokens is not None and tokens.grid is not None:
        grid = tokens.grid  # the grid flattened into tokens (after a stem of several convolutions)
    window_maps = windows.find_window_maps(blocks, live, axes)
    links = windows.find_stage_links(blocks, live) if window_maps else {}
    grouped = [b for b in blocks if b.groups and b.index not in window_maps]
    if grouped:
        b = grouped[0]
        left_out.append(f"'{b.name}': attention within {b.groups} groups of tokens per sample (folded into the batch "
                        "axis), which relprop maps onto the token grid only for non-overlapping windows (Swin)")
    return GraphAnalysis(primary, modality, sources, live, relevant, batch_dim, pixel_convs, blocks, grid, outputs,
                         window_maps, links, tokens=tokens,
                         token_mixing=token_mixing(graph, live, blocks, sources if modality == "text" else None,
                                                   [o for o in outputs if o in live]),
                         left_out=left_out, streams=named, axes=axes, interleaved=interleaved,
                         feature_axis=input_feature_axis(graph, primary, live) if modality == "embeddings" else None)


def _top_level_outputs(graph) -> list:
    """The entries of the output node's argument (a list or tuple of them, or a single value)."""
    out = output_node(graph).args[0]
    return list(out) if isinstance(out, (list, tuple)) else [out]
