"""The paper's method: Transformer Attribution (Chefer, Gur & Wolf, CVPR 2021, Eq. 13–14)."""
from __future__ import annotations

from typing import Optional

from ..errors import MethodError
from .aggregation import Aggregation, aggregate
from .bimodal import check_normalize_self, is_two_stream, two_stream_result
from .identity import DEFAULT_IDENTITY
from .method_registry import method

def _ta_maps(b):
    """Eq. 13's per-head map ∇A ⊙ R_A of a block record (the folded path folds the same maps)."""
    return b.gradient * b.relevance


@method("transformer_attribution",
        description="relevance x gradient of each attention map, positive part, averaged over heads, "
                    "rolled out over the blocks",
        class_specific=True, signed=False, reference="Chefer et al., CVPR 2021, Eq. 13-14",
        needs_relevance=True, folds=_ta_maps, streams=2, rollout=True)
def transformer_attribution(trace, start_block: int = 0, normalize_rows: bool = False, query: str = "cls",
                            end_block: Optional[int] = None, head_fusion: str = "mean", positive: bool = True,
                            discard_ratio: float = 0.0, layers: str = "rollout", last_k: int = 1,
                            normalize_self: bool = True, identity: str = DEFAULT_IDENTITY):
    """Ā_b = I + E_h[(∇A_b ⊙ R_A,b)⁺] (Eq. 13); C = Ā_1 · … · Ā_B (Eq. 14, blocks numbered from the
    output); scores = the classification token's row of C.

    Parameters
    ----------
    start_block : first block (counted from the input, 0-based; negative: from the output)
        included in the product. The paper's Eq. 14 and its ViT code use every block (0). The
        authors' BERT code starts at the last block (``start_layer=11`` for BERT-base), which is
        what their text benchmark used.
    normalize_rows : divide each I + Ā_b by its row sums (the authors' BERT code); off by default,
        as in their ViT code and the paper's text.
    query : ``"cls"`` (the paper: the classification token's row) or ``"mean"`` (the mean of the
        rows of the real, non-padding tokens: the row of a mean-pooled output, for models that
        classify from mean pooling, such as sentence-transformers, where the CLS row is unused).
    identity : what the scores keep of each query row's identity share (the I of each block's
        I + Ā_b): ``"exclude"`` (default) leaves it out, as Eq. 14's map leaves out [CLS] (the same
        scores on a [CLS] model); ``"keep"`` reads q · C as printed; ``"exclude_self"`` also leaves out
        the paths back to the query row itself (:mod:`relprop.methods.identity`; on mean-pooled
        models the identity share is the same for every token and, kept, paints them all alike).
    end_block, head_fusion, positive, discard_ratio, layers, last_k : the aggregation
        hyperparameters of :mod:`relprop.methods.aggregation` (survey §1.4); the defaults (every
        block, E_h, positive part, nothing discarded, rollout) are Eq. 13–14.

    On a model with two token streams (encoder–decoder, co-attention) the maps E_h[(∇A ⊙ R_A)⁺]
    are aggregated by the bi-modal rules of Chefer, Gur & Wolf (ICCV 2021, Eq. 6–11; the paper's
    LRP-weighted variant, :mod:`relprop.methods.bimodal`); the result has one score row per stream
    (``exp.streams``), and every option keeps its default there but ``normalize_self``:
    ``normalize_self=False`` (two streams only) leaves out the normalization of the self relevancy
    maps before a cross-attention update (ICCV 2021, Eq. 8–9), the paper's ablation.

    This function computes C itself from every block's records (the full-matrix path, the default
    ``explain(..., keep_blocks=True)``); with ``keep_blocks=False`` :func:`relprop.explain` folds
    the query row q · Ā_1 · … · Ā_B (output block first) during the reverse walk instead, Eq. 14
    associated from the query (:mod:`relprop.methods.fold_maps`): the same scores to float32
    rounding, without C or the records (memory flat in the number of blocks, one block's
    tokens² maps at a time).
    """
    check_normalize_self(trace, "transformer_attribution", normalize_self)
    if trace.blocks and is_two_stream(trace):  # encoder-decoder, co-attention: the ICCV 2021 rules with R_A
        given = {"start_block": (start_block, 0), "normalize_rows": (normalize_rows, False), "query": (query, "cls"),
                 "end_block": (end_block, None), "head_fusion": (head_fusion, "mean"), "positive": (positive, True),
                 "discard_ratio": (discard_ratio, 0.0), "layers": (layers, "rollout"), "last_k": (last_k, 1),
                 "identity": (identity, DEFAULT_IDENTITY)}
        for option, (value, default) in given.items():
            if value != default:
                raise MethodError(f"transformer_attribution on a model with two token streams follows the bi-modal "
                                  f"rules of Chefer et al. (ICCV 2021), which have no {option}={value!r}; leave "
                                  f"{option} at {default!r}")
        return two_stream_result(trace, "relevance", normalize_self)
    agg = Aggregation(head_fusion, positive, discard_ratio, start_block, end_block, layers, last_k, normalize_rows,
                      identity)
    return aggregate(trace, "transformer_attribution", agg, _ta_maps, query=query)
