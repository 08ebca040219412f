"""The paper's method: Transformer Attribution (Chefer, Gur & Wolf, CVPR 2021, Eq. 13–14)."""
from __future__ import annotations

from ..errors import MethodError
from .bimodal import is_two_stream, two_stream_result
from .registry import method
from .rollout_utils import chain, head_mean, query_row, rollout_blocks, stage_transitions


@method("transformer_attribution",
        description="relevance x gradient of each attention map, positive part, averaged over heads, "
                    "rolled out over the blocks",
        class_specific=True, signed=False, reference="Chefer et al., CVPR 2021, Eq. 13-14",
        needs_relevance=True)
def transformer_attribution(trace, start_block: int = 0, normalize_rows: bool = False, query: str = "cls"):
    """Ā_b = I + E_h[(∇A_b ⊙ R_A,b)⁺] (Eq. 13); C = Ā_1 · … · Ā_B (Eq. 14, blocks numbered from the
    output); scores = the classification token's row of C.

    Parameters
    ----------
    start_block : first block (counted from the input, 0-based) included in the product. The
        paper's Eq. 14 and its ViT code use every block (0). The authors' BERT code starts at the
        last block (``start_layer=11`` for BERT-base), which is what their text benchmark used.
    normalize_rows : divide each I + Ā_b by its row sums (the authors' BERT code); off by default,
        as in their ViT code and the paper's text.
    query : ``"cls"`` (the paper: the classification token's row) or ``"mean"`` (the mean of the
        rows of the real, non-padding tokens: the row of a mean-pooled output, for models that
        classify from mean pooling, such as sentence-transformers, where the CLS row is unused).

    On a model with two token streams (encoder–decoder, co-attention) the maps E_h[(∇A ⊙ R_A)⁺]
    are aggregated by the bi-modal rules of Chefer, Gur & Wolf (ICCV 2021, Eq. 6–11; the paper's
    LRP-weighted variant, :mod:`relprop.methods.bimodal`); the result has one score row per stream
    (``exp.streams``).
    """
    blocks = trace.blocks
    if not blocks:
        raise MethodError("transformer_attribution needs attention blocks, and none were found in the graph")
    if not 0 <= start_block < len(blocks):
        raise MethodError(f"start_block={start_block} out of range: the model has blocks 0..{len(blocks) - 1}")
    if is_two_stream(trace):  # encoder-decoder, co-attention: the ICCV 2021 rules with R_A (Eq. 6-11)
        for option, value, default in (("start_block", start_block, 0), ("normalize_rows", normalize_rows, False),
                                       ("query", query, "cls")):
            if value != default:
                raise MethodError(f"transformer_attribution on a model with two token streams follows the bi-modal "
                                  f"rules of Chefer et al. (ICCV 2021), which have no {option}={value!r}; leave "
                                  f"{option} at {default!r}")
        return two_stream_result(trace, "relevance")
    maps = [head_mean((b.gradient * b.relevance).clamp(min=0))
            for b in rollout_blocks(trace, "transformer_attribution", start_block)]
    joint = chain(maps, normalize_rows=normalize_rows, transitions=stage_transitions(trace, start_block))
    row, w = query_row(trace, joint, query)
    return {"tokens": row, "matrix": joint, "query": w}
