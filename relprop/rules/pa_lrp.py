"""The ``"pa_lrp"`` preset: position-aware LRP (Bakish, Zimerman, Chefer & Wolf, "Revisiting LRP:
Positional Attribution as the Missing Ingredient for Transformer Explainability", NeurIPS 2025).

Bakish et al. observe that AttnLRP treats the position encoding as a constant: the relevance it
receives is lost (learned / absolute position embeddings, added to the tokens) or, for rotary
embeddings (RoPE), the rotation factors cos θ and sin θ get none and the content path gets all.
PA-LRP makes the position encoding an input of the explanation and reassigns the relevance that
reaches it to the token at that position:

* **learned or absolute position embeddings** (ViT, DeiT, BERT's ``position_embeddings``, GPT-2's
  ``wpe``): h = x + P. The ε-rule (AttnLRP Eq. 8) gives P its share P ⊙ R / h; AttnLRP absorbs it,
  PA-LRP hands Σ_d R_P[t, d] to token t (the prefix tokens' shares, class and distillation token,
  whose tokens are constants, stay absorbed). On images the token's share is spread evenly over
  the pixels of its patch, as the authors' code upsamples it (each pixel gets R_P,t / (C·p²)).
* **rotary embeddings** (LLaMA-style decoders): q_rot = q ⊙ cos + rotate(q) ⊙ sin, and the same
  for k. With cos and sin live, each product has two live factors and the uniform rule of AttnLRP
  (Prop. 3.2, Eq. 7) gives each half; the halves reaching cos and sin, summed over heads and
  dimensions at position t and over layers, go to token t.

Everything else is AttnLRP (``"attnlrp"``, which this preset extends). The reassignment is done by
the engine's walk (:mod:`relprop.engine.walk`), which asks :func:`position_kind` whether a
constant operand is a position encoding; the one-backward fast path is not used for this preset.

The authors' evaluation code also offers normalized and absolute-value variants of the sum (each
layer's cos/sin relevance divided by its largest magnitude and taken as |·| before it is added);
this preset implements the signed sum, the one that keeps conservation: the relevance at the
tokens equals the explained score minus what biases, the softmax's bias term and the class token
absorb.
"""
from __future__ import annotations

import re
from typing import Optional

import torch
import torch.fx

from ..graph.analysis import INDEX_ROUTING
from . import attnlrp
from .gradient_forms import half_gradient
from .rule_registry import Preset, rule

aten = torch.ops.aten

PA_LRP = Preset(
    "pa_lrp", extends=attnlrp.ATTNLRP,
    description="PA-LRP (Bakish et al., NeurIPS 2025): AttnLRP, with the relevance of position encodings (learned "
                "position embeddings; RoPE's cos/sin factors, uniform rule) reassigned to the token at each position")
PA_LRP.positional = True
PRESET = "pa_lrp"

#: names of learned / absolute position-embedding parameters (timm ``pos_embed``, HF
#: ``position_embeddings``, GPT-2 ``wpe``, OPT/BART ``embed_positions``)
LEARNED_NAMES = re.compile(r"(^|[._])(pos_embed|pos_embedding|position_embeddings?|wpe|embed_positions)([._]|$)")
#: the ops RoPE's factors are computed with
ROTARY_OPS = (aten.cos.default, aten.sin.default)
#: ops between a parameter and the tensor added to the tokens (lookups, copies, shape changes)
_LOOKUPS = INDEX_ROUTING | {aten.embedding.default, aten._to_copy.default, aten.clone.default, aten.add.Tensor,
                            aten.mul.Tensor, aten.mul.Scalar, aten.unsqueeze.default, aten.expand.default}


def _ancestors(arg, hops: int):
    """The nodes ``arg`` is computed from, up to ``hops`` ops back (breadth first)."""
    seen, frontier = [], [arg]
    for _ in range(hops + 1):
        nxt = []
        for n in frontier:
            if not isinstance(n, torch.fx.Node) or n in seen:
                continue
            seen.append(n)
            nxt.extend(n.all_input_nodes)
        frontier = nxt
    return seen


def is_rotary_factor(arg, hops: int = 6) -> bool:
    """Whether graph argument ``arg`` (a constant operand of a product) is RoPE's cos θ or sin θ:
    computed from a ``cos``/``sin`` op within ``hops`` ops (through the unsqueeze, casts and the
    attention scaling that follow)."""
    return any(n.op == "call_function" and n.target in ROTARY_OPS for n in _ancestors(arg, hops))


def learned_position_name(arg, placeholders, hops: int = 6) -> Optional[str]:
    """The parameter name of a learned / absolute position embedding that graph argument ``arg``
    (a constant operand) is read from, within ``hops`` lookups, shape changes and copies; None if
    it is not one. ``placeholders`` maps placeholder nodes to ``(kind, target name)``."""
    for n in _ancestors(arg, hops):
        if n in placeholders and LEARNED_NAMES.search(str(placeholders[n][1])):
            return str(placeholders[n][1])
        if n.op == "call_function" and n.target not in _LOOKUPS:
            return None
    return None


def position_kind(arg, consumer, placeholders) -> Optional[str]:
    """What PA-LRP reassigns at constant ``arg`` of node ``consumer``: ``"rotary"`` (a RoPE factor
    of a product), ``"learned"`` (a position embedding added to the tokens) or None (a constant
    AttnLRP's rules absorb as usual)."""
    if not isinstance(arg, torch.fx.Node) or consumer.op != "call_function":
        return None
    if consumer.target is aten.mul.Tensor and is_rotary_factor(arg):
        return "rotary"
    if consumer.target in (aten.add.Tensor,) and learned_position_name(arg, placeholders) is not None:
        return "learned"
    return None


def _rotary_operand(ctx) -> Optional[int]:
    """The position of the constant RoPE factor of a product with one live operand, else None."""
    live = [ctx.live[i] is True for i in range(2)]
    if live[0] == live[1]:
        return None
    const = 1 if live[0] else 0
    return const if is_rotary_factor(ctx.node.args[const]) else None


def _form(node, live, eps):
    return attnlrp.product_form(lambda n, a, b: half_gradient(a * b))(node, live, eps)


@rule(aten.mul.Tensor, preset=PRESET, gradient_form=_form)
def rotary_uniform_multiply(ctx, relevance):
    """Element-wise product. A product of a live tensor with RoPE's cos θ or sin θ: the factor is a
    position input (Bakish et al., NeurIPS 2025), so both factors are live and the uniform rule of
    AttnLRP (Prop. 3.2, Eq. 7) gives each R/2; the factor's half is reassigned to its token by the
    walk. Every other product: AttnLRP's rule (:func:`relprop.rules.attnlrp.uniform_multiply`)."""
    const = _rotary_operand(ctx)
    if const is None:
        return attnlrp.uniform_multiply(ctx, relevance)
    half = relevance / 2
    return (half, half)


def is_positional(preset: Preset) -> bool:
    """Whether ``preset`` or a preset it extends reassigns position relevance to tokens (PA-LRP): a
    preset marks itself so with the attribute ``positional = True``, as :data:`PA_LRP` does."""
    return any(getattr(p, "positional", False) for p in preset.lineage())
