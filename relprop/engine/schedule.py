"""How one engine run is carried out: a frozen :class:`Schedule`, made by one chooser (:func:`choose`)
from what the call asks (:class:`Asked`) and the captured graph, and run by
:func:`relprop.engine.execute.execute`.

A schedule fixes, before any tensor is computed:

* how the relevance is obtained: by the rule-by-rule walk (``"walk"``, every rule of the preset, the
  conservation ledger), by the rules' modified-gradient forms in one backward pass (``"gradient"``,
  Achtibat et al., ICML 2024, §3.3: input relevance only), or not at all (``"none"``: gradients only);
* whether the graph is run whole or segment by segment, one attention block at a time
  (``segmented``: gradient checkpointing at the blocks, for the walk as well);
* what becomes of each block's records (A, ∇A, R_A, CVPR 2021 Eq. 13): kept in the Trace, handed to
  the methods' folds and dropped (``"folded"``), or dropped (``"dropped"``);
* whether the row-local attention cores of a segmented run are evaluated in chunks of query rows, and
  of what size (``cores``: a :class:`relprop.engine.chunked_core.RowChunks`), and the kernel choices
  of that run (the fused segment walk, torch's fused attention kernel in the forward pass).

The chooser reads only shapes, the call's options and the preset's rules; it is the one place where
``memory=``, ``keep_blocks=``, ``records_budget=`` and ``fast_path=`` are turned into a run.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence, Tuple

import torch

from ..graph.capture import Captured
from .budget import attention_values, default_budget, mib, records_bytes
from .chunked_core import RowChunks
from .fast_path import supports

#: how the relevance of a run is obtained
RELEVANCE = ("walk", "gradient", "none")
#: when a call reads values on the host (``Tuning.host_reads``)
HOST_READS = ("auto", "end", "as_needed")
#: what becomes of each block's records
RECORDS = ("kept", "folded", "dropped")

#: attention-sized float32 tensors per block the whole fast path holds at its peak (measured on a
#: LLaMA-style decoder, ``benchmarks/memory_scaling.py --model llama --what fwdbwd lrp``: the peak grows
#: by 4.9 maps per block from 1024 to 2048 tokens, 879 MiB and 2746 MiB, 4.0× and 6.6× forward+backward)
MAPS_PER_BLOCK = 5

WINDOWS_LOW_MEMORY = ("memory='low' does not segment window attention (Swin): its window bookkeeping reads every "
                      "block's forward values. Explaining with memory='default'.")


@dataclasses.dataclass(frozen=True)
class Schedule:
    """How one engine run is carried out (module docstring).

    Attributes
    ----------
    relevance : ``"walk"``, ``"gradient"`` or ``"none"`` (:data:`RELEVANCE`).
    segmented : run segment by segment, one attention block at a time (``memory="low"``).
    records : ``"kept"``, ``"folded"`` (the request's folds get every block, then it is dropped) or
        ``"dropped"`` (:data:`RECORDS`). A gradient-form run keeps none.
    cores : the row-local attention cores of a segmented run evaluated in chunks of query rows of this
        size (forward, backward and in the walk; no heads × tokens² tensor is held whole), or None (whole).
    fused_segment : a segment holding one row-chunked core computes each chunk once for its backward pass
        and its walk (:mod:`relprop.engine.fused_segment`); False: two passes.
    fused_forward : the forward pass without autograd evaluates a chunk recognized as
        softmax(Q·Kᵀ·s + M)·V by torch's fused attention kernel (:mod:`relprop.graph.fused_attention`).
    weight_memo : keep a memo of |W| with the captured graph for later calls (``memory="high"``).
    compiled : the walk of a whole run by its compiled program for this input size
        (:mod:`relprop.engine.compiled_walk`, ``explain(..., compile=True)``).
    notes : what the chooser decided that the Explanations say (``exp.notes``).
    warnings : what it decided that is also a :class:`relprop.RelpropWarning` (already among ``notes``).
    """

    relevance: str = "walk"
    segmented: bool = False
    records: str = "kept"
    cores: Optional[RowChunks] = None
    fused_segment: bool = True
    fused_forward: bool = False
    weight_memo: bool = False
    compiled: bool = False
    notes: Tuple[str, ...] = ()
    warnings: Tuple[str, ...] = ()

    def __post_init__(self):
        if self.relevance not in RELEVANCE:
            raise ValueError(f"Schedule.relevance={self.relevance!r}: choices {list(RELEVANCE)}")
        if self.records not in RECORDS:
            raise ValueError(f"Schedule.records={self.records!r}: choices {list(RECORDS)}")
        if self.relevance == "gradient" and self.records != "dropped":
            raise ValueError("a gradient-form run keeps no block records: records='dropped'")
        if self.records != "kept" and self.relevance != "gradient" and not self.segmented:
            raise ValueError(f"records={self.records!r} is a segmented run: segmented=True")
        if self.cores is not None and not self.segmented:
            raise ValueError("row-chunked attention cores are a segmented run: segmented=True")
        if self.cores is not None and self.records == "kept":
            raise ValueError("row-chunked attention cores hold no whole attention map to keep: records='folded' "
                             "or 'dropped'")
        if self.compiled and (self.segmented or self.relevance != "walk" or self.weight_memo):
            raise ValueError("a compiled walk is the walk of a whole run without a memo of |W|: relevance='walk', "
                             "segmented=False, weight_memo=False")

    def but(self, **changes) -> "Schedule":
        """A copy with some fields changed (checked again)."""
        return dataclasses.replace(self, **changes)

    def describe(self) -> str:
        """The schedule in a few words (``"walk, segmented, records folded, cores in chunks of 256 rows"``)."""
        parts = [self.relevance, "segmented" if self.segmented else "whole", f"records {self.records}"]
        if self.cores is not None:
            parts.append(f"cores in chunks of {self.cores.rows} rows")
        return ", ".join(parts)


#: the whole walk with every block's records: what ``execute(request)`` runs without a schedule
WHOLE_WALK = Schedule()


@dataclasses.dataclass(frozen=True)
class Tuning:
    """How a call's runs are carried out where the choice changes no number beyond float rounding:
    ``explain(..., tuning=Tuning(...))``; the engine's chooser copies it into every run's schedule.

    Attributes
    ----------
    chunks
        the chunks of query rows of a segmented run's row-chunked attention cores (a ``RowChunks``:
        rows per chunk, bytes per chunk); None: such runs evaluate every core whole.
    fused_segment
        a segment holding one row-chunked core computes each chunk once for its backward pass and its
        walk; False: two passes.
    fused_forward
        the forward pass without autograd evaluates a chunk recognized as softmax(Q·Kᵀ·s + M)·V by
        torch's fused attention kernel.
    fold_chunk_bytes
        a folded method builds each block's map in chunks of query rows of at most this many bytes of
        per-head maps.
    host_reads
        when the call reads values on the host: ``"end"``, once, at its end (its checks, warnings and
        the assumptions it computed under, verified on the device; at most one host synchronization per
        call); ``"as_needed"``, where a value decides (what saves memory on long inputs: a mask that
        selects one operand everywhere, rows without relevance); ``"auto"`` (default): ``"end"`` on an
        accelerator, where every host read stalls the device's queue, ``"as_needed"`` on the CPU, where
        it costs no round trip.
    compile
        the relevance walk of a whole run as one program per input size, traced and compiled by
        ``torch.compile`` at the first call of a size (``explain(..., compile=True)``; the seconds in
        ``exp.notes``), the host read at the call's end. Runs that the chooser segments walk eagerly.
    """

    chunks: Optional[RowChunks] = RowChunks()
    fused_segment: bool = True
    fused_forward: bool = False
    fold_chunk_bytes: int = 16 << 20
    host_reads: str = "auto"
    compile: bool = False

    def __post_init__(self):
        if self.host_reads not in HOST_READS:
            raise ValueError(f"Tuning.host_reads={self.host_reads!r}: choices {list(HOST_READS)}")
        if self.chunks is not None and not isinstance(self.chunks, RowChunks):
            raise ValueError(f"Tuning.chunks must be a RowChunks or None, not {type(self.chunks).__name__}")
        if not (isinstance(self.fold_chunk_bytes, int) and self.fold_chunk_bytes >= 1):
            raise ValueError(f"Tuning.fold_chunk_bytes={self.fold_chunk_bytes!r} must be an int >= 1")

    def reads_once(self, device: torch.device) -> bool:
        """Whether a call on ``device`` reads values on the host once, at its end (``host_reads``; always
        with ``compile``, whose traced program takes no decision from a value)."""
        if self.compile:
            return True
        if self.host_reads == "auto":
            return device.type != "cpu"
        return self.host_reads == "end"


@dataclasses.dataclass(frozen=True)
class Asked:
    """What a call asks of its engine runs: :func:`relprop.explain`'s options and what its methods read.

    Attributes
    ----------
    memory, fast_path, keep_blocks, records_budget : ``explain()``'s options of those names.
    input_only : every method reads only the input relevance (``lrp``): no block records, no gradients.
    blocks : some method reads the block records.
    fold : None when every method can be folded block by block (the methods layer decides,
        :func:`relprop.methods.fold_maps.why_not`); else why not, in words.
    runs : traces with relevance the full-record path would keep (one per preset the methods need; 0 when
        no method needs relevance).
    tuning : the call's :class:`Tuning`.
    """

    memory: str = "default"
    fast_path: Optional[bool] = None
    keep_blocks: Optional[bool] = None
    records_budget: Optional[float] = None
    input_only: bool = False
    blocks: bool = True
    fold: Optional[str] = "no method of the call folds"
    runs: int = 1
    tuning: Tuning = Tuning()


def choose(captured: Captured, preset, eps: float, asked: Asked, batch: int, device: torch.device,
           compute: Optional[torch.dtype] = None) -> Schedule:
    """The :class:`Schedule` of one run under ``preset`` (None: a run without relevance) for a call that
    asks ``asked``, on ``batch`` samples on ``device`` (``compute``: the request's evaluation dtype): see
    :func:`_choose`; with ``compile=True`` the walk of a whole run is compiled, and any other run says that
    it ran eagerly."""
    return _not_compiled(_choose(captured, preset, eps, asked, batch, device, compute), asked.tuning)


def _choose(captured: Captured, preset, eps: float, asked: Asked, batch: int, device: torch.device,
            compute: Optional[torch.dtype] = None) -> Schedule:
    """The :class:`Schedule` of one run under ``preset`` (None: a run without relevance) for a call that
    asks ``asked``, on ``batch`` samples on ``device`` (``compute``: the request's evaluation dtype).

    In order: the blocks are folded when ``keep_blocks=False`` or their records would exceed the budget
    and every method folds (:func:`fold_choice`); methods that read only the input relevance take the
    preset's modified-gradient forms when it has them (whole, or segmented with row-chunked cores when
    ``memory="low"`` or its attention maps would exceed the budget: :func:`segment_choice`), else the
    rule-by-rule walk, which then keeps no block records past the same budget; the other runs walk whole,
    or segment by segment with ``memory="low"`` (not on window attention, whose bookkeeping reads every
    block)."""
    a = captured.analysis
    t = asked.tuning
    kernels = dict(fused_segment=t.fused_segment, fused_forward=t.fused_forward)
    fold, fold_note = fold_choice(captured, asked, batch, device)
    relevance = "walk" if preset is not None else "none"
    if fold:
        note = fold_note or ("keep_blocks=False: each attention block was folded into the scores during the reverse "
                             "walk and its records dropped (exp.blocks and exp.matrix are not kept)")
        return Schedule(relevance=relevance, segmented=True, records="folded", cores=t.chunks, notes=(note,),
                        **kernels)
    notes, warnings = [], []
    if preset is not None and asked.fast_path is not False and asked.input_only:
        why = fast_path_refusal(captured, preset, eps, compute)
        if why is None:
            segmented, note = segment_choice(asked.memory, a.blocks, batch, device, asked.records_budget)
            if segmented and a.windows:  # (window attention is not segmented: its bookkeeping reads every block)
                segmented, note = False, WINDOWS_LOW_MEMORY if asked.memory == "low" else None
            return Schedule(relevance="gradient", segmented=segmented, records="dropped",
                            cores=t.chunks if segmented else None, notes=_notes(note, fold_note), **kernels)
        note = (f"the one-backward fast path was not taken under preset '{preset.name}' ({why}); the graph was "
                "walked rule by rule instead, which gives the preset's relevance more slowly")
        notes.append(note)
        if asked.fast_path is True:
            warnings.append(note)
    memory = asked.memory
    if relevance == "walk" and asked.input_only and not a.windows and len(a.streams) <= 1:
        segmented, note = segment_choice(memory, a.blocks, batch, device, asked.records_budget,
                                         path="the rule-by-rule walk")
        if segmented:
            return Schedule(relevance="walk", segmented=True, records="dropped", cores=t.chunks,
                            notes=_notes(*notes, note, fold_note), warnings=tuple(warnings), **kernels)
    schedule = fit(Schedule(relevance=relevance, segmented=memory == "low", weight_memo=memory == "high",
                            notes=_notes(*notes, fold_note), warnings=tuple(warnings), **kernels), a)
    if t.compile and relevance == "walk" and not schedule.segmented and not schedule.weight_memo:
        return schedule.but(compiled=True)
    return schedule


def _not_compiled(schedule: Schedule, tuning: Tuning) -> Schedule:
    """``schedule`` with a note where ``compile=True`` was asked of a run it does not apply to."""
    if not tuning.compile or schedule.compiled:
        return schedule
    return schedule.but(notes=schedule.notes + (
        f"compile=True compiles the relevance walk of a whole run; this run ({schedule.describe()}"
        f"{', a memo of |W|' if schedule.weight_memo else ''}) ran eagerly",))


def _notes(*notes: Optional[str]) -> Tuple[str, ...]:
    return tuple(n for n in notes if n is not None)


def fit(schedule: Schedule, analysis) -> Schedule:
    """``schedule`` as a graph with this ``analysis`` can run it: window attention (Swin) is not
    segmented, as its window bookkeeping reads every block's forward values. A segmented run of such a
    graph that keeps the records runs whole, with a note and a warning (:data:`WINDOWS_LOW_MEMORY`); a
    segmented gradient-form run runs whole with a note."""
    if not (schedule.segmented and analysis.windows):
        return schedule
    notes = schedule.notes + (WINDOWS_LOW_MEMORY,)
    if schedule.relevance == "gradient":
        return schedule.but(segmented=False, cores=None, notes=notes)
    if schedule.records == "kept":
        return schedule.but(segmented=False, notes=notes, warnings=schedule.warnings + (WINDOWS_LOW_MEMORY,))
    return schedule  # (records folded or dropped: a folded run of one token sequence per block, refused)


def fast_path_refusal(captured: Captured, preset, eps: float, compute: Optional[torch.dtype]) -> Optional[str]:
    """None when ``preset`` runs as one modified-gradient backward pass on ``captured``
    (:mod:`relprop.engine.fast_path`), else why not: an op whose rule has no gradient form, no relevance
    source, or half-precision activations (the relevance accumulates in float32 at least)."""
    why = supports(captured, preset, eps)
    if why is not None:
        return why
    a = captured.analysis
    if not a.sources:
        return "no relevance source (pixels or embedding lookup) in the graph"
    if compute is None:
        for s in a.sources:
            val = s.meta.get("val")
            if isinstance(val, torch.Tensor) and val.dtype in (torch.float16, torch.bfloat16):
                return "half-precision activations: the interpreter accumulates relevance in float32"
    return None


def maps_bytes(blocks: Sequence, batch: int, itemsize: int = 4) -> int:
    """Bytes of the attention-sized tensors the whole fast path holds: Σ_blocks batch × heads ×
    queries × keys × ``itemsize`` × :data:`MAPS_PER_BLOCK`."""
    return attention_values(blocks) * batch * itemsize * MAPS_PER_BLOCK


def segment_choice(memory: str, blocks: Sequence, batch: int, device: torch.device, budget: Optional[float],
                   path: str = "the one-backward fast path") -> Tuple[bool, Optional[str]]:
    """``(segmented, note)`` for a run that reads only the input relevance: ``memory="low"`` segments,
    ``"high"`` does not, ``"default"`` segments when :data:`MAPS_PER_BLOCK` attention maps per block
    would exceed ``budget`` (None: :func:`relprop.engine.budget.default_budget` of ``device``); the note
    says so (None: nothing to say). ``path`` names the run in the note (the fast path, or the
    rule-by-rule walk of a preset without one, which holds at least as many maps)."""
    if memory == "low":
        return True, None
    if memory != "default" or not blocks:
        return False, None
    size = maps_bytes(blocks, batch)
    limit = default_budget(device) if budget is None else budget
    if size <= limit:
        return False, None
    return True, (f"{path} would hold {MAPS_PER_BLOCK} attention maps per block "
                  f"({len(blocks)} blocks: {mib(size)}), over records_budget={mib(limit)}: it ran segment by "
                  "segment with the attention cores in chunks of query rows (memory='low'; the same relevance "
                  "to float rounding); raise records_budget to run it whole")


def fold_choice(captured: Captured, asked: Asked, batch: int, device: torch.device) -> Tuple[bool, Optional[str]]:
    """``(fold, note)``: whether the call folds the blocks into the query row during the reverse walk
    (CVPR 2021 Eq. 13–14 associated from the query, :mod:`relprop.methods.fold_maps`), and the note the
    Explanations get about that choice (None: nothing to say). ``keep_blocks=True`` keeps the records,
    ``False`` folds where folding applies, None folds when the attention-sized records of a full-record
    run (A, ∇A, R_A of every block, :func:`relprop.engine.budget.records_bytes`) would exceed
    ``records_budget``."""
    a = captured.analysis
    if asked.keep_blocks is True:
        return False, None
    if asked.keep_blocks is False:
        if asked.fold is None:
            return True, None
        return False, (f"keep_blocks=False: not folded block by block ({asked.fold}); the full-record path ran and "
                       "exp.blocks holds every block's records")
    if not a.blocks or not asked.blocks:
        return False, None
    val = a.blocks[0].attention.meta.get("val")
    itemsize = 8 if isinstance(val, torch.Tensor) and val.dtype == torch.float64 else 4
    size = records_bytes(a.blocks, batch, itemsize, asked.runs)
    limit = default_budget(device) if asked.records_budget is None else asked.records_budget
    if size <= limit:
        return False, None
    over = (f"the block records (A, dA, R_A of {len(a.blocks)} blocks) would take {mib(size)}, over "
            f"records_budget={mib(limit)}")
    if asked.fold is not None:
        return False, f"{over}; they were kept because folding does not apply ({asked.fold})"
    return True, (f"{over}: each attention block was folded into the scores during the reverse walk and its "
                  "records dropped (exp.blocks and exp.matrix are not kept; explain with keep_blocks=True to "
                  "keep them, or raise records_budget)")
