"""What a rule sees of the node it explains: :class:`RuleContext`."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, List, Optional, Sequence, Union

import torch
import torch.fx

from ..errors import RelpropError
from ..graph.nodes import module_path
from .rule_registry import Preset, lookup


#: the keyword of ``@rule`` (and field of :class:`relprop.rules.spec.RuleSpec`) by which a rule
#: declares that it may write into its node's output (:attr:`RuleContext.out_writable`)
WRITES_OUT = "writes_out"


@dataclasses.dataclass
class RuleContext:
    """Everything a relevance rule may read about one graph node.

    Attributes
    ----------
    node
        the ``torch.fx.Node`` being explained.
    args, kwargs
        the node's arguments with every node replaced by its forward value.
    out
        the node's forward output.
    live
        one entry per positional argument: True if the argument depends on the explained input
        (relevance given to it keeps flowing), False for constants (parameters, buffers, masks,
        Python numbers: relevance given to them is absorbed), a list of those for list arguments.
    batch_dim
        the dimension of ``out`` that indexes samples (None if ``out`` has none).
    batch_size
        number of samples.
    eps
        stabilizer added to denominators (``relprop.rules.stabilize.safe_divide``).
    preset
        the active ``relprop.rules.Preset`` (the walk hands down the request's object; a
        name is accepted too), for ``rule_for``; a rule never chooses its formula by it (each
        preset's table names its own rules).
    options
        what the engine knows of this call beyond the node: ``reads_pixels`` (node name ->
        whether the convolution reads the pixel input, for the z^B rule: True, bounds per sample along
        axis 0; ``"whole"``, bounds over the whole input) and ``weight_cache`` (the
        memo of the weights' |W| under ``explain(..., memory="high")``, else None).
    out_writable
        the engine's word that ``out`` is dead once the rule has run: nothing reads
        it after the rule, autograd saved none of it, and it shares its memory with no other value
        (an argument, a value read after the walk or returned by the program). A rule may then
        compute into its buffer after its last read of it (one attention-sized allocation fewer on
        long inputs). Given only to rules registered with ``writes_out=True``; False otherwise.
    relevant_rows
        at most how many positions (all axes but the last) of the relevance given to the rule are
        not zero, as the walk knows it from the target (the rows the target reads, carried through the
        layers that keep each position's row apart: a linear layer, a norm over the last axis, an
        element-wise op), or None (unknown). A rule that computes on those positions only
        (``relprop.rules.stabilize.on_relevant_rows``) finds them on the device within this bound.
    """

    node: torch.fx.Node
    args: tuple
    kwargs: dict
    out: Any
    live: tuple
    batch_dim: Optional[int]
    batch_size: int
    eps: float = 1e-9
    preset: Union[str, Preset] = "chefer2021"
    options: dict = dataclasses.field(default_factory=dict)
    out_writable: bool = False
    relevant_rows: Optional[int] = None

    @property
    def module_path(self) -> str:
        """Dotted path of the innermost module the node came from ('' at top level)."""
        return module_path(self.node)

    def rule_for(self, op):
        """The rule the active preset applies to ``op`` (e.g. the product with a constant matrix
        applies the preset's rule for ``aten.linear``), or None."""
        return lookup(self.preset, op)

    # -- per-sample statistics ------------------------------------------------------------------
    def sample_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum of ``t`` (shaped like ``out``) over everything but the batch: shape [batch].

        No statistic ever crosses the batch dimension, so that a batch explains exactly like its
        samples one by one. A rule whose shares are not linear in the relevance it is given takes
        such statistics here or through ``share_factors``, so that a walk that sees the tensors
        by parts (``relprop.engine.chunked_walk``) knows it.
        """
        if self.batch_dim is None:
            raise RelpropError(f"node {self.node.name} has no batch dimension; cannot sum per sample")
        t = t.movedim(self.batch_dim, 0)
        # a batch dimension may fold k groups per sample, batch-major (Swin's [batch·windows, ...])
        return t.reshape(self.batch_size, -1).sum(1)

    def per_sample(self, v: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """Reshape a [batch] vector so it broadcasts along ``batch_dim`` of ``like`` (repeated
        k times per sample where that dimension holds k·batch groups, batch-major)."""
        return per_sample(v, like, self.batch_dim)

    def share_factors(self, shares: Sequence[torch.Tensor], relevance: torch.Tensor,
                      factors: Callable[[List[torch.Tensor], torch.Tensor], Sequence[torch.Tensor]]
                      ) -> Optional[Sequence[torch.Tensor]]:
        """The per-sample factors by which a normalizing rule rescales its ``shares`` (tensors shaped
        like ``out``, each linear in ``relevance``): ``factors(sums, total)`` maps the shares' sums
        per sample and that of ``relevance`` ([batch] each, ``sample_sum``) to one [batch] factor
        per share (chefer2021's Lemma-2 normalization, CVPR 2021 after Eq. 9:
        ``relprop.rules.residual.normalize_shares``).

        Here computed at once from the whole tensors. A context that sees only part of them (a chunk
        of query rows, ``relprop.engine.chunked_walk``) may defer them: it returns None, the rule
        returns its shares unscaled, and the context scales them, and whatever the linear rules below
        derive from them, once it has the sums over all the parts.
        """
        return factors([self.sample_sum(s) for s in shares], self.sample_sum(relevance))

    def live_tensor_args(self) -> Sequence[int]:
        """Positions of positional arguments that are input-dependent tensors."""
        return [i for i, (a, l) in enumerate(zip(self.args, self.live)) if l is True and torch.is_tensor(a)]


def per_sample(v: torch.Tensor, like: torch.Tensor, batch_dim: int) -> torch.Tensor:
    """Reshape a [batch] vector so it broadcasts along axis ``batch_dim`` of ``like`` (repeated k times
    per sample where that axis holds k·batch groups, batch-major)."""
    shape = [1] * like.dim()
    n = like.shape[batch_dim]
    if n != v.shape[0] and n % v.shape[0] == 0:
        v = v.repeat_interleave(n // v.shape[0])
    shape[batch_dim] = v.shape[0]
    return v.reshape(shape)
