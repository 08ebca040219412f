"""Decompositions relprop adds to torch's default table before ``run_decompositions``.

Fused attention on CPU is exported as ``aten._scaled_dot_product_flash_attention_for_cpu``. Its
fake (meta) implementation allocates the output like the query (``empty_like``), so the exported
graph records the query's memory layout for it: in GPT-2, whose query is a transposed view
([batch, tokens, heads, dim] in memory), the model's later ``.view(-1, hidden)`` is valid during
export. torch's stock decomposition of that op returns a different layout ([tokens, batch, heads,
dim] in memory), so re-tracing the decomposed graph fails with "Cannot view a tensor with shape
... and strides ...". Our decomposition computes the same math-attention graph (matmul → scale →
mask → softmax → matmul, so the attention probabilities are a node) and then copies the output
into the query's layout, which is what the fake implementation promised. The copy is a
``permute → clone → permute``: shape-only ops that route relevance unchanged.
"""
from __future__ import annotations

from typing import Callable, Dict

import torch
from torch._prims_common import compute_elementwise_output_logical_to_physical_perm

aten = torch.ops.aten


def _in_layout_of(out: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``out`` with the memory layout (stride order) of ``like``; same values and shape."""
    perm, _ = compute_elementwise_output_logical_to_physical_perm(like)
    perm = list(perm)
    if perm == list(range(out.dim())):
        return out.contiguous()
    inverse = [0] * len(perm)
    for i, p in enumerate(perm):
        inverse[p] = i
    return out.permute(perm).contiguous().permute(inverse)


def sdpa_flash_cpu(query, key, value, dropout_p: float = 0.0, is_causal: bool = False, *,
                   attn_mask=None, scale=None):
    """``_scaled_dot_product_flash_attention_for_cpu`` as math attention, in the query's layout."""
    output, attn = aten._scaled_dot_product_attention_math.default(
        query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
        dropout_mask=None, scale=scale, enable_gqa=query.size(1) != key.size(1))
    return _in_layout_of(output, query), attn


def extra_decompositions() -> Dict[object, Callable]:
    """Entries that replace torch's defaults in relprop's decomposition table."""
    return {aten._scaled_dot_product_flash_attention_for_cpu.default: sdpa_flash_cpu}
