"""What the row-chunked walk of one attention core hands on, held until its last chunk, and the
per-sample factors that a normalizing rule defers until then (:mod:`relprop.engine.chunked_walk`).

chefer2021 rescales the two z-rule shares of the mask's sum per sample (CVPR 2021 Eq. 6 and the
normalization after Eq. 9, Lemma 2: :func:`relprop.rules.residual.normalize_shares`) by factors gu,
gv, per-sample scalars that depend on sums over the whole tensors, which one chunk of query rows does
not see. Every other rule of the core is linear in the relevance it is given, the forward values
fixed (z-rule, ε-rule, identity, halving): R_u · gu walked down the core gives what R_u walked down
gives, times gu. So one pass over the chunks suffices: the rule's context adds up the sums chunk by
chunk (:class:`Deferral`) and the rule passes its shares unscaled; relevance derived from share j
carries the tag j, and what leaves the core with a tag (the rows of Q, the shares of Kᵀ, what the
ledger books) waits in :class:`CoreShares` until the last chunk, when the factors are known and
scale it per sample.

The walk proves as it goes that this holds and raises :class:`CannotDefer` where it cannot: the
attention map, which the folds read, reached by tagged relevance; relevance of two tags (or a tag
and none) meeting at one node; a second normalizing rule, or a rule that sums per sample otherwise;
a tagged share with no per-sample axis; tagged relevance reaching a rule that is not relprop's own
(a user's rule may not be linear in the relevance). It is said on the first chunk, when nothing was handed on
yet (the hooks of a chunk are called once its walk is done), and the walk counts the sums first
instead (:func:`relprop.engine.chunked_walk.walk_core`).
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.fx

from ..errors import RelpropError
from ..graph.attention_core import add_on_first_keys
from ..rules.context import per_sample


class CannotDefer(Exception):
    """The walk of a core cannot defer a rule's per-sample factors (said on its first chunk)."""


class Deferral:
    """The per-sample sums of the one normalizing rule of a core (its ``node``), added up over the
    chunks, and the factors they give (:meth:`factors`) once the last chunk is walked."""

    def __init__(self):
        self.node: Optional[torch.fx.Node] = None
        self.sums: List[torch.Tensor] = []
        self.total: Optional[torch.Tensor] = None
        self.fn: Optional[Callable] = None
        self.first = True  # walking the first chunk: nothing was handed on yet
        self.calls = 0  # the normalizing rule's calls on this chunk
        self._factors: Optional[List[torch.Tensor]] = None

    def chunk(self, first: bool) -> None:
        """A chunk's walk begins (``first``: the first chunk)."""
        self.first, self.calls = first, 0

    def chunk_done(self) -> None:
        """A chunk's walk ended: the normalizing rule ran on it as on the first chunk."""
        if self.node is not None and self.calls != 1:
            self.cannot(f"the rule of {self.node.name} ran {self.calls} times on a chunk")

    def cannot(self, why: str) -> None:
        """Refuse to defer, because ``why``: :class:`CannotDefer` on the first chunk; after it,
        something was handed on already and the rules must have changed between chunks."""
        if self.first:
            raise CannotDefer(why)
        raise RelpropError(f"the row-chunked walk deferred a normalization on the first chunk of an "
                           f"attention core, but on a later chunk {why}")

    def add(self, node: torch.fx.Node, sums: Sequence[torch.Tensor], total: torch.Tensor,
            fn: Callable[[List[torch.Tensor], torch.Tensor], Sequence[torch.Tensor]]) -> None:
        """The rule of ``node`` on one chunk: its shares' sums per sample ``sums`` and its relevance's
        ``total`` ([batch] each); ``fn(sums, total)`` gives the factors from the whole sums."""
        self.calls += 1
        if self.node is None and not self.first:
            self.cannot(f"the rule of {node.name} normalizes and did not on the first chunk")
        if self.calls > 1 or (self.node is not None and node is not self.node):
            self.cannot("more than one rule normalizes per sample")
        if self.node is None:
            self.node, self.sums, self.total, self.fn = node, list(sums), total, fn
        else:
            self.sums = [a + b for a, b in zip(self.sums, sums)]
            self.total = self.total + total

    def factors(self) -> Optional[List[torch.Tensor]]:
        """The [batch] factor of each tag (the rule's shares, in order), None where no rule deferred."""
        if self.node is None:
            return None
        if self._factors is None:
            self._factors = list(self.fn(self.sums, self.total))
        return self._factors

    def tag_of(self, share, deferred: Sequence[torch.Tensor]) -> int:
        """The tag of ``share``, returned by the rule that deferred the factors of ``deferred``."""
        for j, d in enumerate(deferred):
            if share is d:
                return j
        self.cannot("the normalizing rule passes on other shares than those it normalizes")
        return -1


class CoreShares:
    """The shares that the walk of one core hands on (operands split by rows, operands read whole,
    shares booked as absorbed), by tag (None: no deferred factor), held until :meth:`hand_on`."""

    def __init__(self, walker, deferral: Optional[Deferral], queries: int):
        self.walker, self.deferral, self.queries = walker, deferral, queries
        self.rows: Dict[torch.fx.Node, Dict[Optional[int], List[tuple]]] = {}  # (first row, share) by tag
        self.whole: Dict[torch.fx.Node, Dict[Optional[int], torch.Tensor]] = {}
        self.absorbed: List[tuple] = []  # (label, per-sample sum, consumer, tag), in booking order

    def _per_sample_axis(self, arg, share: torch.Tensor, tag: Optional[int]) -> None:
        """A tagged share of ``arg`` must keep the samples apart, to be scaled per sample."""
        if tag is None or self.walker.batch == 1:
            return
        d = self.walker.bdim.get(arg)
        if d is None or share.dim() <= d or share.shape[d] % self.walker.batch:
            self.deferral.cannot(f"the share of {arg.name} has no batch axis to scale per sample")

    def row(self, arg, tag: Optional[int], share: torch.Tensor, lo: int) -> None:
        """The share of ``arg`` (split by rows) on the chunk's rows, from row ``lo`` on (rows of no
        chunk's share are 0: chunks without relevance are not walked)."""
        self._per_sample_axis(arg, share, tag)
        self.rows.setdefault(arg, {}).setdefault(tag, []).append((lo, share))

    def _all_rows(self, parts: List[tuple]) -> torch.Tensor:
        """The shares of a split operand on every row: the chunks' shares in row order, 0 on the
        rows of chunks that gave none."""
        end = parts[-1][0] + parts[-1][1].shape[-2]
        if parts[0][0] == 0 and end == self.queries and all(
                a[0] + a[1].shape[-2] == b[0] for a, b in zip(parts, parts[1:])):
            return torch.cat([p for _, p in parts], -2)
        first = parts[0][1]
        out = first.new_zeros(first.shape[:-2] + (self.queries,) + first.shape[-1:])
        for lo, p in parts:
            out[..., lo:lo + p.shape[-2], :] = p
        return out

    def add_whole(self, arg, tag: Optional[int], share: torch.Tensor, shape=None) -> None:
        """The chunk's share of ``arg`` (read whole by every chunk), added up over the chunks into a
        total of ``shape`` (the operand's; the share's own by default) made here. A share on the
        chunk's first keys only is added into those (the later keys' shares are 0: no padded copy)."""
        self._per_sample_axis(arg, share, tag)
        parts = self.whole.setdefault(arg, {})
        if tag not in parts:
            parts[tag] = share.new_zeros(tuple(share.shape) if shape is None else tuple(shape))
        add_on_first_keys(parts[tag], share, f"a share of {arg.name}")

    def absorb(self, label: str, rel: torch.Tensor, consumer, arg_bdim: Optional[int], out_val,
               tag: Optional[int]) -> None:
        """A share that ``consumer`` does not pass on (as :meth:`relprop.engine.ledger.Ledger.absorb`
        takes it), kept as its per-sample sum."""
        s, split = self.walker.ledger.share(rel, consumer, arg_bdim, out_val)
        if tag is not None and not split:
            self.deferral.cannot(f"a share absorbed by {consumer.name} has no batch axis to scale per sample")
        self.absorbed.append((label, s, consumer, tag))

    def hand_on(self, product: torch.fx.Node) -> None:
        """Once every chunk is walked: book the absorbed shares, deliver the operands' shares (from
        ``product``, the core's output), the tagged ones scaled by their factors."""
        walker = self.walker
        g = self.deferral.factors() if self.deferral is not None else None
        for label, s, consumer, tag in self.absorbed:
            walker.ledger.book(label, s if tag is None else s * g[tag], consumer)
        for arg, parts in self.rows.items():
            walker.deliver(arg, self._combined(arg, {t: self._all_rows(p) for t, p in parts.items()}, g), product)
        for arg, parts in self.whole.items():
            walker.deliver(arg, self._combined(arg, parts, g), product)

    def _combined(self, arg, parts: Dict[Optional[int], torch.Tensor], g) -> torch.Tensor:
        """The sum of ``arg``'s shares, each scaled per sample by the factor of its tag."""
        out = None
        for tag, share in parts.items():
            if tag is not None:
                d = self.walker.bdim.get(arg)
                share = share * (g[tag] if d is None else per_sample(g[tag], share, d))
            out = share if out is None else out + share
        return out
