"""An :class:`Explanation` from a method's output and the trace it read: token scores placed on the
patch grid and upsampled for images, padding and special tokens masked for text."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ..errors import MethodError, RelpropError, warn
from ..graph.host_reads import later, refuse_if
from ..methods.layout import positions as token_positions
from ..rules.stabilize import promote
from . import flatness, relevance_checks
from .result import Explanation
from .special_tokens import special_positions


def build(info, preset: Optional[str], result: dict, trace, special_tokens_mask=None, mask_source: str = "",
          ) -> Explanation:
    """The Explanation of method ``info`` (a :class:`relprop.methods.MethodInfo`) whose output is
    ``result`` on ``trace``; ``preset`` is the preset its relevance came from; text positions in
    ``special_tokens_mask`` (which came from ``mask_source``) are left out of the scores."""
    notes = list(trace.notes)
    session = trace.session
    kwargs, captured, model = session.kwargs, session.captured, session.model
    tokens = result.get("tokens")
    if tokens is not None and getattr(trace, "stages", None) is not None:  # Swin: a stage's tokens → patch grid
        tokens = trace.stages.lift(tokens)
    pixels = result.get("pixels")
    mask = None
    scores = tokens
    smap = None
    prefix = 0
    if trace.modality == "vision" and trace.grid is not None:
        gh, gw = trace.grid
        image = kwargs[captured.primary]
        if pixels is not None:
            smap = promote(pixels)
            scores = patch_sums(smap, gh, gw)
            if tokens is not None:
                prefix = tokens.shape[-1] - gh * gw
            mask = torch.ones_like(scores, dtype=torch.bool)
        else:
            scores, mask, prefix = on_grid(tokens, trace, info.name)
            smap = F.interpolate(promote(scores.reshape(-1, 1, gh, gw)), size=tuple(image.shape[-2:]),
                                 mode="bilinear", align_corners=False)[:, 0]
    elif trace.modality == "text":
        ids = kwargs.get(captured.primary)
        if torch.is_tensor(scores) and torch.is_tensor(ids) and ids.dim() == 2 and scores.shape[-1] != ids.shape[-1]:
            raise MethodError(f"method '{info.name}' gives scores over {scores.shape[-1]} tokens, and the explained "
                              f"input '{captured.primary}' has {ids.shape[-1]} positions: the attention blocks it "
                              "reads work on other tokens (latents, pooled or merged tokens), which it does not map "
                              "back to the input")
        special, why = special_positions(model, kwargs, captured.primary, tuple(scores.shape), scores.device,
                                         special_tokens_mask, mask_source)
        notes.append(why)
        mask = ~special
        scores = torch.where(mask, scores, torch.zeros((), dtype=scores.dtype, device=scores.device))
        _warn_if_nothing_shown(info.name, mask, notes)
    elif trace.modality == "embeddings":
        notes.extend(_positions_note(info.name, scores, kwargs.get(captured.primary), captured.analysis))
    flatness.check(info.name, scores, mask, result.get("flat_cause"), notes)
    if info.needs_relevance and not info.needs_blocks:  # a map of the input relevance: is it to be trusted?
        relevance_checks.check(info.name, preset, trace, trace.input_relevance, notes)
    heads = _heads_on_positions(result.get("heads"), trace, info.name, mask, pixels is not None)
    return Explanation(method=info.name, scores=scores, map=smap, mask=mask, matrix=result.get("matrix"),
                       query=result.get("query"), heads=heads,
                       blocks=trace.blocks, target=trace.target, target_scores=trace.target_scores,
                       conservation=trace.conservation, input_relevance=trace.input_relevance,
                       logits=trace.logits, preset=preset if info.needs_relevance else None,
                       modality=trace.modality, grid=trace.grid, prefix_tokens=prefix, outputs=trace.outputs,
                       signed=info.signed, class_specific=info.class_specific, notes=notes,
                       streams=_streams(result.get("streams"), trace, scores),
                       output_stream=result.get("output_stream"), convergence_delta=result.get("convergence_delta"))


def _warn_if_nothing_shown(method: str, mask: torch.Tensor, notes: list) -> None:
    """A RelpropWarning (read with the call's other checks) for the texts with no token to score: every
    position padding or a special token (an empty string tokenized), whose map is all zeros."""
    if not torch.is_tensor(mask) or mask.dim() != 2:
        return
    empty = mask.sum(1) == 0

    def say(v):
        samples = [b for b, e in enumerate(v) if e]
        if samples:
            message = (f"{method}: text(s) {samples[:8]} have no token to score: every position is padding or a "
                       "special token (an empty string?), so their scores are all 0")
            notes.append(message)
            warn(message)
    later(empty.to(torch.float32), say)


def _positions_note(method: str, scores, x, analysis) -> list:
    """A note when a method's scores are not one per position of a [batch, a, b] floating input (the
    attention blocks' tokens, made from the input by a strided convolution or pooling: Whisper's encoder
    positions from its mel frames)."""
    if not torch.is_tensor(scores) or not torch.is_tensor(x) or x.dim() != 3 or scores.dim() != 2:
        return []
    feature = getattr(analysis, "feature_axis", None)
    feature = feature if feature in (1, 2) else 2
    positions = x.shape[3 - feature]
    if scores.shape[-1] == positions:
        return []
    return [f"{method}: {scores.shape[-1]} scores, one per token of the attention blocks, and the input has "
            f"{positions} positions along axis {3 - feature} (axis {feature} holds its features): layers in front of "
            f"the blocks (a strided convolution, pooling) made the tokens from the positions, so score i is not "
            f"input position i; the input-relevance methods (lrp, input_x_gradient) score the {positions} "
            "positions themselves"]


def _streams(streams, trace, scores):
    """Each stream's scores with its padding positions zeroed (``Trace.stream_masks``); the
    explained input's entry is ``scores`` when that is an image's (per patch of the grid)."""
    if streams is None:
        return None
    out = {}
    for name, s in streams.items():
        if name == trace.streams[0] and trace.modality == "vision" and trace.grid is not None:
            s = scores
        m = trace.stream_masks.get(name)
        if m is not None and s.dim() == 2 and tuple(m.shape) == tuple(s.shape):
            s = torch.where(m.to(s.device), s, torch.zeros((), dtype=s.dtype, device=s.device))
        out[name] = s
    return out


def _heads_on_positions(heads, trace, method: str, mask, pixels: bool):
    """[batch, heads, positions]: each head's query row placed like the scores (images: the patch
    grid, class/distillation tokens left out; text: padding and special tokens set to 0)."""
    if heads is None or pixels:
        return None
    if trace.modality == "vision" and trace.grid is not None:
        return on_grid(heads, trace, method)[0]
    if mask is not None and tuple(mask.shape) == (heads.shape[0], heads.shape[-1]):
        return torch.where(mask[:, None, :], heads, torch.zeros((), dtype=heads.dtype, device=heads.device))
    return heads


def on_grid(tokens: torch.Tensor, trace, method: str):
    """(scores [batch, gh·gw] in row-major patch order, mask [batch, gh·gw] True at patches some
    token holds, number of tokens that hold no patch) from per-token scores of the first block's
    tokens ([batch, tokens], or [batch, heads, tokens] for per-head rows), placed by the traced token
    positions (``trace.token_map``); without them the tokens are the constants first, then the patches
    row-major. Placed on the device: the number of tokens without a patch is a 0-d tensor there (read
    when ``Explanation.prefix_tokens`` is), two tokens of one patch are refused with the call's other
    checks (:func:`relprop.graph.host_reads.refuse_if`)."""
    gh, gw = trace.grid
    cells = gh * gw
    b, n = tokens.shape[0], tokens.shape[-1]
    positions = token_positions(trace, n)
    if positions is None:
        if getattr(trace, "token_map", None) is not None:
            raise MethodError(f"method '{method}' gives scores over {n} tokens, and relprop cannot tell which patch "
                              f"each of them holds (the first attention block of this model has "
                              f"{trace.token_map.shape[1]} tokens, and no block whose tokens relprop traced has {n}): "
                              f"they cannot be placed on the {gh}x{gw} patch grid")
        prefix = n - cells
        if prefix < 0:
            raise MethodError(f"method '{method}' gives scores over {n} tokens, and the image has {gh}x{gw} = {cells} "
                              "patches: the attention blocks it reads work on fewer tokens than the patch grid "
                              "(pooled keys or queries, a downsampled stage, merged tokens), which relprop cannot "
                              "place on the patches")
        return tokens[..., prefix:], torch.ones(b, cells, dtype=torch.bool, device=tokens.device), prefix
    positions = positions.to(tokens.device)
    holds = positions >= 0
    cell = torch.where(holds, positions, cells)  # (a token that holds no patch: a spare cell, dropped)
    count = torch.zeros(b, cells + 1, dtype=torch.long, device=tokens.device)
    count = count.scatter_add_(1, cell, torch.ones_like(cell))[:, :cells]
    lead = tokens.shape[1:-1]
    index = cell.reshape((b,) + (1,) * len(lead) + (n,)).expand(tokens.shape)
    scores = tokens.new_zeros(tokens.shape[:-1] + (cells + 1,)).scatter_add_(-1, index, tokens)[..., :cells]

    def shared(*_):
        return RelpropError(f"two tokens of the first attention block come from the same patch; relprop cannot "
                            f"place the scores of method '{method}' on the {gh}x{gw} patch grid")
    refuse_if((count > 1).any(), shared)
    return scores, count == 1, (~holds).sum(1).amax()


def patch_sums(pixel_map: torch.Tensor, gh: int, gw: int) -> torch.Tensor:
    """Sum a [batch, H, W] map over the cells of a gh x gw patch grid -> [batch, gh*gw]."""
    b, h, w = pixel_map.shape
    if h % gh == 0 and w % gw == 0:
        cells = pixel_map.reshape(b, gh, h // gh, gw, w // gw).sum((2, 4))
    else:
        cells = F.adaptive_avg_pool2d(pixel_map[:, None], (gh, gw))[:, 0] * (h * w / (gh * gw))
    return cells.reshape(b, gh * gw)
