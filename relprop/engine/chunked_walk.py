"""The reverse walk through an attention core in chunks of query rows (the row-chunked walk, steps
3–4; a segmented run whose :class:`relprop.engine.schedule.Schedule` has ``cores``).

In a folded run (:mod:`relprop.engine.fold_hooks`) a block whose core is row-local
(:func:`relprop.graph.attention_core.find_core`: Q·Kᵀ, scale, mask, softmax, A·V) is evaluated by
:func:`relprop.engine.chunked_core.core_in_row_chunks`, so the segment's backward pass holds no
heads × queries × keys tensor and gives the gradient at the core's output, dO. The walk then takes
one step at the core's output instead of one per core node (:func:`walk_core`): for each chunk of
query rows it recomputes the chunk's values, A_c and dA_c = ∂y/∂A_c (from dO_c, by autograd through the
chunk), runs each core node's rule of the preset on the chunk (CVPR 2021 Eq. 1–3 are row-local, so a
chunk's rows are those of the whole tensors), hands (A_c, dA_c, R_A,c) to the folds, and gathers
what the rules absorb, R_Q by rows and R_Kᵀ, R_V as sums over the chunks, handed on after the last.

A rule that normalizes its shares per sample (chefer2021's Lemma-2 normalization of the mask's sum,
CVPR 2021 Eq. 6 and after Eq. 9: :func:`relprop.rules.residual.normalize_shares`) needs sums over
the whole tensors. The walk defers its factors (:mod:`relprop.engine.deferred_shares`): one pass
adds up the sums while the unscaled shares go down the core's linear rules, and what they give is
scaled per sample once every chunk is walked. Where it cannot prove that sound, on the first chunk,
it takes the counting path: the chunks are walked once to add up each such sum (:class:`_Sums`,
nothing handed on), then again with the sums known. Same numbers as the whole walk up to the order
of float sums.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Optional

import torch
import torch.fx

from ..errors import UnsupportedOperation
from ..graph.aliasing import shares_memory
from ..graph.attention_core import AttentionCore, evaluate_rows, find_core, first_keys, keys_padded
from ..graph.host_reads import deferring
from ..graph.nodes import module_path, module_type
from ..rules.context import RuleContext
from ..rules.preset_table import BUILTIN
from ..rules.stabilize import fit_to_shape, promote
from .chunked_core import RowChunks, chunk_plan
from .deferred_shares import CannotDefer, CoreShares, Deferral
from .rule_apply import apply_rule


def plan_cores(analysis) -> Dict[torch.fx.Node, tuple]:
    """{product node A·V: (its row-local :class:`AttentionCore`, its block)} for each block of
    ``analysis`` whose core is row-local and holds its attention map."""
    out = {}
    for b in analysis.blocks:
        core, _ = find_core(b, analysis.live)
        if core is not None and b.attention in core.nodes and b.attention is not core.nodes[-1]:
            out[core.nodes[-1]] = (core, b)
    return out


class ChunkedCores:
    """The row-chunked walk as a strategy of the reverse walk (:class:`relprop.engine.walk.Walker`'s
    ``steps``), hooked at the output A·V of each core of ``cores`` ({A·V node: (core, block)}): the walk
    hands that node's complete relevance to this strategy (:meth:`__call__`), which walks the core in
    ``chunks`` of query rows (:func:`walk_core`) reading the gradient at the core's output from
    ``gradients``, and skips the core's other nodes (:meth:`covers`). ``hooks``: the folded run's
    :class:`relprop.engine.fold_hooks.BlockFolder`, handed each chunk's A, dA and R_A."""

    def __init__(self, cores: Dict[torch.fx.Node, tuple], gradients: Dict[torch.fx.Node, torch.Tensor],
                 chunks: RowChunks, hooks=None):
        self.cores, self.gradients, self.chunks, self.hooks = cores, gradients, chunks, hooks
        #: the nodes at which the walk calls this strategy
        self.nodes = frozenset(cores)
        self.inside = frozenset(n for core, _ in cores.values() for n in core.nodes[:-1])
        self.walked: set = set()  # the cores' outputs walked before the walk visited them (walk_with)

    def covers(self, node) -> bool:
        """Whether the walk skips ``node``: inside a core, or a core output walked already."""
        return node in self.inside or node in self.walked

    def __call__(self, walker, node, relevance) -> None:
        core, block = self.cores[node]
        walk_core(walker, node, relevance, core, block, self.gradients.pop(node, None), self.chunks, self.hooks)

    def walk_with(self, walker, node, dout, source) -> None:
        """Walk the core whose output is ``node`` now, before the walk visits it: its chunks (values and
        dA) come from ``source`` (:class:`relprop.engine.chunk_gradients.ChunkGradients`, the segment's
        backward pass computing them once for both, :mod:`relprop.engine.fused_segment`) and ``dout`` is
        the gradient at its output. The hooks close the block at :meth:`done`."""
        core, block = self.cores[node]
        self.walked.add(node)
        walk_core(walker, node, walker.take(node), core, block, dout, self.chunks, self.hooks, source, close=False)

    def done(self, node) -> None:
        """The segment of the core walked by :meth:`walk_with` has its gradients: the hooks close its
        block (a fold may read the gradients of the block's records)."""
        if self.hooks is not None:
            self.hooks.rows_done(self.cores[node][1])


def chunk_values(core: AttentionCore, attention, value: Callable, lo: int, hi: int, compute=None,
                 dout: Optional[torch.Tensor] = None, keys: Optional[tuple] = None):
    """(values of the core's nodes on rows ``lo:hi``, dA on those rows or None): ``value(n)`` gives
    each outside operand whole; with ``dout`` (the gradient at the core's output), ∂y/∂A on the
    rows by autograd through the chunk (the product and the nodes between A and it). ``keys`` =
    (kept, all): the values on the chunk's first ``kept`` keys only
    (:func:`relprop.engine.chunked_core.chunk_plan`)."""
    with torch.enable_grad() if dout is not None else torch.no_grad():
        out = evaluate_rows(core, value, lo, hi, compute, leaf=attention if dout is not None else None, keys=keys)
        grad = None
        if dout is not None:
            res = out[core.nodes[-1]]
            grad = torch.autograd.grad(res, out[attention], dout[..., lo:hi, :].to(res.dtype), allow_unused=True)[0]
            if grad is None:
                grad = torch.zeros_like(out[attention])
    out = {n: v.detach() if torch.is_tensor(v) else v for n, v in out.items()}
    return out, grad


class _Sums:
    """Per-sample sums that a rule takes over tensors of the chunk (:meth:`RuleContext.sample_sum`):
    added up over the chunks in the first pass, handed back whole (by call order) in the second."""

    def __init__(self):
        self.totals: List[torch.Tensor] = []
        self.calls = 0
        self.replay = False
        self.nodes: set = set()  # the nodes whose rules took sums

    def take(self, node, s: torch.Tensor) -> torch.Tensor:
        self.nodes.add(node)
        i = self.calls
        self.calls += 1
        if self.replay:
            return self.totals[i]
        if i < len(self.totals):
            self.totals[i] = self.totals[i] + s
        else:
            self.totals.append(s)
        return s


@dataclasses.dataclass
class _ChunkContext(RuleContext):
    """A rule's context on one chunk: sums per sample are those of :class:`_Sums` (the counting path)
    or deferred (``deferral``; ``tag``: that of the relevance the rule is given)."""

    sums: Optional[_Sums] = None
    deferral: Optional[Deferral] = None
    tag: Optional[int] = None
    deferred: Optional[tuple] = None  # the shares whose factors the rule deferred

    def sample_sum(self, t: torch.Tensor) -> torch.Tensor:
        """The per-sample sum over the whole tensor whose rows ``t`` is (see :class:`_Sums`)."""
        if self.deferral is not None:
            self.deferral.cannot(f"the rule of {self.node.name} sums per sample")
        return self.sums.take(self.node, super().sample_sum(t))

    def share_factors(self, shares, relevance, factors):
        """Deferred where the walk defers (:mod:`relprop.engine.deferred_shares`): the chunk's sums
        are added up, the shares come back unscaled (None)."""
        if self.deferral is None:
            return super().share_factors(shares, relevance, factors)
        if self.tag is not None:
            self.deferral.cannot(f"the rule of {self.node.name} normalizes relevance scaled later")
        whole = RuleContext.sample_sum
        self.deferral.add(self.node, [whole(self, s) for s in shares], whole(self, relevance), factors)
        self.deferred = tuple(shares)
        return None


def walk_core(walker, product, r, core: AttentionCore, block, dout, chunks: RowChunks, hooks=None, source=None,
              close: bool = True) -> None:
    """The walk's step at ``product``, the output of a row-local ``core`` with relevance ``r``
    (None: none reaches it) and gradient ``dout``: every core node's rule run chunk by chunk
    (module docstring), the shares of the outside operands delivered to them, each chunk's
    (A_c, dA_c, R_A,c) handed to ``hooks.reached_rows`` and the block closed by ``hooks.rows_done``.
    ``source``: where the one pass gets each chunk's values and dA (``source(lo, hi, keys)``; a
    :class:`relprop.engine.chunk_gradients.ChunkGradients`, which computes the segment's gradients
    with them) instead of :func:`chunk_values`; every chunk is asked of it once (:meth:`rest`
    computes those a counting path did not ask for). ``close=False``: the caller calls
    ``hooks.rows_done`` itself (once the segment's gradients are complete)."""
    queries = walker.values.value(core.rows[0]).shape[-2]
    chunks = chunk_plan(core, walker.values.value, queries, chunks)
    if r is not None and len(chunks) > 1:
        try:  # one pass, normalizations deferred
            _walk_chunks(walker, r, core, block, dout, chunks, _Sums(), hooks, False, Deferral(), source)
        except CannotDefer:  # (on the first chunk: nothing was handed on)
            if source is not None:
                source.rest(chunks)
            _walk_counted(walker, r, core, block, dout, chunks, hooks)
    else:  # (one chunk: its sums are the whole sums)
        _walk_chunks(walker, r, core, block, dout, chunks, _Sums(), hooks, counting=False, source=source)
    if source is not None:
        source.rest(chunks)
    if hooks is not None and close:
        hooks.rows_done(block)


def _walk_counted(walker, r, core, block, dout, chunks, hooks) -> None:
    """The counting path: the sums per sample added up over the chunks first, then the walk."""
    queries = chunks[-1][1]
    sums = _Sums()
    _walk_chunks(walker, r, core, block, dout, chunks[:1], sums, None, counting=True)  # a rule sums per sample?
    if len(sums.nodes) > 1:  # sums of shares that depend on other sums: walk the rows at once
        keys = chunks[0][2][1]
        chunks, sums = [(0, queries, (keys, keys))], _Sums()
    elif sums.nodes:  # the sums over the other chunks, then the walk with the whole sums
        _walk_chunks(walker, r, core, block, dout, chunks[1:], sums, None, counting=True)
        sums.replay = True
    _walk_chunks(walker, r, core, block, dout, chunks, sums, hooks, counting=False)


def _walk_chunks(walker, r, core, block, dout, chunks, sums, hooks, counting: bool,
                 deferral: Optional[Deferral] = None, source=None) -> None:
    a, values = walker.a, walker.values
    interior = set(core.nodes)
    rows_of = set(core.rows)
    out = CoreShares(walker, deferral, chunks[-1][1])
    product = core.nodes[-1]
    # counting: no dA (only the folds read it), and once the summing rules are known, no rule below them
    last_sum = min((core.nodes.index(n) for n in sums.nodes), default=None) if counting else None
    linear = not counting and r is not None and all(_relprops_own(walker.rule_of(n)) for n in core.nodes
                                                     if n in a.live)
    for k, (lo, hi, keys) in enumerate(chunks):
        if source is not None and not counting:
            vals, grad = source(lo, hi, keys)
        else:
            vals, grad = chunk_values(core, block.attention, values.value, lo, hi, values.compute,
                                      None if counting else dout, keys)
        R: Dict[torch.fx.Node, torch.Tensor] = {} if r is None else {product: r[..., lo:hi, :]}
        if linear and k > 0 and not deferring() and not bool(R[product].any()):
            # no relevance on these rows (a decoder explained at its last position, in the block next
            # to the output): every rule is linear in R, so every share is 0 (CoreShares gives the
            # rows 0) and so is R_A; the folds still get A and dA. (Never the first chunk: its rules
            # say what is deferred and what the ledger books; never within a call that reads nothing on
            # the host until its end, relprop.graph.host_reads: there every chunk is walked.)
            if hooks is not None:
                hooks.reached_rows(block, lo, hi, chunks[-1][1], vals[block.attention], grad,
                                   torch.zeros_like(promote(vals[block.attention])), keys[1])
            del vals, grad, R
            continue
        tags: Dict[torch.fx.Node, int] = {}  # a deferred factor's tag of R where it has one
        sums.calls = 0
        if deferral is not None:
            deferral.chunk(first=k == 0)
        value = _reader(core, vals, values.value, rows_of, lo, hi, keys)
        reached = None
        for i in range(len(core.nodes) - 1, -1, -1):
            node = core.nodes[i]
            if last_sum is not None and i < last_sum:
                break
            rn, tag = R.pop(node, None), tags.pop(node, None)
            if node is block.attention:
                if tag is not None:
                    deferral.cannot("the attention map, which the folds read, gets relevance scaled later")
                reached = rn
            if rn is None:
                continue
            shares, spec, deferred = _rule(walker, node, rn, value, sums, counting, out, deferral, tag,
                                           _dead_after(node, core, block, vals, value))
            held = spec.constant_positions
            arg_nodes = node.args if spec.operands is None else spec.operands
            for j, arg in enumerate(arg_nodes):
                share = shares[j] if j < len(shares) else None
                if share is None or counting and arg not in interior:
                    continue
                st = tag if deferred is None else deferral.tag_of(share, deferred)
                if isinstance(arg, torch.fx.Node) and arg in a.live and j not in held:
                    share = fit_to_shape(promote(share), value(arg).shape)
                    if arg in interior:
                        if arg in R and tags.get(arg) != st:
                            deferral.cannot(f"relevance scaled by different factors meets at {arg.name}")
                        R[arg] = R[arg] + share if arg in R else share
                        if st is not None:
                            tags[arg] = st
                        continue
                    whole = values.value(arg)
                    if arg in rows_of:
                        out.row(arg, st, keys_padded(share, whole.shape[:-2] + (hi - lo,) + whole.shape[-1:],
                                                     f"a share of {arg.name}"), lo)
                    else:  # (added into the whole share's first keys: no padded copy)
                        out.add_whole(arg, st, share, whole.shape)
                elif torch.is_tensor(share) and not counting:
                    label = walker.held_label(arg, node) if j in held else walker.constant_label(arg, node)
                    out.absorb(label, promote(share), node, walker.bdim.get(arg)
                               if isinstance(arg, torch.fx.Node) else None, vals[node], st)
        if deferral is not None:
            deferral.chunk_done()
        if hooks is not None and not counting:  # (once the chunk's walk is done: nothing was deferred wrongly)
            hooks.reached_rows(block, lo, hi, chunks[-1][1], vals[block.attention], grad, reached, keys[1])
        del vals, grad, R, value, reached
    if not counting:
        out.hand_on(product)


def _reader(core, vals, whole, rows_of, lo: int, hi: int, keys: tuple) -> Callable:
    """The value of a node on the chunk: a core node's from ``vals``, an outside operand's from
    ``whole`` (its rows ``lo:hi`` where it is split, its first ``keys[0]`` keys where it has a
    keys' axis), as :func:`relprop.graph.attention_core.evaluate_rows` read it."""
    def value(n):
        if n in vals:
            return vals[n]
        v = whole(n)
        return first_keys(core, n, v[..., lo:hi, :] if n in rows_of else v, keys[1], keys[0])
    return value


def _dead_after(node, core, block, vals, value) -> bool:
    """Whether the chunk's value of core node ``node`` is dead once its rule has run, so that a rule
    may compute into its buffer (``RuleContext.out_writable``): the walk of the chunk visits the
    nodes after it first and reads no node's value after that node's rule, except the attention
    map's (the folds read it), which ``node`` is not and shares no memory with; nor with its
    operands (an outside operand's value is a slice of a whole tensor), and autograd records it not.
    The product's value is the core's output (rows of a whole tensor)."""
    v = vals.get(node)
    if node is block.attention or node is core.nodes[-1] or not torch.is_tensor(v) or v.requires_grad:
        return False
    return not shares_memory(v, vals.get(block.attention), *(value(a) for a in node.all_input_nodes))


def _rule(walker, node, r, value, sums, counting: bool, out: CoreShares, deferral=None, tag=None,
          dead: bool = False):
    """Run the preset's rule of core node ``node`` on the chunk (values from ``value``) with
    relevance ``r`` (of tag ``tag``); keep what its stabilizer keeps in ``out``. ``dead``: the
    node's value is not read after its rule (:func:`_dead_after`). Returns (shares, spec, the
    shares whose factors the rule deferred or None)."""
    spec = walker.rule_of(node)
    if spec is None:
        raise UnsupportedOperation(node.target, module_path(node), module_type(node), walker.preset.name)
    if deferral is not None and tag is not None and not _relprops_own(spec):
        deferral.cannot(f"the rule of {node.name} is not one of relprop's (whose rules are linear in the relevance)")
    applied = apply_rule(spec, node, r, value, walker.a.live, batch=walker.batch, batch_dim=walker.bdim.get(node),
                         eps=walker.eps, preset=walker.preset, options=walker.options,
                         dead=lambda: dead and not counting, book=not counting, context=_ChunkContext, sums=sums,
                         deferral=deferral, tag=tag)
    if applied.kept is not None:  # an ε-rule: book what its stabilizer keeps
        out.absorb(applied.kept[0], applied.kept[1], node, None, value(node), tag)
    return applied.shares, spec, applied.deferred


def _relprops_own(spec) -> bool:
    """Whether rule ``spec`` is one of relprop's own presets' rules (``BUILTIN``), known to be linear
    in the relevance it is given (a rule registered or overridden by a user may not be: relevance
    scaled later is not walked through it, :mod:`relprop.engine.deferred_shares`)."""
    return any(spec is s for table in BUILTIN.values() for s in table.values())
