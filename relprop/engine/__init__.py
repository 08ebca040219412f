"""The engine: runs a captured graph forward, takes the gradients of the target, walks the
relevance back under a preset's rules, and hands the methods a :class:`Trace`.

One entry point: :func:`execute` runs a :class:`Schedule` (how: relevance by the walk or by gradient
forms, whole or segment by segment, block records kept, folded or dropped, attention cores whole or in
row chunks), made by one chooser, :func:`relprop.engine.schedule.choose`, from what the call asks.

==================  ===========================================================================
module              job
==================  ===========================================================================
``request``         :class:`Request`: what one run explains (graph, model, inputs, target, preset,
                    eps, precision, the folds), and the choices of the engine's options
``schedule``        :class:`Schedule`: how one run is carried out; :func:`~schedule.choose`, the
                    one chooser (``memory=``, ``keep_blocks=``, ``records_budget=``, ``fast_path=``)
``execute``         :func:`execute`: runs any schedule, builds the Trace
``whole_run``       the whole run: forward, gradients, the whole walk
``low_memory``      the run segment by segment, one attention block at a time
``fast_path``       a preset's rules as one modified-gradient backward pass
``fast_low``        the fast path segment by segment, cores in row chunks
``forward``         evaluating the graph (in float32 for a half-precision model); the relevance
                    seed at the outputs
``walk``            the reverse walk, node by node, with the conservation bookkeeping
``rule_apply``      applying one node's rule (the walk and the row-chunked walk both call it)
``node_rules``      the rule of each node: its op's, a written-out function's as a whole, or with a
                    selective scan's selection parameters held constant
``chunked_core``    an attention core in chunks of query rows (:class:`RowChunks`: their size)
``chunked_walk``    the walk through such a core, a strategy hooked at its output node
``memory``          what the forward pass keeps, frees or recomputes; the segments
``session``         :class:`Session`: re-running the graph for the methods that perturb inputs
``trace``           :class:`Trace`, :class:`BlockRecord`, :class:`Conservation`
``budget``          the bytes of the block records a full-record run keeps, and their default
                    budget (``explain(..., records_budget=)``)
``coverage``        the coverage report: every op of a graph and how a preset handles it
==================  ===========================================================================
"""
from .chunked_core import RowChunks
from .coverage import Coverage, report
from .execute import execute
from .fast_path import FastPathUnavailable, supports
from .request import MEMORY_MODES, UNSUPPORTED_MODES, Request, check_options
from .schedule import WHOLE_WALK, Asked, Schedule, Tuning, choose
from .session import Session
from .trace import BlockConservation, BlockRecord, Conservation, Trace

__all__ = ["Asked", "BlockConservation", "BlockRecord", "Conservation", "Coverage", "FastPathUnavailable",
           "MEMORY_MODES", "Request", "RowChunks", "Schedule", "Session", "Trace", "Tuning", "UNSUPPORTED_MODES",
           "WHOLE_WALK", "check_options", "choose", "execute", "report", "supports"]
