"""Progress of the methods that re-run the model many times (SmoothGrad, Integrated Gradients,
Value Zeroing, ViT-CX): a counted step of the call's progress line (:mod:`relprop.graph.progress_line`),
shown on stderr when that line is and the call has lasted a couple of seconds."""
from __future__ import annotations

from ..graph.progress_line import Step, step


def progress_bar(total: int, desc: str):
    """A context manager over ``total`` steps of method ``desc`` (``bar.update(n)``): a counted
    :func:`relprop.graph.progress_line.step` of the current progress line."""
    return step(desc, total)


__all__ = ["Step", "progress_bar"]
