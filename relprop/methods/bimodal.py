"""Relevancy maps of two-stream models: Chefer, Gur & Wolf, ICCV 2021 ("Generic Attention-model
Explainability for Interpreting Bi-Modal and Encoder-Decoder Transformers", §3).

For streams s and q (the source and the target of a translation, the words and the regions of
LXMERT) the method keeps one relevancy map per ordered pair: R^{ss}, R^{qq} start as the identity
(each token is its own context), R^{sq}, R^{qs} as zero (Eq. 1–2). Each attention block, from the
input to the output, adds to the maps of its query stream, with Ā = E_h[(∇A ⊙ A)⁺] (Eq. 5; with
``"relevance"`` weights, as in the paper's LRP variant, Ā = E_h[(∇A ⊙ R_A)⁺]):

* self-attention within s:  R^{ss} += Ā·R^{ss} and R^{sq} += Ā·R^{sq}                (Eq. 6–7)
* cross-attention, queries s and keys q:
  R^{sq} += (R̄^{ss})ᵀ·Ā·R̄^{qq}  and  R^{ss} += Ā·R^{qs}                             (Eq. 10–11)

where R̄^{xx} is the self map normalized as in Eq. 8–9: R̂ = R^{xx} − I, each row of R̂ divided by
its sum (a row that sums to zero stays zero), plus I. Blocks that read the same state (the two
co-attention blocks of an LXMERT layer, :attr:`relprop.engine.trace.BlockRecord.wave`) add their
updates together. The explanation of the output reads the row(s) of the output stream's tokens
that the target reads (the *query*): its R^{os} row for every stream s.
"""
from __future__ import annotations

from typing import Dict, List, Tuple

import torch

from ..errors import MethodError
from .rollout_utils import head_mean

Pair = Tuple[str, str]


def is_two_stream(trace) -> bool:
    """Whether the trace is of a model with two token streams connected by attention."""
    return len(getattr(trace, "streams", None) or []) > 1


def check_normalize_self(trace, method: str, normalize_self: bool) -> None:
    """``normalize_self=False`` (the ICCV 2021 ablation without Eq. 8–9) is asked for on a model
    with two token streams only: a MethodError otherwise (one stream has no cross-attention update
    whose self maps it would normalize)."""
    if normalize_self is not True and not is_two_stream(trace):
        raise MethodError(f"{method}: normalize_self={normalize_self!r} applies to models with two token streams "
                          "(encoder-decoder, co-attention: the normalization of the self relevancy maps before a "
                          "cross-attention update, ICCV 2021 Eq. 8-9); this model has one stream. Leave "
                          "normalize_self at True")


def normalized_self(r: torch.Tensor) -> torch.Tensor:
    """R̄ = rownorm(R − I) + I for a [batch, n, n] self relevancy map (ICCV 2021, Eq. 8–9); rows of
    R − I that sum to zero stay zero."""
    eye = torch.eye(r.shape[-1], dtype=r.dtype, device=r.device)
    hat = r - eye
    total = hat.sum(-1, keepdim=True)
    hat = torch.where(total != 0, hat / torch.where(total != 0, total, torch.ones_like(total)), torch.zeros_like(hat))
    return hat + eye


def relevancy_maps(trace, weights: str = "gradient", normalize: bool = True) -> Dict[Pair, torch.Tensor]:
    """(stream x, stream y) -> R^{xy} [batch, tokens of x, tokens of y] after every block (ICCV 2021,
    Eq. 1–11; see the module docstring). ``weights``: ``"gradient"`` Ā = E_h[(∇A ⊙ A)⁺] (Eq. 5),
    ``"relevance"`` Ā = E_h[(∇A ⊙ R_A)⁺]. ``normalize=False`` skips Eq. 8–9 (the paper's ablation)."""
    blocks = trace.blocks
    if any(b.query_stream is None or b.key_stream is None for b in blocks):
        bad = next(b for b in blocks if b.query_stream is None or b.key_stream is None)
        raise MethodError(f"block {bad.index} ('{bad.name}') reads tokens that relprop could not assign to one of "
                          f"the streams {trace.streams}; the two-stream relevancy rules need every block's queries "
                          "and keys in one stream each")
    sizes = {}
    for b in blocks:
        sizes.setdefault(b.query_stream, b.attention.shape[-2])
        sizes.setdefault(b.key_stream, b.attention.shape[-1])
    batch, dev = trace.batch_size, blocks[0].attention.device
    dtype = torch.float64 if blocks[0].attention.dtype == torch.float64 else torch.float32
    R: Dict[Pair, torch.Tensor] = {}
    for x in sizes:
        for y in sizes:
            if x == y:
                R[(x, y)] = torch.eye(sizes[x], dtype=dtype, device=dev).expand(batch, -1, -1).clone()
            else:
                R[(x, y)] = torch.zeros(batch, sizes[x], sizes[y], dtype=dtype, device=dev)
    waves: Dict[int, List] = {}
    for b in blocks:
        waves.setdefault(b.wave if b.wave is not None else b.index, []).append(b)
    for wave in waves.values():
        adds = []
        for b in wave:
            other = b.relevance if weights == "relevance" else b.attention
            if other is None:
                raise MethodError("the relevance-weighted two-stream rules need R_A of every block, which this "
                                  "trace lacks")
            a_bar = head_mean((b.gradient * other).clamp(min=0)).to(dtype)
            s, q = b.query_stream, b.key_stream
            if s == q:  # Eq. 6-7
                adds += [((s, y), a_bar @ R[(s, y)]) for y in sizes]
            else:  # Eq. 10-11
                r_ss = normalized_self(R[(s, s)]) if normalize else R[(s, s)]
                r_qq = normalized_self(R[(q, q)]) if normalize else R[(q, q)]
                adds.append(((s, q), r_ss.transpose(-1, -2) @ a_bar @ r_qq))
                adds.append(((s, s), a_bar @ R[(q, s)]))
        for key, add in adds:
            R[key] = R[key] + add
    return R


def output_stream(trace) -> str:
    """The stream the target reads: the query stream of the last block whose attention gradient
    is not zero (the decoder of an encoder–decoder; LXMERT's language stream for its QA head)."""
    for b in reversed(trace.blocks):
        if bool((b.gradient != 0).any()):
            return b.query_stream
    return trace.blocks[-1].query_stream


def stream_query(trace, stream: str) -> torch.Tensor:
    """[batch, tokens of ``stream``]: the weights of the rows the target reads — the rows of the
    stream's last block with a non-zero gradient, their mean, or for a causal stream (no real query
    attends to a later position) the last of them; row 0 when none."""
    last = next(b for b in reversed(trace.blocks) if b.query_stream == stream)
    g = last.gradient != 0
    read = (g.any(1) if g.dim() == 4 else g).any(-1)  # [B, n]
    n = read.shape[-1]
    selfs = [b for b in trace.blocks if b.query_stream == stream and b.key_stream == stream]
    upper = torch.ones(n, n, dtype=torch.bool, device=read.device).triu(1)
    causal = bool(selfs) and all(not bool(((b.attention != 0) & upper).any()) for b in selfs)
    w = torch.zeros(read.shape, dtype=torch.float32, device=read.device)
    idx = torch.arange(n, device=read.device)
    for i in range(read.shape[0]):
        if not bool(read[i].any()):
            w[i, 0] = 1.0
        elif causal:
            w[i, int(torch.where(read[i], idx, -1).max())] = 1.0
        else:
            w[i] = read[i].float() / read[i].sum()
    return w


def two_stream_result(trace, weights: str = "gradient", normalize: bool = True) -> dict:
    """The method output for a two-stream model: ``streams`` = stream -> [batch, tokens] scores
    (the query's row of R^{o,stream}, o the output stream), ``tokens`` = the explained input's,
    ``matrix`` = R^{o, explained input} (rows: the output stream's tokens), ``query`` = the weights
    of the query rows."""
    R = relevancy_maps(trace, weights, normalize)
    out = output_stream(trace)
    w = stream_query(trace, out)
    scores = {y: (w.to(R[(out, y)].dtype)[:, :, None] * R[(out, y)]).sum(1) for y in trace.streams
              if (out, y) in R}
    primary = trace.streams[0]
    if primary not in scores:
        raise MethodError(f"no attention block reads the tokens of '{primary}'")
    return {"tokens": scores[primary], "streams": scores, "matrix": R[(out, primary)], "query": w,
            "output_stream": out}
