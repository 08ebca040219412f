"""What an Explanation's notes say about the capture of its graph: the seconds of each stage of a first
call, and why a model was captured again (:class:`relprop.graph.capture.CaptureEvent`)."""
from __future__ import annotations

from typing import Any, List, Optional

from .capture import Captured, CaptureEvent
from .export import FIRST_CALL_SIZES
from .program import Program


def capture_notes(event: Optional[CaptureEvent], captured: Captured, model_name: str,
                  first_run: Optional[float] = None) -> List[str]:
    """What an Explanation's notes say about its graph on the first call that exported it or read it
    from disk: the seconds of each stage (:func:`stage_note`), and, when a user should know it, that
    torch.export fixed the sequence length of a text model (each new length is captured again) or
    that these inputs needed another capture because the earlier ones fix sizes they do not have.
    Nothing for a graph from this process's cache (a later call, a new size of a known program)."""
    if event is None or event.kind not in ("exported", "loaded"):
        return []
    program = captured.program
    pattern = program.patterns.get(program.primary)
    took = sum(v for k, v in event.seconds.items() if k != "store")
    notes = [stage_note(event, first_run)]
    if event.code_changed:
        names = event.code_changed if len(event.code_changed) <= 4 else event.code_changed[:4] + ["..."]
        notes.append(f"{model_name} was captured again ({took:.1f} s): its code changed since its last capture "
                     f"({', '.join(names)}), so the earlier graph, which computes the old code, was not used")
    if pattern is not None and pattern.tensor and not pattern.dtype.is_floating_point and len(pattern.dims) >= 2 \
            and isinstance(pattern.dims[-1], int) and pattern.dims[-1] > 1 \
            and program.exported_as != FIRST_CALL_SIZES[0]:
        notes.append(f"torch.export fixed {model_name}'s sequence length to {pattern.dims[-1]} tokens (its code "
                     "does not trace with a dynamic length), so each new length is captured again "
                     f"(this one: {took:.1f} s); "
                     "to capture once, pad the texts to a few fixed lengths")
    elif event.programs == 2 and any(program.dynamic_axes().values()):
        notes.append(f"{model_name} was exported again, for every input size, at its first call with other sizes "
                     f"({took:.1f} s): the first call's graph was made for that call's sizes only (the fastest "
                     "capture); later sizes reuse this one")
    elif event.programs > 1:
        shape = ", ".join(f"{k}: [{', '.join(_axis(d, program) for d in p.dims)}]"
                          for k, p in program.patterns.items() if p.tensor)
        notes.append(f"{model_name} was captured again for these inputs ({took:.1f} s): its earlier captures fix sizes "
                     f"these inputs do not have; this one takes {shape}. {event.programs} captures of this model "
                     "so far for inputs like these")
    return notes


def stage_note(event: CaptureEvent, first_run: Optional[float]) -> str:
    """Where a first call's seconds went: torch.export (or the disk cache), the decomposition (node by
    node, or torch's whole-program pass), relprop's analysis of the graph at this size, the first run."""
    s = event.seconds
    parts = []
    if "load" in s:
        parts.append(f"graph read from the disk cache {s['load']:.1f} s")
    if "export" in s:
        parts.append(f"torch.export {s['export']:.1f} s")
    for key, label in (("decompose", "decomposition node by node"),
                       ("decompose (whole program)", "decomposition of the whole program")):
        if key in s:
            parts.append(f"{label} {s[key]:.1f} s")
    if "analysis" in s:
        parts.append(f"relprop's analysis of the graph {s['analysis']:.1f} s")
    if first_run is not None:
        parts.append(f"first run {first_run:.1f} s")
    return ("first call on inputs like these: " + ", ".join(parts)
            + "; later calls reuse the graph (relprop.explain's progress=True shows each stage while it runs)")


def _axis(d: Any, program: Program) -> str:
    if isinstance(d, int):
        return str(d)
    return "batch" if getattr(d, "name", None) == program.batch_symbol else "any"


def rerun_note(event: CaptureEvent, model_name: str, method: str) -> str:
    """The note of a call whose sampling method had the program for every batch size captured for its packed
    re-runs (:meth:`relprop.engine.session.Session.for_every_batch`)."""
    took = sum(v for k, v in event.seconds.items() if k != "store")
    how = "read from the disk cache" if event.kind == "loaded" else "exported again"
    return (f"{model_name} was {how}, for every batch size ({took:.1f} s), so that {method} packs its re-runs "
            "into batches: the first call's graph was made for that call's sizes only (the fastest capture); "
            "later calls of any size reuse this one")
