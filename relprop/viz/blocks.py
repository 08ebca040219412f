"""Per-block heatmap of a text's relevance (AttCAT, NeurIPS 2022, Fig. 4): blocks × tokens.

Row b is what the hidden states entering block b contribute to the explained score, per token:
``exp.blocks[b].hidden_relevance`` summed over the hidden size when the method ran the relevance walk
(the LRP relevance R_h of the tokens at that depth), else ``hidden * hidden_gradient`` summed over the
hidden size (AttCAT's class activation tokens, CAT = ∇h ⊙ h). Both are signed: relprop's diverging map
(:mod:`relprop.viz.colours`) shows them, red for support, blue against, white for 0.

For the rollout-style methods (Transformer Attribution, rollout, gradient rollout, the ablations) the
per-block term is a token-to-token map, Ā_b = E_h[(maps_b)⁺] (CVPR 2021 Eq. 13 for Transformer
Attribution, maps_b = ∇A_b ⊙ R_A,b), which Eq. 14 multiplies over the blocks. Source ``"block_maps"``
shows row b as the query's row of Ā_b (``exp.query · Ā_b``): where each block's own attention term sends
the query, before the product. Non-negative by construction.
"""
from __future__ import annotations

import textwrap
from typing import TYPE_CHECKING, Optional, Sequence, Tuple

if TYPE_CHECKING:  # numpy is imported where it is used: an optional dependency (relprop[viz])
    import numpy as np

from ..errors import InputError
from ..methods.method_registry import all_methods, get_method
from . import colours
from .image import _new_figure, _ticks, clip_limits
from .names import target_name
from .text import _is_padding, tokens_of

SOURCES = ("auto", "relevance", "gradient_x_hidden", "block_maps")


#: the per-block quantity that a method's scores are made of, where it is a score per token: LRP's input
#: relevance is the relevance R_h walked through every block; CAT and AttCAT sum ∇h ⊙ h over the blocks
METHOD_SOURCE = {"lrp": "relevance", "cat": "gradient_x_hidden", "attcat": "gradient_x_hidden"}


def method_source(name: str) -> Optional[str]:
    """The source of :func:`block_scores` that shows what method ``name`` aggregates per block, or None:
    :data:`METHOD_SOURCE`, and ``"block_maps"`` for a rollout-style method that declares its per-head maps
    (``@method(..., folds=...)``)."""
    if name in METHOD_SOURCE:
        return METHOD_SOURCE[name]
    info = all_methods().get(name)
    return "block_maps" if info is not None and info.rollout and info.folds is not None else None


def block_scores(exp, index: int = 0, source: str = "auto") -> Tuple[np.ndarray, str]:
    """``([blocks, positions] array, source used)`` for sample ``index``.

    ``source``: ``"relevance"`` (R_h summed over the hidden size), ``"gradient_x_hidden"`` (∇h ⊙ h
    summed over the hidden size), ``"block_maps"`` (the query's row of each block's fused map Ā_b, for a
    rollout-style method) or ``"auto"`` (relevance when recorded, else gradient × hidden).
    """
    import numpy as np
    if source not in SOURCES:
        raise InputError(f"source={source!r} is not a choice. Choices: {list(SOURCES)}")
    if not exp.blocks:
        raise InputError(f"explanation '{exp.method}' has no attention blocks to show: it kept no block records (the "
                         "AttnLRP/CP-LRP fast path keeps none); explain(..., fast_path=False) (CLI: --option "
                         "fast_path=false) walks the rules and keeps them")
    use = source
    if source == "auto":
        use = "relevance" if all(b.hidden_relevance is not None for b in exp.blocks) else "gradient_x_hidden"
    if use == "block_maps":
        return _block_map_rows(exp, index), use
    rows = []
    for b in exp.blocks:
        if use == "relevance":
            if b.hidden_relevance is None:
                raise InputError(f"block {b.index} has no relevance recorded by method '{exp.method}' "
                                 "(a gradient-only method): use source='gradient_x_hidden'")
            r = b.hidden_relevance[index]
        else:
            if b.hidden is None or b.hidden_gradient is None:
                raise InputError(f"block {b.index} recorded no hidden states")
            r = b.hidden[index] * b.hidden_gradient[index]
        rows.append(r.detach().float().sum(-1).cpu().numpy())
    return np.stack(rows), use


def blocks_figure(exp, tokens: Sequence[str], index: int = 0, *, source: str = "auto",
                  labels=None, title: Optional[str] = None, fig=None):
    """Heatmap of ``block_scores``: one row per block (the input-side block at the top, as AttCAT's
    Fig. 4 reads from the first layer down), one column per token (padding left out; special tokens
    kept, greyed). ``tokens``: the sample's token strings. Returns a ``matplotlib.figure.Figure``."""
    from matplotlib import colors
    values, used = block_scores(exp, index, source)
    toks = tokens_of(exp, index, tokens, merge_words=False)
    keep = _kept_positions(exp, index, tokens)
    values = values[:, keep]
    nb, nt = values.shape
    fig = _new_figure((max(4.5, 0.42 * nt + 2.2), max(2.4, 0.36 * nb + 1.6)), fig)
    ax = fig.subplots(1, 1)
    real = [j for j, t in enumerate(toks) if not t.special]
    vmin, vmax = clip_limits(values[:, real] if real else values, True, 100.0)
    im = ax.imshow(values, cmap=colours.colormap(colours.DIVERGING), norm=colors.Normalize(vmin, vmax), aspect="auto",
                   interpolation="nearest")
    ax.set_xticks(range(nt))
    ax.set_xticklabels([t.text for t in toks], rotation=60, ha="right", fontsize=8)
    for lab, t in zip(ax.get_xticklabels(), toks):
        if t.special:
            lab.set_color("#999999")
    ax.set_yticks(range(nb))
    ax.set_yticklabels([f"block {b.index}" for b in exp.blocks], fontsize=8)
    ax.set_ylabel("input side → output side", fontsize=8)
    head = title
    if head is None:
        cls = "" if exp.target is None else f" for {target_name(exp, index, labels)}"
        preset = f", preset {exp.preset}" if used != "gradient_x_hidden" and getattr(exp, "preset", None) else ""
        if used == "block_maps":
            head = (f"the query's row of each block's own map Ā_b = E_h[(maps_b)⁺]{cls}, before the rollout "
                    f"multiplies them ({exp.method}{preset})")
        else:
            what = "relevance R_h" if used == "relevance" else "∇h ⊙ h (CAT)"
            head = f"{what} entering each block, summed over the hidden size{cls} ({exp.method}{preset})"
    width_in = fig.get_size_inches()[0]
    ax.set_title(textwrap.fill(head, width=max(30, int(width_in * 12))), fontsize=9)  # wrapped, never clipped
    cb = fig.colorbar(im, ax=ax, fraction=0.04, pad=0.02)
    cb.set_ticks([vmin, 0.0, vmax])
    cb.set_ticklabels(_ticks([vmin, 0.0, vmax]))
    cb.ax.tick_params(labelsize=7)
    fig.tight_layout()
    return fig


def _block_map_rows(exp, index: int):
    """[blocks, tokens]: ``exp.query[index] · Ā_b`` per block, Ā_b = E_h[(maps_b)⁺] from the method's own
    per-head maps (its ``folds``), as Eq. 13 of CVPR 2021 fuses them by default."""
    import numpy as np
    name = method_source(exp.method)
    if name != "block_maps":
        raise InputError(f"method '{exp.method}' is not a rollout-style method with per-block maps: "
                         "source='block_maps' shows Transformer Attribution, rollout, gradient rollout and "
                         "their ablations")
    head_maps = get_method(exp.method).folds
    q = exp.query
    if q is None:
        raise InputError(f"explanation '{exp.method}' has no query row to read the block maps with")
    rows = []
    for b in exp.blocks:
        a = b.attention
        two_streams = b.query_stream is not None and b.query_stream != b.key_stream
        if a.dim() != 4 or a.shape[-1] != a.shape[-2] or a.shape[-1] != q.shape[-1] or two_streams:
            raise InputError(f"block {b.index}'s maps are not [heads, tokens, tokens] over the query's {q.shape[-1]} "
                             "tokens (windows, merged tokens or two streams): no per-block row to show")
        fused = head_maps(b)[index].float().clamp(min=0).mean(0)  # [tokens, tokens]
        rows.append((q[index].float() @ fused).detach().cpu().numpy())
    return np.stack(rows)


def _kept_positions(exp, index: int, tokens: Sequence[str]):
    mask = exp.mask[index].tolist() if exp.mask is not None else [True] * len(tokens)
    return [j for j, (t, m) in enumerate(zip(tokens, mask)) if m or not _is_padding(str(t))]
