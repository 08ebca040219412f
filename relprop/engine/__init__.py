"""The engine: runs a captured graph forward, takes the gradients of the target, walks the
relevance back under a preset's rules, and hands the methods a :class:`Trace`.

==================  ===========================================================================
module              job
==================  ===========================================================================
``request``         :class:`Request`: what one run is asked to do (graph, model, inputs, target,
                    preset, eps, memory mode, precision), and the choices of its options
``run``             :func:`run`: forward, gradients, the walk, the block records, the Trace
``forward``         evaluating the graph (in float32 for a half-precision model); the relevance
                    seed at the outputs
``walk``            the reverse walk, node by node, with the conservation bookkeeping
``node_rules``      the rule of each node: its op's, a written-out function's as a whole, or with a
                    selective scan's selection parameters held constant
``memory``          what the forward pass keeps, frees or recomputes; segments for ``memory="low"``
``low_memory``      the run segment by segment (``memory="low"``)
``fast_path``       :func:`run_fast`: a preset's rules as one modified-gradient backward pass
``fast_low``        :func:`run_fast_low`: the fast path segment by segment, cores in row chunks
                    (``memory="low"``)
``session``         :class:`Session`: re-running the graph for the methods that perturb inputs
``trace``           :class:`Trace`, :class:`BlockRecord`, :class:`Conservation`
``budget``          the bytes of the block records a full-record run keeps, and their default
                    budget (``explain(..., records_budget=)``)
``fast_memory``     whether the fast path runs whole or segment by segment (``memory="default"``:
                    by the bytes of its attention maps against the same budget)
``coverage``        the coverage report: every op of a graph and how a preset handles it
==================  ===========================================================================
"""
from .coverage import Coverage, report
from .fast_low import run_fast_low
from .fast_path import FastPathUnavailable, run_fast, supports
from .request import MEMORY_MODES, UNSUPPORTED_MODES, Request, check_options
from .run import run
from .session import Session
from .trace import BlockConservation, BlockRecord, Conservation, Trace

__all__ = ["BlockConservation", "BlockRecord", "Conservation", "Coverage", "FastPathUnavailable", "MEMORY_MODES",
           "Request", "Session", "Trace", "UNSUPPORTED_MODES", "check_options", "report", "run", "run_fast",
           "run_fast_low", "supports"]
