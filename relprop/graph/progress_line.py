"""The progress line of a slow call: one line on stderr, drawn by ``tqdm``, that appears only once a
call has lasted :data:`DELAY` seconds (the first capture of a model with ``torch.export``, many
methods, SmoothGrad's or Integrated Gradients' re-runs).

Whether it is shown: the ``progress=`` of :func:`relprop.explain` (True/False), else the environment
variable :data:`ENV` (``1``/``on``/``true`` or ``0``/``off``/``false``), else only when stderr is a
terminal, so that test runs and CI logs get nothing. It never writes to stdout and changes no result.
Without ``tqdm`` (an optional dependency: ``relprop[eval]``) nothing is shown.

:func:`line` opens the line of a call; :func:`step` names what the call is doing now (the innermost
step is shown, with its count when it has a total), on the open line or, outside any, on a line of
its own. It sits in the lowest layer that reports progress (the capture, :mod:`relprop.graph.capture`);
the engine, the methods and :func:`relprop.explain` report through it.
"""
from __future__ import annotations

import contextlib
import contextvars
import os
import sys
import threading
import time
from typing import Iterator, List, Optional

#: the environment variable that turns the line on (1) or off (0) where ``progress=`` is not given
ENV = "RELPROP_PROGRESS"
#: seconds a call runs before its line appears (fast calls stay silent)
DELAY = 2.0
#: seconds between redraws of a shown line
REFRESH = 0.5

_ON, _OFF = ("1", "true", "on", "yes"), ("0", "false", "off", "no")
_LINE: contextvars.ContextVar[Optional["Line"]] = contextvars.ContextVar("relprop_progress_line", default=None)


def wanted(progress: Optional[bool] = None) -> bool:
    """Whether to show the line: ``progress`` when it is True or False, else :data:`ENV` when it is
    set to on/off, else whether stderr is a terminal."""
    if progress is not None:
        return bool(progress)
    value = os.environ.get(ENV, "").strip().lower()
    if value in _ON:
        return True
    if value in _OFF:
        return False
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty and isatty())


class Step:
    """What a call is doing now: a description and, when counted, ``n`` of ``total``."""

    def __init__(self, desc: str, total: Optional[int] = None):
        self.desc, self.total, self.n = desc, total, 0

    def update(self, n: int = 1) -> None:
        self.n += n

    def text(self) -> str:
        return self.desc if not self.total else f"{self.desc} {min(self.n, self.total)}/{self.total}"


class Line:
    """One progress line: a stack of :class:`Step` objects, the innermost drawn by a background
    thread once :data:`DELAY` seconds have passed (a tqdm status line with the elapsed time, removed
    when the call ends). Not shown (and no thread) when ``show`` is False."""

    def __init__(self, show: bool, delay: Optional[float] = None):
        self.show = show
        self.delay = DELAY if delay is None else delay
        self.steps: List[Step] = []
        self.shown = False  # whether the line was ever drawn (tests read it)
        self._bar = None
        self._tqdm = None
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._t0 = time.time()

    def start(self) -> "Line":
        self._t0 = time.time()
        if self.show:
            try:
                from tqdm.auto import tqdm  # optional dependency (relprop[eval]); without it, no line
            except ImportError:
                self.show = False
                return self
            self._tqdm = tqdm
            self._thread = threading.Thread(target=self._run, name="relprop-progress", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        if self._done.wait(self.delay):
            return
        while not self._done.is_set():
            self._draw()
            self._done.wait(REFRESH)

    def _draw(self) -> None:
        with self._lock:
            steps = list(self.steps)
            if self._done.is_set() or not steps:
                return
            if self._bar is None:  # made silent (delay), then dated from the start of the call and drawn
                self._bar = self._tqdm(file=sys.stderr, leave=False, dynamic_ncols=True, delay=1e9,
                                       bar_format="relprop: {desc} [{elapsed}]")
                self._bar.start_t, self._bar.delay = self._t0, 0
                self.shown = True
            self._bar.set_description_str(steps[-1].text(), refresh=False)
            self._bar.refresh()

    def close(self) -> None:
        with self._lock:
            self._done.set()
            if self._bar is not None:
                self._bar.close()
                self._bar = None
        if self._thread is not None:
            self._thread.join()


@contextlib.contextmanager
def line(desc: str, progress: Optional[bool] = None, delay: Optional[float] = None) -> Iterator[Step]:
    """The progress line of one call, described by ``desc`` until a :func:`step` names more; shown
    when :func:`wanted` says so (``progress``) and the call lasts ``delay`` (:data:`DELAY`) seconds.
    Inside another call's line (explain() run by evaluate), the step is added to that line."""
    outer = _LINE.get()
    if outer is not None:
        with step(desc) as s:
            yield s
        return
    current = Line(wanted(progress), delay)
    first = Step(desc)
    current.steps.append(first)
    token = _LINE.set(current)
    current.start()
    try:
        yield first
    finally:
        _LINE.reset(token)
        current.close()


@contextlib.contextmanager
def step(desc: str, total: Optional[int] = None) -> Iterator[Step]:
    """What the call does now (with a count when ``total`` is given: :meth:`Step.update`), shown on
    the open :func:`line`; outside any line, on a line of its own (shown when :func:`wanted`)."""
    current = _LINE.get()
    if current is None:
        with line(desc) as s:
            s.total = total
            yield s
        return
    s = Step(desc, total)
    current.steps.append(s)
    try:
        yield s
    finally:
        current.steps.remove(s)
