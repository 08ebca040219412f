"""Two token streams: encoder–decoder and co-attention models.

A translation model (T5, BART, Marian), a captioner (ViT → GPT-2), a speech recognizer (Whisper)
or a co-attention model (LXMERT) reads two inputs that are token sequences of their own: the
source (``input_ids``, ``pixel_values``, ``input_features``) and the target (``decoder_input_ids``),
or the words and the image regions (``input_ids``, ``visual_feats``). Attention blocks whose
queries are the tokens of one stream and whose keys are the tokens of the other (cross-attention,
co-attention) connect them.

:func:`second_stream` picks the candidate second input; :func:`stream_sources` finds where its
relevance stops (its embedding lookups, or the input itself for features); :func:`label_blocks`
labels every live node with the stream whose tokens index its token axis — a source's stream,
kept by every op whose live inputs agree; the scores Q·Kᵀ of a block pair the query's stream with
the key's, and A·V takes the query's stream back — and so gives each block its query and key
stream. :func:`waves` groups blocks that read the same state (the two co-attention blocks of an
LXMERT layer), which the bi-modal relevancy rules update together (Chefer, Gur & Wolf, ICCV 2021,
§3.2).
"""
from __future__ import annotations

import re
from typing import Dict, List, Optional, Set, Tuple

import torch
import torch.fx

from .nodes import ancestors

aten = torch.ops.aten

#: inputs that are never a token stream of their own (masks, positions, boxes, labels, caches)
_NOT_A_STREAM = re.compile(r"mask|pos|type|label|cache|head|length|ids_restore|interpolate|return_|use_")
#: inputs that may be the second stream, in order of preference
SECOND_STREAM_NAMES = ("decoder_input_ids", "decoder_inputs_embeds", "visual_feats", "pixel_values",
                       "input_ids", "input_features")


#: explained inputs whose stream a vision-language model merges into the text's token sequence
MERGED_INTO_TEXT = ("pixel_values",)
#: ops that write one stream's features into the other's sequence (``x[mask] = features``)
MERGING_OPS = (aten.masked_scatter.default, aten.index_put.default)


def merges(graph, live: Set[torch.fx.Node], stream_nodes: Dict[str, List[torch.fx.Node]]) -> List[torch.fx.Node]:
    """The live nodes that write features of one stream into a tensor of the other stream
    (``masked_scatter(text_embeddings, image_mask, image_features)``, ``index_put`` without
    accumulation): how a vision-language model (LLaVA, PaliGemma, Gemma-3, ...) merges its projected
    image tokens into the placeholder positions of the prompt. [] when the streams never merge so."""
    if len(stream_nodes) != 2:
        return []
    (_, first), (_, second) = stream_nodes.items()
    first, second = set(first), set(second)
    out = []
    for n in graph.nodes:
        if n.op != "call_function" or n.target not in MERGING_OPS or n not in live:
            continue
        if n.target is aten.index_put.default and len(n.args) > 3 and n.args[3]:
            continue
        into, written = n.args[0], n.args[2]
        if not (isinstance(into, torch.fx.Node) and isinstance(written, torch.fx.Node)):
            continue
        a, b = ancestors([into], live), ancestors([written], live)
        if (a & first and b & second) or (a & second and b & first):
            out.append(n)
    return out


def second_stream(bindings, primary_name: str) -> Optional[Tuple[str, torch.fx.Node]]:
    """(name, placeholder) of the user input that may be a second token stream: the first of
    :data:`SECOND_STREAM_NAMES` (other than the explained input) the model was called with, else
    None. Whether it is one is decided by the graph (:func:`label_blocks` finds a block between
    the two streams)."""
    users = {tgt: n for n, kind, tgt in bindings if kind == "user"}
    for name in SECOND_STREAM_NAMES:
        node = users.get(name)
        if name == primary_name or node is None or _NOT_A_STREAM.search(name):
            continue
        v = node.meta.get("val")
        if isinstance(v, torch.Tensor) and v.dim() >= 2:
            return name, node
    return None


def stream_sources(graph, placeholder: torch.fx.Node, routing) -> List[torch.fx.Node]:
    """Where relevance of a stream stops: the input itself when it holds features (float), else
    the embedding lookups that read its ids (through the shape-only ops ``routing``)."""
    v = placeholder.meta.get("val")
    if v.is_floating_point():
        return [placeholder]

    def reads(n) -> bool:
        for _ in range(17):
            if n is placeholder:
                return True
            if not isinstance(n, torch.fx.Node) or n.op != "call_function" or n.target not in routing:
                return False
            n = n.args[0]
        return False

    return [n for n in graph.nodes
            if n.op == "call_function" and n.target is aten.embedding.default and reads(n.args[1])]


def label_blocks(graph, live: Set[torch.fx.Node], blocks, source_stream: Dict[torch.fx.Node, str]
                 ) -> Dict[int, Tuple[Optional[str], Optional[str]]]:
    """Block index -> (query stream, key stream), from the stream labels of the block's queries
    (the left operand of Q·Kᵀ, else the attention's rows) and values."""
    scores = {b.scores: b for b in blocks if b.scores is not None}
    products = {b.product: b for b in blocks}
    label: Dict[torch.fx.Node, object] = {}
    for n in graph.nodes:
        if n in source_stream:
            label[n] = source_stream[n]
            continue
        if n not in live or n.op != "call_function":
            continue
        if n in scores:
            label[n] = (_row(label.get(n.args[0])), _row(label.get(n.args[1])))
            continue
        if n in products:
            label[n] = _row(label.get(n.args[0]))
            continue
        seen = {label[m] for m in n.all_input_nodes if m in label and label[m] is not None}
        label[n] = seen.pop() if len(seen) == 1 else ("mixed" if seen else None)
    out = {}
    for b in blocks:
        pair = label.get(b.attention)
        query = pair[0] if isinstance(pair, tuple) else _row(pair)
        key = _row(label.get(b.value)) if b.value is not None else None
        if isinstance(pair, tuple) and pair[1] is not None:
            key = pair[1]
        out[b.index] = (query, key)
    return out


def _row(lab) -> Optional[str]:
    if isinstance(lab, tuple):
        return lab[0]
    return lab if isinstance(lab, str) and lab != "mixed" else None


def waves(blocks, live: Set[torch.fx.Node]) -> List[int]:
    """Per block, the index of its *wave*: consecutive blocks whose attention does not depend on
    the output of another block of the same wave read the same relevancy state and are updated
    together (LXMERT's two co-attention blocks of a layer)."""
    out, current, members = [], -1, []
    for b in blocks:
        above = ancestors([b.attention], live)
        if current < 0 or any(m.product in above for m in members):
            current += 1
            members = []
        members.append(b)
        out.append(current)
    return out

