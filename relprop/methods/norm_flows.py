"""Norm-based token-to-token maps (Kobayashi et al., EMNLP 2020 "Attention is not only a weight:
analyzing transformers with vector norms"; Kobayashi et al., EMNLP 2021 "Incorporating residual and
normalization layers into analysis of masked language models"; the survey's §1.5).

Notation: x_j the token features entering the attention (LN1(h) in pre-norm blocks, h in post-norm
ones), v^h_j = x_j W_V^h + b_V^h token j's value in head h, f^h(x_j) = v^h_j W_O^h (W_O^h the
columns h·d:(h+1)·d of the output projection), α^h_ij the attention.

* 2020, §3 (their Eq. 5–6): the attention output is y_i = Σ_j Σ_h α^h_ij f^h(x_j) + b_O; the
  contribution of token j to token i is N[i, j] = ‖Σ_h α^h_ij f^h(x_j)‖ ("combined" heads) or, per
  head, N^h[i, j] = ‖α^h_ij f^h(x_j)‖.
* 2021, §3 (their Eq. 6–9, "ATTN-RES-LN"): with the residual, z_i = Σ_j F_i(x_j) + b_O with
  F_i(x_j) = Σ_h α^h_ij f^h(x_j) + δ_ij r_j (r the residual the attention output is added
  to); a LayerNorm after the sum (post-norm models, BERT) is linear but for its scale, LN(z_i) =
  Σ_j g_{z_i}(F_i(x_j)) + g_{z_i}(b_O) + β with g_z(u) = γ ⊙ (u − mean(u)) / sqrt(Var(z) + ε)
  (Eq. 8), so N[i, j] = ‖g_{z_i}(F_i(x_j))‖. The biases are given to no token (as the paper). In
  pre-norm blocks (ViT) no LayerNorm follows the sum inside the block: N[i, j] = ‖F_i(x_j)‖.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..errors import MethodError, OptionError
from .aggregation import Aggregation, aggregate
from .method_registry import method

aten = torch.ops.aten

_PASS = {aten.dropout.default, aten.clone.default, aten.alias.default, aten.view.default, aten.reshape.default,
         aten._to_copy.default, aten.contiguous.default}


def value_transforms(b) -> torch.Tensor:
    """f^h(x_j) = v^h_j W_O^h of a block record: [batch, heads, tokens, hidden]."""
    if b.value is None or b.out_proj_weight is None:
        missing = "attention output projection W_O" if b.out_proj_weight is None else "attention values V"
        raise MethodError(f"the norm-based maps need the {missing} of block {b.index} ('{b.name}'), and none was "
                          "recognized in this model's graph (a linear layer applied to the concatenated heads). "
                          "Methods that apply with the attention maps alone: raw_attention, rollout, grads, "
                          "attgrads, attention_gradcam, gradient_rollout, transformer_attribution.")
    v, w = b.value, b.out_proj_weight
    heads, d = v.shape[1], v.shape[-1]
    if w.shape[-1] != heads * d:
        raise MethodError(f"the output projection of block {b.index} takes {w.shape[-1]} inputs, not heads x head "
                          f"size = {heads} x {d}")
    return torch.einsum("bhjd,chd->bhjc", v, w.reshape(w.shape[0], heads, d))


def _rows(n: int, batch: int, width: int) -> int:
    return max(1, (1 << 24) // max(1, batch * n * width))  # query rows per chunk: bounded memory


def norm_map(b, per_head: bool = False) -> torch.Tensor:
    """Kobayashi et al. 2020, Eq. 5–6: N[i, j] = ‖Σ_h α^h_ij f^h(x_j)‖ [batch, N, N], or with
    ``per_head`` N^h[i, j] = ‖α^h_ij f^h(x_j)‖ [batch, heads, N, N]."""
    a = b.attention
    f = value_transforms(b)
    batch, heads, n, _ = a.shape
    if per_head:  # ‖α f‖ = α ‖f‖ (α ≥ 0)
        return a * torch.linalg.vector_norm(f, dim=-1)[:, :, None, :]
    out = torch.empty(batch, n, n, dtype=f.dtype, device=f.device)
    step = _rows(n, batch, f.shape[-1])
    for i0 in range(0, n, step):
        mixed = torch.einsum("bhij,bhjc->bijc", a[:, :, i0:i0 + step], f)
        out[:, i0:i0 + step] = torch.linalg.vector_norm(mixed, dim=-1)
    return out


def _after_projection(session, index: int):
    """(residual add node, residual operand node, layer_norm node or None, the operands of the
    per-channel scalings on the way (LayerScale)) of block ``index``: the sum the attention output is
    added to, and the LayerNorm right after it (post-norm), read off the captured graph; a MethodError
    when the graph has no such add."""
    info = session.captured.analysis.blocks[index]
    weight = info.out_proj
    linear = next((u for u in (weight.users if weight is not None else ()) if u.target is aten.linear.default), None)
    node = linear
    scales = []
    for _ in range(8):
        if node is None:
            break
        users = [u for u in node.users if u.op == "call_function"]
        add = next((u for u in users if u.target is aten.add.Tensor), None)
        if add is not None:
            other = add.args[1] if add.args[0] is node else add.args[0]
            # post-norm (BERT): the LayerNorm is the only reader of the sum, the residual goes on from its
            # output; pre-norm (ViT): the sum is the residual itself, read by the next norm and the next residual
            readers = list(add.users)
            ln = readers[0] if len(readers) == 1 and readers[0].target is aten.layer_norm.default else None
            return add, other, ln, scales
        mul = next((u for u in users if u.target is aten.mul.Tensor and len(users) == 1), None)
        if mul is not None:  # LayerScale: the attention output times a per-channel parameter
            factor = mul.args[1] if mul.args[0] is node else mul.args[0]
            if isinstance(factor, torch.fx.Node) and factor.op in ("placeholder", "get_attr"):
                scales.append(factor)
                node = mul
                continue
        nxt = [u for u in users if u.target in _PASS]
        node = nxt[0] if len(nxt) == 1 else None
    raise MethodError(f"attn_res_ln_norm needs the residual sum after the attention output projection of block "
                      f"{index} ('{info.name if hasattr(info, 'name') else index}'), and the graph has none right "
                      "after it (an op other than a per-channel scale in between). Methods that apply: "
                      "attention_norm, raw_attention, rollout, transformer_attribution")


def residual_norm_map(trace, b, env: dict) -> torch.Tensor:
    """Kobayashi et al. 2021, Eq. 6–9: N[i, j] = ‖g_{z_i}(Σ_h α^h_ij f^h(x_j) + δ_ij r_j)‖ (post-norm:
    the LayerNorm after the residual sum; pre-norm: no g), [batch, N, N] in float64."""
    f = value_transforms(b).double()  # first: a missing W_O or V is said as such
    add, other, ln, scales = _after_projection(trace.session, b.index)
    for factor in scales:  # LayerScale γ_ls ⊙ (attention output): a per-channel factor of every f^h(x_j)
        gamma_ls = env[factor].detach().double()
        if gamma_ls.dim() > 1 or gamma_ls.numel() not in (1, f.shape[-1]):
            raise MethodError(f"attn_res_ln_norm: block {b.index} scales its attention output by a tensor of shape "
                              f"{tuple(gamma_ls.shape)}, not one factor per channel")
        f = f * gamma_ls
    a = b.attention.double()
    r = env[other].detach().double()
    batch, heads, n, c = f.shape
    if tuple(r.shape) != (batch, n, c):
        raise MethodError(f"attn_res_ln_norm: the residual of block {b.index} has shape {tuple(r.shape)}, "
                          f"not [batch, tokens, hidden] = {(batch, n, c)}")
    scale: Optional[torch.Tensor] = None
    if ln is not None:
        z = env[add].detach().double()
        eps = float(ln.args[4]) if len(ln.args) > 4 else 1e-5
        gamma = env[ln.args[2]].detach().double() if len(ln.args) > 2 and ln.args[2] is not None \
            else torch.ones(c, dtype=torch.float64, device=z.device)
        scale = gamma / torch.sqrt(z.var(-1, unbiased=False, keepdim=True) + eps)  # [B, N, C]
    out = torch.empty(batch, n, n, dtype=torch.float64, device=f.device)
    step = _rows(n, batch, c)
    idx = torch.arange(n, device=f.device)
    for i0 in range(0, n, step):
        rows = idx[i0:i0 + step]
        mixed = torch.einsum("bhij,bhjc->bijc", a[:, :, i0:i0 + step], f)  # [B, rows, N, C]
        mixed[:, torch.arange(len(rows)), rows] += r[:, rows]
        if scale is not None:
            mixed = (mixed - mixed.mean(-1, keepdim=True)) * scale[:, i0:i0 + step, None, :]
        out[:, i0:i0 + step] = torch.linalg.vector_norm(mixed, dim=-1)
    return out


@method("attn_res_ln_norm",
        description="norm of each token's share of attention + residual (+ LayerNorm in post-norm blocks), "
                    "rows normalized, rolled out over the blocks (class-agnostic)",
        class_specific=False, signed=False,
        reference="Kobayashi et al., 'Incorporating Residual and Normalization Layers into Analysis of Masked "
                  "Language Models' (EMNLP 2021), Eq. 6-9; survey §1.5",
        needs_relevance=False, head_fusions=("combined",),
        no_windows="it needs the value vectors of every token, which window attention computes per window")
def attn_res_ln_norm(trace, head_fusion: str = "combined", positive: bool = False, discard_ratio: float = 0.0,
                     start_block: int = 0, end_block: Optional[int] = None, layers: str = "rollout", last_k: int = 1,
                     normalize_rows: bool = True, query: str = "cls"):
    """Kobayashi et al. 2021 ("ATTN-RES-LN", Eq. 6–9, see the module docstring): per block
    N_b[i, j] = ‖g_{z_i}(Σ_h α^h_ij f^h(x_j) + δ_ij r_j)‖ (post-norm; pre-norm blocks without g).
    With ``layers="rollout"`` (default) each N_b is divided by its row sums (the paper's mixing
    ratios) and the blocks are multiplied without an identity, the residual being inside N_b:
    C = N̂_{B-1} · … · N̂_0; scores = the query row of C. Class-agnostic, ≥ 0.

    Options: the aggregation of :mod:`relprop.methods.aggregation` (survey §1.4) with
    ``head_fusion="combined"`` only (the residual belongs to no head); ``normalize_rows`` divides
    each N_b by its row sums before the rollout (default on).
    """
    if head_fusion != "combined":
        raise OptionError(f"attn_res_ln_norm: head_fusion={head_fusion!r} is not a choice. Choices: ['combined'] "
                          "(the residual and the LayerNorm belong to no head)")
    if trace.session is None:
        raise MethodError("attn_res_ln_norm re-reads the forward values of the captured graph, and this trace has "
                          "no session (fast path); call explain() with fast_path=False")
    agg = Aggregation("mean", positive, discard_ratio, start_block, end_block, layers, last_k, normalize_rows)
    dtype = trace.blocks[0].attention.dtype if trace.blocks else None

    def block_maps(chosen):
        env = trace.session.base_env()
        return [residual_norm_map(trace, b, env) for b in chosen]
    return aggregate(trace, "attn_res_ln_norm", agg, None, add_identity=False, query=query, block_maps=block_maps,
                     dtype=dtype)
