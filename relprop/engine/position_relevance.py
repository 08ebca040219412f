"""PA-LRP's reassignment of position relevance to tokens, for the walk (:mod:`relprop.engine.walk`).

Under a positional preset (``"pa_lrp"``, :mod:`relprop.rules.pa_lrp`) the share a rule gives a
position encoding (a learned position embedding added to the tokens, RoPE's cos/sin factors) is
not absorbed: :class:`PositionRelevance` keeps it per sample and token (summed over the feature
axes, the heads and the layers: Bakish et al., NeurIPS 2025), and :meth:`PositionRelevance.add_to`
adds it to the input relevance at the token's place (a text token; on images, the token's patch,
spread evenly over its pixels and channels).
"""
from __future__ import annotations

from typing import List, Optional

import torch

from ..errors import PositionPathError
from ..rules.pa_lrp import learned_position_name, position_kind
from ..rules.stabilize import promote

#: the label under which the ledger books the reassigned relevance before it is moved to the input
LABEL = "position encodings, reassigned to their tokens (PA-LRP)"


class PositionRelevance:
    """The position relevance of one walk, per sample and token position.

    Parameters
    ----------
    placeholders : the captured graph's placeholder nodes -> ``(kind, target name)``.
    batch : the batch size.
    """

    def __init__(self, placeholders, batch: int):
        self.placeholders = placeholders
        self.batch = batch
        self.per_token: Optional[torch.Tensor] = None  # [batch, tokens]
        self.kinds: List[str] = []
        self.sources: List[str] = []  # the learned position embeddings' parameter names

    def take(self, arg, consumer, share: torch.Tensor, batch_axis: Optional[int]) -> bool:
        """Keep ``share``, the relevance a rule of ``consumer`` gives its constant operand ``arg``, when
        ``arg`` is a position encoding; returns whether it was kept (else the caller absorbs it)."""
        kind = position_kind(arg, consumer, self.placeholders)
        if kind is None or share.dim() < 3:
            return False
        b = 0 if batch_axis is None else batch_axis % share.dim()
        tok = share.dim() - 2  # [..., tokens, features]: RoPE's [B, H, S, d], embeddings' [B, T, D]
        if b == tok or share.shape[b] % self.batch:
            return False
        r = promote(share).movedim((b, tok), (0, 1))
        r = r.reshape(self.batch, share.shape[b] // self.batch, r.shape[1], -1).sum((1, 3))
        if self.per_token is not None and self.per_token.shape != r.shape:
            raise PositionPathError(
                f"PA-LRP found position encodings over {self.per_token.shape[1]} and {r.shape[1]} token positions "
                f"(at '{consumer.name}'); relprop maps one sequence of positions onto the tokens. Use "
                "preset='attnlrp' for this model.")
        source = learned_position_name(arg, self.placeholders) if kind == "learned" else None
        if source is not None and source not in self.sources:
            self.sources.append(source)
        if len(self.sources) > 1 or len(set(self.kinds) | {kind}) > 1:
            # two towers (CLIP, a vision-language model) or two schemes: their positions are different
            # token sequences, and adding them up position by position would be a silent wrong map
            what = self.sources if len(self.sources) > 1 else sorted(set(self.kinds) | {kind})
            raise PositionPathError(
                f"PA-LRP found more than one position encoding on the relevance path ({', '.join(what)}, at "
                f"'{consumer.name}'); relprop maps one sequence of positions onto the tokens. Use "
                "preset='attnlrp' for this model.")
        self.per_token = r if self.per_token is None else self.per_token + r
        if kind not in self.kinds:
            self.kinds.append(kind)
        return True

    def add_to(self, input_rel: torch.Tensor, modality: str, grid) -> torch.Tensor:
        """``input_rel`` (per token for text, [batch, tokens]; per pixel for images, [batch, C, H, W])
        with the position relevance added at each token's place. Raises :class:`PositionPathError`
        when no position encoding was found or its positions do not map onto the input's tokens."""
        if self.per_token is None:
            raise PositionPathError(
                "preset 'pa_lrp' found no position encoding on the relevance path (neither a learned position "
                "embedding added to the tokens nor rotary cos/sin factors): its explanation would equal AttnLRP's. "
                "Use preset='attnlrp' for this model.")
        pos = self.per_token.to(input_rel.dtype)
        if modality != "vision":
            if input_rel.dim() != 2 or pos.shape[1] != input_rel.shape[1]:
                raise PositionPathError(
                    f"PA-LRP found position encodings for {pos.shape[1]} positions but the input relevance has shape "
                    f"{tuple(input_rel.shape)}; relprop cannot say which token each position is. Use "
                    "preset='attnlrp' for this model.")
            return input_rel + pos
        if grid is None or input_rel.dim() != 4 or pos.shape[1] < grid[0] * grid[1] \
                or input_rel.shape[2] % grid[0] or input_rel.shape[3] % grid[1]:
            raise PositionPathError(
                f"PA-LRP found position embeddings for {pos.shape[1]} tokens but cannot map them onto the patch grid "
                f"{grid} of an input of shape {tuple(input_rel.shape)}. Use preset='attnlrp' for this model.")
        gh, gw = grid
        ph, pw = input_rel.shape[2] // gh, input_rel.shape[3] // gw
        patches = pos[:, pos.shape[1] - gh * gw:].reshape(-1, 1, gh, gw)  # prefix tokens (class, ...) first
        spread = patches.repeat_interleave(ph, 2).repeat_interleave(pw, 3) / (input_rel.shape[1] * ph * pw)
        return input_rel + spread

    def prefix_share(self, grid) -> Optional[torch.Tensor]:
        """Per sample, the position relevance of the prefix tokens (class, distillation token) of an
        image model, which has no pixels to go to (it stays absorbed)."""
        if self.per_token is None or grid is None:
            return None
        return self.per_token[:, : self.per_token.shape[1] - grid[0] * grid[1]].sum(1)
