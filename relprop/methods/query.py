"""Which row of a token-to-token matrix explains the output: the *query*.

Methods that read "the [CLS] row" (Chefer et al., CVPR 2021: scores = C[CLS, tokens]; raw
attention, partial LRP, Grad-CAM on attention, AttCAT's variants, value zeroing) take the row of
the token whose final state the model's head reads. relprop finds that token structurally, from
the gradient of the target with respect to the attention of the block next to the output: a row
i of that attention can only influence the target through token i's output, so the rows with a
non-zero gradient are exactly the token states the head reads (the *support*).

* The support contains position 0 — an encoder with a class token (ViT, DeiT, BERT, RoBERTa,
  DistilBERT; also encoders that pool every token, which keep the class-token convention and
  take ``query="mean"`` where a method offers it): the query is row 0, the paper's [CLS] row.
* A causal decoder (GPT-2, LLaMA: no real query attends to a later position in any block) has no
  class token; its head reads one position — the last non-padding token for
  ``GPT2ForSequenceClassification`` and for next-token targets — and, because of the causal mask,
  that row is the only one that sees the whole text (row 0 sees only itself). The query is the
  last position of the support (for a target that reads several positions, the one that sees
  the most); with an empty support (a target that does not depend on the attention) the last
  real token.
* Otherwise the head pools several token states and no class token (a global-average-pooled
  ViT with register tokens, whose registers are not pooled): the query is the mean of the
  supported rows, the row of the pooled output.
"""
from __future__ import annotations

import torch


def is_causal(trace) -> bool:
    """True when every block's attention is causal: no real (non-padding) query attends to a
    later position (the strict upper triangle of A is exactly zero), as a causal mask makes it."""
    blocks = getattr(trace, "blocks", None) or []
    if not blocks:
        return False
    n = blocks[0].attention.shape[-1]
    if n < 2:
        return False
    device = blocks[0].attention.device
    upper = torch.ones(n, n, dtype=torch.bool, device=device).triu(1)
    real = real_tokens(trace, n, device)  # [B, N]
    for b in blocks:
        a = b.attention
        if tuple(a.shape[-2:]) != (n, n):
            return False
        rows = real[:, None, :, None] if a.dim() == 4 else real[:, :, None]
        if bool(((a != 0) & upper & rows).any()):
            return False
    return True


def support(trace) -> torch.Tensor:
    """[batch, tokens] bool: the rows of the last block's attention with a non-zero gradient (the
    token states the target reads)."""
    read = trace.blocks[-1].gradient != 0
    if read.dim() == 4:  # [B, H, N, N]
        read = read.any(1)
    return read.any(-1)


def query_weights(trace) -> torch.Tensor:
    """[batch, tokens] weights of the query row of each sample (one-hot, or uniform over the pooled
    tokens); see the module docstring."""
    blocks = trace.blocks
    n, device = blocks[0].attention.shape[-1], blocks[0].attention.device
    read = support(trace).to(device)
    weights = torch.zeros(trace.batch_size, n, device=device)
    weights[:, 0] = 1.0
    if n < 2 or bool(read[:, 0].all()):
        return weights
    idx = torch.arange(n, device=device)
    if is_causal(trace):
        last_real = torch.where(real_tokens(trace, n, device), idx, -1).amax(1).clamp_min(0)
        last_read = torch.where(read, idx, -1).amax(1)
        q = torch.where(last_read >= 0, last_read, last_real)
        return torch.nn.functional.one_hot(q, n).float()
    for b in range(trace.batch_size):
        if bool(read[b, 0]) or not bool(read[b].any()):
            continue
        weights[b] = read[b].float() / read[b].sum()
    return weights


def query_rows(trace, matrix: torch.Tensor) -> torch.Tensor:
    """The query row of each sample's ``matrix`` ([batch, ..., tokens, tokens] → [batch, ...,
    tokens]): ``matrix[:, ..., 0, :]`` for encoders with a class token."""
    if getattr(trace, "stages", None) is not None:
        # window attention (Swin, relprop.graph.windows): no class token; the head averages the
        # tokens of the last stage, so the query is the mean of the rows, at every stage
        return matrix.mean(-2)
    w = query_weights(trace).to(device=matrix.device, dtype=matrix.dtype)
    w = w.reshape((w.shape[0],) + (1,) * (matrix.dim() - 3) + (w.shape[1],))
    return (w[..., :, None] * matrix).sum(-2)


def real_tokens(trace, n: int, device) -> torch.Tensor:
    """[batch, tokens] bool: the non-padding positions (all of them without an attention mask)."""
    mask = getattr(trace, "token_mask", None)
    if torch.is_tensor(mask) and tuple(mask.shape) == (trace.batch_size, n):
        return mask.to(device).bool()
    return torch.ones(trace.batch_size, n, dtype=torch.bool, device=device)
