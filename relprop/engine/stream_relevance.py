"""Input relevance of two-stream models (encoder–decoder, co-attention), per stream.

A model whose analysis found two token streams (:mod:`relprop.graph.streams`) has relevance
sources in both; the relevance that reaches each stream's sources is kept apart (the explained
input's relevance is ``Trace.input_relevance`` as for any model; every stream's is in
``Trace.stream_relevance``): the embedding lookups of an id input summed over the embedding size
(one value per token), a float input as it is (pixels, log-mel features, region features).
"""
from __future__ import annotations

from typing import Dict, Iterable, Tuple

import torch
import torch.fx


def per_stream(analysis, parts: Iterable[Tuple[torch.fx.Node, torch.Tensor]], placeholders=frozenset()
               ) -> Dict[str, torch.Tensor]:
    """Stream name -> the relevance that reached its sources (see the module docstring); {} for a
    model with one stream."""
    out: Dict[str, torch.Tensor] = {}
    if not analysis.streams:
        return out
    owner = {n: name for name, nodes in analysis.streams.items() for n in nodes}
    for node, r in parts:
        name = owner.get(node)
        if name is None or not torch.is_tensor(r):
            continue
        if node.op == "call_function":  # an embedding lookup: one value per token
            r = r.sum(-1)
        out[name] = r if name not in out else out[name] + r
    return out


def primary_parts(analysis, parts):
    """The (source, relevance) pairs of the explained input's stream (all of them for one stream)."""
    if not analysis.streams:
        return list(parts)
    mine = set(next(iter(analysis.streams.values())))
    return [(n, r) for n, r in parts if n in mine]


#: the mask input that marks the real tokens of each stream input
MASK_OF = {"input_ids": "attention_mask", "inputs_embeds": "attention_mask",
           "decoder_input_ids": "decoder_attention_mask", "decoder_inputs_embeds": "decoder_attention_mask",
           "visual_feats": "visual_attention_mask"}


def stream_masks(analysis, kwargs, batch: int) -> Dict[str, torch.Tensor]:
    """Stream name -> [batch, tokens] bool, True at the real tokens, for the streams called with
    their attention mask (``attention_mask``, ``decoder_attention_mask``, ``visual_attention_mask``)."""
    out = {}
    for name in analysis.streams:
        m = kwargs.get(MASK_OF.get(name, ""))
        if torch.is_tensor(m) and m.dim() == 2 and m.shape[0] == batch:
            out[name] = m != 0
    return out
