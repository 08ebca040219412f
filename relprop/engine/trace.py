"""What one run of the engine produces: the :class:`Trace` with its per-block records and the
relevance bookkeeping (:class:`Conservation`). The methods read nothing else."""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional

import torch

from ..errors import MethodError


@dataclasses.dataclass
class BlockRecord:
    """What one attention block contributed, for target t (shapes [batch, heads, tokens, tokens]
    for the attention tensors and [batch, tokens, hidden] for the hidden states)."""

    index: int
    name: str
    layer: str
    attention: torch.Tensor  # A
    gradient: torch.Tensor  # dA = d y_t / d A
    relevance: Optional[torch.Tensor]  # R_A (None when only gradients were asked for)
    hidden: Optional[torch.Tensor]  # h, the hidden states entering the block
    hidden_gradient: Optional[torch.Tensor]  # dh
    hidden_relevance: Optional[torch.Tensor]  # R_h
    value: Optional[torch.Tensor] = None  # V [batch, heads, tokens, head_dim]
    features: Optional[torch.Tensor] = None  # token features entering the attention (LN1(h) or h)
    features_gradient: Optional[torch.Tensor] = None
    out_proj_weight: Optional[torch.Tensor] = None  # W_O [hidden, heads * head_dim]
    #: two-stream models: the input stream (input name) of the queries and of the keys, and the
    #: wave (blocks of one wave read the same relevancy state); None for one stream
    query_stream: Optional[str] = None
    key_stream: Optional[str] = None
    wave: Optional[int] = None


class NotKept:
    """Stands in for per-block records (``Trace.blocks``, ``Explanation.blocks``) or an aggregated
    matrix (``Explanation.matrix``) that a folded run did not keep: the method folded each block
    into its result during the reverse walk and dropped the block's A, dA and R_A at once. Any use
    of it (length, truth value, iteration, indexing, attributes) raises :class:`MethodError` naming
    the option that keeps them; :class:`relprop.Explanation` raises already when the field is read."""

    def __init__(self, what: str, method: str, option: str = "keep_blocks=True"):
        self.what, self.method, self.option = what, method, option

    @property
    def message(self) -> str:
        return (f"{self.what} of this explanation were not kept: method '{self.method}' folded each attention block "
                f"into its result during the reverse walk (memory flat in the number of tokens) and dropped the "
                f"block's records at once. Pass {self.option} to explain() to keep them (the full-matrix path: the "
                f"same scores, to float32 rounding, and every block's A, dA and R_A in memory)")

    def _refuse(self, *args, **kwargs):
        raise MethodError(self.message)

    __len__ = __bool__ = __iter__ = __getitem__ = _refuse

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise MethodError(self.message)

    def __repr__(self) -> str:
        return f"<{self.what} not kept: {self.option}>"


@dataclasses.dataclass
class BlockConservation:
    """Relevance entering and leaving one attention block, per sample."""

    name: str
    relevance_in: torch.Tensor  # [batch] entering the block from the output side
    relevance_out: torch.Tensor  # [batch] leaving it at the block input h
    absorbed: torch.Tensor  # [batch] absorbed by constants inside the block

    @property
    def error(self) -> torch.Tensor:
        """Relative conservation error per sample: |in - out - absorbed| / |in|."""
        return (self.relevance_in - self.relevance_out - self.absorbed).abs() / self.relevance_in.abs().clamp_min(1e-12)


@dataclasses.dataclass
class Conservation:
    """Relevance bookkeeping per sample (CVPR 2021, Eq. 3 and Lemmas 1-2).

    ``injected`` (at the output) = ``input`` (reached the pixels / token embeddings)
    + ``absorbed`` (taken by constants: position embeddings, class token, masks, ...) under a
    conservative preset, up to numerical error.
    """

    injected: torch.Tensor
    input: torch.Tensor
    absorbed: torch.Tensor
    absorbed_by: Dict[str, torch.Tensor]
    blocks: List[BlockConservation]
    preset: str

    @property
    def error(self) -> torch.Tensor:
        """Relative end-to-end error per sample: |injected - input - absorbed| / |injected|."""
        return (self.injected - self.input - self.absorbed).abs() / self.injected.abs().clamp_min(1e-12)

    def __repr__(self) -> str:
        rows = [f"Conservation(preset='{self.preset}', per sample)",
                f"  injected {self.injected.tolist()}", f"  input    {self.input.tolist()}",
                f"  absorbed {self.absorbed.tolist()}", f"  rel. err {self.error.tolist()}"]
        return "\n".join(rows)


@dataclasses.dataclass
class Trace:
    """Everything one forward + reverse walk produced."""

    outputs: Any
    logits: Optional[torch.Tensor]
    target: Optional[torch.Tensor]
    target_scores: torch.Tensor
    #: per attention block, from the input; a :class:`NotKept` after a folded run (the method's
    #: result was folded block by block, :attr:`folded`)
    blocks: Any
    input_relevance: Optional[torch.Tensor]
    input_gradient: Optional[torch.Tensor]
    conservation: Optional[Conservation]
    modality: str
    grid: Optional[tuple]
    batch_size: int
    #: the handle methods use to re-run the captured graph (:class:`relprop.engine.session.Session`)
    session: Any = None
    token_mask: Optional[torch.Tensor] = None  # [batch, tokens] True at real (non-padding) tokens
    #: window attention (Swin): token counts per block and the merge matrices between stages
    #: (relprop.graph.window_attention.Stages); None for models whose blocks share one token sequence
    stages: Any = None
    #: what the engine decided and why, for the Explanation (e.g. why the fast path was not taken)
    notes: List[str] = dataclasses.field(default_factory=list)
    #: [batch, tokens of the first block] input position of each token (patch index, row-major, or
    #: text position), -1 for tokens made from constants; None: constants first, then the positions
    token_map: Optional[torch.Tensor] = None
    #: block index -> the same for the tokens entering that block, for the blocks whose tokens are
    #: not the first block's (another number of tokens, a class-attention block's keys, ...)
    token_maps: Dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)
    #: the first op that mixes tokens outside the attention blocks, in words (None: none)
    token_mixing: Optional[str] = None
    #: [batch] the relevance the seed put at the outputs, per sample, where no ledger was kept (the fast
    #: path; the ledger's ``conservation.injected`` otherwise)
    injected: Optional[torch.Tensor] = None
    #: why the blocks' attention cannot be read per sample as token-to-token maps (None: it can)
    unmapped_blocks: Optional[str] = None
    #: two-stream models (relprop.graph.streams): the streams' input names, the explained one first
    #: ([] for one stream), each stream's input relevance (per token for ids and [batch, tokens,
    #: features] inputs) and [batch, tokens] mask of real tokens
    streams: List[str] = dataclasses.field(default_factory=list)
    stream_relevance: Dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    #: a folded run: the number of tokens of the first block (its records are gone)
    token_count: Optional[int] = None
    #: what the run says about itself (e.g. a compiled walk's first call)
    notes: List[str] = dataclasses.field(default_factory=list)
    stream_masks: Dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    #: the streams are merged into one token sequence (a vision-language model's image tokens written
    #: into the prompt; ``GraphAnalysis.merges``), not connected by cross-attention
    merged: bool = False
    #: a folded run (``Request.folds``): each fold's result, in the order of ``Request.folds``
    folded: List[Any] = dataclasses.field(default_factory=list)
    #: facts the methods derive from this trace and several of them read (the query's weights), computed
    #: once per trace (``relprop.methods.query``)
    memo: Dict[str, Any] = dataclasses.field(default_factory=dict, repr=False, compare=False)


@dataclasses.dataclass
class Pass:
    """The raw values of one run of the engine, before they become a :class:`Trace`: the forward
    values ``env`` still needed, the outputs, the [batch] target scores and class indices, the
    gradients at the recorded nodes, the relevance at the kept nodes, the conservation bookkeeping,
    the input relevance and the window layout (Swin) read from the forward pass."""

    env: Dict[Any, Any]
    outputs: Any
    scores: torch.Tensor
    target: Optional[torch.Tensor]
    grad: Dict[Any, torch.Tensor]
    rel_at: Dict[Any, torch.Tensor] = dataclasses.field(default_factory=dict)
    conservation: Optional[Conservation] = None
    input_relevance: Optional[torch.Tensor] = None
    windows: Any = None
    tokens: Dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)  # token_positions()
    stream_relevance: Dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    #: a folded run: the number of tokens of the first block (its records are gone)
    token_count: Optional[int] = None
    #: what the run says about itself (e.g. a compiled walk's first call)
    notes: List[str] = dataclasses.field(default_factory=list)
