"""relprop's decompositions of the fused attention kernels (relprop/graph/decompositions.py).

On CUDA, ``torch.export`` records ``aten._scaled_dot_product_efficient_attention`` /
``_flash_attention`` / ``_cudnn_attention`` for ``F.scaled_dot_product_attention``; relprop decomposes
them into math attention so that the attention probabilities are a node of the graph. These kernels
cannot run on this CPU, so each decomposition is checked here against the definition of attention,
softmax(Q Kᵀ · scale + mask) V written out (causal, additive mask, grouped-query heads), and against
the memory layout the kernel's fake implementation promises (torch's meta function, run on meta
tensors): a different layout makes the model's later ``.view`` fail when the graph is re-traced.
"""
from __future__ import annotations

import math

import pytest
import torch

from relprop.graph import decompositions as dec
from relprop.graph.export import decomposition_table

aten = torch.ops.aten


def _reference(q, k, v, mask=None, causal=False, scale=None):
    """softmax(Q Kᵀ · scale + mask) V, grouped-query heads repeated, in float64."""
    q, k, v = q.double(), k.double(), v.double()
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = q @ k.transpose(-1, -2) * (scale if scale is not None else 1 / math.sqrt(q.shape[-1]))
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    if mask is not None:
        s = s + mask.double()
    return torch.softmax(s, -1) @ v


def _qkv(transposed: bool, kv_heads: int = 4, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    shape = (2, 5, 4, 8)  # [batch, tokens, heads, dim] in memory, as most models lay the query out
    q = torch.randn(shape, generator=g).transpose(1, 2) if transposed else torch.randn(2, 4, 5, 8, generator=g)
    k = torch.randn(2, kv_heads, 5, 8, generator=g)
    v = torch.randn(2, kv_heads, 5, 8, generator=g)
    return q, k, v


def _meta(t):
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def _stride_order(t):
    return sorted(range(t.dim()), key=lambda d: -t.stride(d))


KERNELS = {
    "efficient": (aten._scaled_dot_product_efficient_attention.default, dec.sdpa_efficient_cuda, True),
    "flash": (aten._scaled_dot_product_flash_attention.default, dec.sdpa_flash_cuda, False),
    "cudnn": (aten._scaled_dot_product_cudnn_attention.default, dec.sdpa_cudnn_cuda, True),
}


def _call(fn, takes_bias, q, k, v, mask, causal, scale):
    if takes_bias:
        return fn(q, k, v, mask, False, 0.0, causal, scale=scale)
    return fn(q, k, v, 0.0, causal, scale=scale)


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("transposed", [False, True], ids=["contiguous", "transposed-query"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_decomposition_is_attention_in_the_kernels_layout(kernel, transposed, causal):
    op, fn, takes_bias = KERNELS[kernel]
    q, k, v = _qkv(transposed)
    mask = torch.randn(2, 1, 5, 5) if takes_bias and not causal else None
    out = _call(fn, takes_bias, q, k, v, mask, causal, 0.3)
    assert torch.allclose(out[0].double(), _reference(q, k, v, mask, causal, 0.3), atol=1e-5)
    promised = _call(op, takes_bias, _meta(q), _meta(k), _meta(v), None if mask is None else _meta(mask), causal, 0.3)
    assert len(out) == len(promised)  # the same outputs, so the graph's getitem indices stay valid
    assert out[0].shape == promised[0].shape and _stride_order(out[0]) == _stride_order(promised[0])


def test_grouped_query_heads_are_repeated():
    q, k, v = _qkv(False, kv_heads=2, seed=3)
    out = dec.sdpa_efficient_cuda(q, k, v, None, False, 0.0, True)[0]
    assert torch.allclose(out.double(), _reference(q, k, v, causal=True), atol=1e-5)


def test_the_fused_kernels_are_in_relprops_decomposition_table():
    table = decomposition_table()
    for op, fn, _ in KERNELS.values():
        assert table[op] is fn
    assert table[aten._scaled_dot_product_flash_attention_for_cpu.default] is dec.sdpa_flash_cpu
