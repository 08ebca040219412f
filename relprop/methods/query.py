"""Which row of a token-to-token matrix explains the output: the *query*.

Methods that read "the [CLS] row" (Chefer et al., CVPR 2021: scores = C[CLS, tokens]; raw
attention, partial LRP, Grad-CAM on attention, AttCAT's variants, value zeroing) take the row of
the token states the model's head reads. relprop finds them from the gradient of the target with
respect to the attention of the block next to the output: a row i of that attention can only
influence the target through token i's output, so the rows with a non-zero gradient are exactly
the token states the head reads (the *support*). The query is the mean of the support's rows:

* a class-token model (ViT, DeiT, BERT, RoBERTa, DistilBERT) reads one state, the class token's:
  the query is its row, the paper's [CLS] row;
* an average-pooled model without a class token (timm ViTs with ``global_pool="avg"``, registers
  left out of the pool) reads the pooled tokens: the query is the mean of their rows, the row of
  the pooled output;
* a head that reads the class token and the mean of the patches (HF DINOv2) reads both: the mean
  of all their rows;
* a causal decoder (GPT-2, LLaMA: no real query attends to a later position in any block) reads one
  position for a next-token or last-token target, the last non-padding token; for a target that
  reads several positions the query is the last of them, the only row that sees all the others
  (row 0 of a causal map sees only itself). With an empty support (a target that does not depend on
  the attention) the query is the last real token of a decoder, else row 0.

Methods return the weights they used as ``"query"`` ([batch, rows]); the Explanation keeps them
(``exp.query``).
"""
from __future__ import annotations

from typing import Optional

import torch

from ..errors import MethodError
from ..graph.host_reads import deferring


def is_causal(trace) -> torch.Tensor:
    """True (a 0-d bool tensor on the maps' device, read by no one on the host) when every block's
    attention is causal: no real (non-padding) query attends to a later position (the strict upper
    triangle of A is exactly zero), as a causal mask makes it."""
    blocks = getattr(trace, "blocks", None) or []
    if not blocks or blocks[0].attention.shape[-1] < 2:
        return torch.zeros((), dtype=torch.bool)
    n = blocks[0].attention.shape[-1]
    device = blocks[0].attention.device
    real = real_tokens(trace, n, device)  # [B, N]
    above = _above_real(real)
    causal = torch.ones((), dtype=torch.bool, device=device)
    for b in blocks:
        causal = causal & causal_block(b.attention, real, above)
    return causal


def _above_real(real: torch.Tensor) -> torch.Tensor:
    """[batch, N, N] bool: the strict upper triangle on the real queries' rows."""
    n = real.shape[-1]
    return torch.ones(n, n, dtype=torch.bool, device=real.device).triu(1) & real[:, :, None]


def causal_block(a: torch.Tensor, real: torch.Tensor, above: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Whether one block's attention ``a`` ([batch, heads, N, N] or [batch, N, N]) is causal on the
    real queries ``real`` ([batch, N] bool, :func:`real_tokens`): its strict upper triangle is
    exactly zero there (a 0-d bool tensor). A map of another size than ``real`` is not. ``above``: the
    triangle on the real rows (:func:`_above_real`), when the caller tests several blocks."""
    n = real.shape[-1]
    if tuple(a.shape[-2:]) != (n, n):
        return torch.zeros((), dtype=torch.bool, device=a.device)
    above = _above_real(real) if above is None else above
    return ~((a != 0) & (above[:, None] if a.dim() == 4 else above)).any()


def support(trace) -> torch.Tensor:
    """[batch, rows of the last block's attention] bool: the rows with a non-zero gradient (the
    token states the target reads)."""
    return support_of(trace.blocks[-1].gradient)


def support_of(gradient: torch.Tensor) -> torch.Tensor:
    """[batch, rows] bool: the rows of an attention gradient ([batch, heads, N, N] or [batch, N, N])
    with a non-zero entry in some head."""
    read = gradient != 0
    if read.dim() == 4:  # [B, H, N, N]
        read = read.any(1)
    return read.any(-1)


def query_weights(trace) -> torch.Tensor:
    """[batch, rows of the last block's attention]: the weights of each sample's query row (the mean
    of the support's rows; see the module docstring). Chosen on the device: nothing is read on the host.
    Computed once per trace (``trace.memo``), whichever method asks."""
    memo = getattr(trace, "memo", None)
    if memo is not None and "query_weights" in memo:
        return memo["query_weights"]
    w = _query_weights(trace)
    if memo is not None:
        memo["query_weights"] = w
    return w


def _query_weights(trace) -> torch.Tensor:
    last = trace.blocks[-1].attention
    n, device = last.shape[-2], last.device
    read = support(trace).to(device)
    real = real_tokens(trace, n, device)
    if not deferring() and bool(row_zero_only(read)):  # (row 0 alone either way: no causality test)
        return weights_of(read, real, False)
    return weights_of(read, real, is_causal(trace))


def row_zero_only(read: torch.Tensor) -> torch.Tensor:
    """True (a 0-d bool tensor) when every sample's support (``read`` [batch, rows]) is row 0 alone, or
    there is one row: the query is the class token's row whether the model is causal or not."""
    if read.shape[1] < 2:
        return torch.ones((), dtype=torch.bool, device=read.device)
    return (read[:, 0] & (read.sum(1) == 1)).all()


def weights_of(read: torch.Tensor, real: torch.Tensor, causal) -> torch.Tensor:
    """[batch, rows]: the query weights from the support ``read`` and the real tokens ``real``
    ([batch, rows] bool each) of a causal or a non-causal model (``causal``: a bool, or a 0-d bool tensor
    decided on the device; see the module docstring): row 0 where every sample reads row 0 alone; a
    causal model's last row read (its last real token where it reads none); else the mean of the rows
    read (row 0 where it reads none)."""
    batch, n = read.shape
    device = read.device
    first = torch.zeros(batch, n, device=device)
    first[:, 0] = 1.0
    if n < 2:
        return first
    if causal is True or torch.is_tensor(causal):
        idx = torch.arange(n, device=device)
        last_real = torch.where(real, idx, -1).amax(1).clamp_min(0)
        last_read = torch.where(read, idx, -1).amax(1)
        q = torch.where(last_read >= 0, last_read, last_real)
        latest = (idx[None, :] == q[:, None]).float()  # (a one-hot without one_hot's range check on the host)
        if causal is True:
            return torch.where(row_zero_only(read), first, latest)
    count = read.sum(1, keepdim=True)
    mean = torch.where(count > 0, read.float() / count.clamp_min(1), first)
    if torch.is_tensor(causal):
        mean = torch.where(causal, latest, mean)
    return torch.where(row_zero_only(read), first, mean)


def query_vector(trace, rows: int, device=None, dtype=torch.float32) -> torch.Tensor:
    """[batch, rows]: the query weights for a matrix with ``rows`` rows in the last block's token
    space (the mean of all rows for window attention, whose head averages the last stage)."""
    if getattr(trace, "stages", None) is not None:
        # window attention (Swin, relprop.graph.window_attention): no class token; the head averages the
        # tokens of the last stage, so the query is the mean of the rows, at every stage
        return torch.full((trace.batch_size, rows), 1.0 / rows, device=device, dtype=dtype)
    return query_weights(trace).to(device=device, dtype=dtype)


def query_rows(trace, matrix: torch.Tensor) -> torch.Tensor:
    """The query row of each sample's ``matrix`` ([batch, ..., tokens, tokens] → [batch, ...,
    tokens]): ``matrix[:, ..., 0, :]`` for encoders with a class token."""
    if getattr(trace, "stages", None) is not None:
        return matrix.mean(-2)  # window attention: the mean of the rows (query_vector)
    return weighted_rows(query_vector(trace, matrix.shape[-2], matrix.device, matrix.dtype), matrix)


def weighted_rows(w: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """Σ_i w[b, i] · matrix[b, ..., i, :] for [batch, rows] weights. Per-head maps
    ([batch, heads, rows, cols]) are weighted one head at a time: the product w ⊙ matrix is then
    one head's size, not an attention-sized tensor (each output element is the same sum, in the
    same order)."""
    if w.shape[-1] != matrix.shape[-2]:
        raise MethodError(f"the query is defined on the {w.shape[-1]} token states the target reads at the last "
                          f"attention block, and this map has {matrix.shape[-2]} rows (another token space); read "
                          "the block next to the output instead (block=-1)")
    if matrix.dim() == 4 and matrix.shape[1] > 1:
        col = w.reshape(w.shape[0], w.shape[1], 1)
        return torch.stack([(col * matrix[:, h]).sum(-2) for h in range(matrix.shape[1])], 1)
    w = w.reshape((w.shape[0],) + (1,) * (matrix.dim() - 3) + (w.shape[1],))
    return (w[..., :, None] * matrix).sum(-2)


def real_tokens(trace, n: int, device) -> torch.Tensor:
    """[batch, tokens] bool: the non-padding positions (all of them without an attention mask)."""
    mask = getattr(trace, "token_mask", None)
    if torch.is_tensor(mask) and tuple(mask.shape) == (trace.batch_size, n):
        return mask.to(device).bool()
    return torch.ones(trace.batch_size, n, dtype=torch.bool, device=device)
