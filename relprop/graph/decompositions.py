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

On CUDA the same models export the fused kernels ``aten._scaled_dot_product_efficient_attention``,
``_scaled_dot_product_flash_attention`` or ``_scaled_dot_product_cudnn_attention`` (whichever the
backend picks for the shapes and dtype), which have no decomposition in torch's default table and
whose attention probabilities are never materialized. They get the same math-attention graph, in
the memory layout each kernel's fake implementation promises (efficient: [batch, tokens, heads,
dim] in memory; flash and cudnn: the query's), and placeholders for their auxiliary outputs
(log-sum-exp, random-number state), which only a backward kernel reads and the exported forward
graph never does.

An in-place write in the model's forward (``out[:, 1:] = h``, ``attn[..., i:, i:] = x``) is exported as
its functional form: ``aten.copy(slice_of_out, h)`` (a tensor shaped like the slice holding ``h``'s
values) and ``aten.slice_scatter`` / ``select_scatter`` putting it back. ``aten.copy`` has no derivative
in autograd and no relevance rule of its own; it is what it computes, the source broadcast to the
destination's shape in its dtype (:func:`copy_functional`), whose pieces have both.
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


def _math(query, key, value, attn_mask, dropout_p, is_causal, scale) -> torch.Tensor:
    return aten._scaled_dot_product_attention_math.default(
        query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
        dropout_mask=None, scale=scale, enable_gqa=query.size(1) != key.size(1))[0]


def _placeholder(query, *shape, dtype=torch.float) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=query.device)


def sdpa_efficient_cuda(query, key, value, attn_bias, compute_log_sumexp: bool, dropout_p: float = 0.0,
                        is_causal: bool = False, *, scale=None):
    """``_scaled_dot_product_efficient_attention`` (CUDA) as math attention, its output laid out as
    [batch, tokens, heads, dim] in memory like the kernel's."""
    out = _math(query, key, value, attn_bias, dropout_p, is_causal, scale)
    out = out.transpose(1, 2).contiguous().transpose(1, 2)
    lse = _placeholder(query, query.size(0), query.size(1), -(-query.size(2) // 32) * 32 if compute_log_sumexp else 0)
    return out, lse, _placeholder(query, dtype=torch.long), _placeholder(query, dtype=torch.long)


def sdpa_flash_cuda(query, key, value, dropout_p: float = 0.0, is_causal: bool = False,
                    return_debug_mask: bool = False, *, scale=None):
    """``_scaled_dot_product_flash_attention`` (CUDA) as math attention, in the query's layout."""
    out = _in_layout_of(_math(query, key, value, None, dropout_p, is_causal, scale), query)
    lse = _placeholder(query, query.size(0), query.size(1), query.size(2))
    return (out, lse, None, None, query.size(2), key.size(2), _placeholder(query, 2, dtype=torch.long),
            _placeholder(query, dtype=torch.long), _placeholder(query, 0, dtype=query.dtype))


def sdpa_cudnn_cuda(query, key, value, attn_bias, compute_log_sumexp: bool, dropout_p: float = 0.0,
                    is_causal: bool = False, return_debug_mask: bool = False, *, scale=None):
    """``_scaled_dot_product_cudnn_attention`` (CUDA) as math attention, in the query's layout."""
    out = _in_layout_of(_math(query, key, value, attn_bias, dropout_p, is_causal, scale), query)
    lse = _placeholder(query, query.size(0), query.size(1), query.size(2), 1)
    return (out, lse, None, None, query.size(2), key.size(2), _placeholder(query, dtype=torch.long),
            _placeholder(query, dtype=torch.long), None)


def copy_functional(self, src, non_blocking: bool = False):
    """``aten.copy(self, src)``: ``src``'s values broadcast to ``self``'s shape, in ``self``'s dtype and on
    its device; ``self``'s values are not read (a fresh tensor: no view of ``src``)."""
    out = src.to(dtype=self.dtype, device=self.device)
    return out.expand(self.shape).clone()


def extra_decompositions() -> Dict[object, Callable]:
    """Entries that replace torch's defaults in relprop's decomposition table."""
    table = {aten._scaled_dot_product_flash_attention_for_cpu.default: sdpa_flash_cpu,
             aten.copy.default: copy_functional}
    for name, fn in (("_scaled_dot_product_efficient_attention", sdpa_efficient_cuda),
                     ("_scaled_dot_product_flash_attention", sdpa_flash_cuda),
                     ("_scaled_dot_product_cudnn_attention", sdpa_cudnn_cuda)):
        packet = getattr(aten, name, None)  # absent from some builds
        if packet is not None:
            table[packet.default] = fn
    return table
