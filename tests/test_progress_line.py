"""The progress line of slow calls (relprop/graph/progress_line.py): shown on stderr only when asked
(``progress=True``, ``RELPROP_PROGRESS=1``) or when stderr is a terminal, after a delay; never on
stdout; the numbers are the same with and without it."""
import io
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import relprop
from relprop.graph import progress_line
from relprop.errors import OptionError
from tests import models

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_wanted_follows_the_argument_then_the_environment_then_the_terminal(monkeypatch):
    monkeypatch.delenv(progress_line.ENV, raising=False)
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert progress_line.wanted() is False  # not a terminal: off (tests, CI logs)
    assert progress_line.wanted(True) is True
    monkeypatch.setattr(sys, "stderr", _Terminal())
    assert progress_line.wanted() is True
    assert progress_line.wanted(False) is False
    for value, expected in (("1", True), ("on", True), ("0", False), ("off", False), ("auto", True)):
        monkeypatch.setenv(progress_line.ENV, value)
        assert progress_line.wanted() is expected, value
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    monkeypatch.setenv(progress_line.ENV, "1")
    assert progress_line.wanted() is True


def test_a_call_shorter_than_the_delay_draws_nothing(monkeypatch):
    err = _Terminal()
    monkeypatch.setattr(sys, "stderr", err)
    with progress_line.line("quick", progress=True) as step:  # the default delay: 2 s
        step.update()
    assert err.getvalue() == ""


def test_steps_nest_on_one_line_and_count(monkeypatch):
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.setattr(progress_line, "REFRESH", 0.01)
    with progress_line.line("outer", progress=True, delay=0):
        current = progress_line._LINE.get()
        with progress_line.step("smoothgrad", total=4) as s:
            s.update(3)
            assert [x.text() for x in current.steps] == ["outer", "smoothgrad 3/4"]
            current._draw()  # what the background thread draws
        assert [x.text() for x in current.steps] == ["outer"]
    assert current.shown and "relprop: smoothgrad 3/4" in err.getvalue()
    assert progress_line._LINE.get() is None


@pytest.fixture(scope="module")
def bert():
    return models.hf_bert()


def _explain(model, progress):
    batch = models.text_batch()
    return relprop.explain(model, batch, target=1, method=["transformer_attribution", "smoothgrad"],
                           n_samples=3, seed=0, progress=progress)


def test_explain_with_the_line_forced_on_writes_stderr_only_and_changes_no_number(bert, monkeypatch, capsys):
    monkeypatch.setattr(progress_line, "DELAY", 0.0)  # show at once: the tiny model is fast
    monkeypatch.setattr(progress_line, "REFRESH", 0.001)
    shown = []
    close = progress_line.Line.close
    monkeypatch.setattr(progress_line.Line, "close", lambda self: (close(self), shown.append(self.shown)))
    off = _explain(bert, False)
    out, err = capsys.readouterr()
    assert out == "" and "relprop:" not in err and shown == [False]  # (torch may log its own notes on stderr)
    on = _explain(bert, True)
    out, err = capsys.readouterr()
    assert out == ""
    assert shown[-1] is True and "relprop: " in err and "[00:" in err, err
    for a, b in zip(off, on):
        assert a.method == b.method
        assert torch.equal(a.scores, b.scores)


def test_progress_must_be_none_true_or_false(bert):
    with pytest.raises(OptionError, match="progress='yes' is not a choice"):
        relprop.explain(bert, models.text_batch(), progress="yes")


def test_auto_is_off_when_stderr_is_not_a_terminal():
    """A fresh interpreter whose stderr is a pipe (as in CI), the delay at 0: nothing on stderr; the
    same with RELPROP_PROGRESS=1 draws the line."""
    script = textwrap.dedent("""
        import time
        from relprop.graph import progress_line
        progress_line.DELAY, progress_line.REFRESH = 0.0, 0.01
        with progress_line.line("a slow call"):
            with progress_line.step("smoothgrad", total=3) as s:
                s.update(2)
                bar, start = progress_line._LINE.get(), time.time()
                while bar.show and "2/3" not in getattr(bar._bar, "desc", "") and time.time() < start + 60:
                    time.sleep(0.01)  # until the thread has drawn the step (at once when not shown)
        print("done")
    """)
    env = {k: v for k, v in os.environ.items() if k != progress_line.ENV}
    env["PYTHONPATH"] = ROOT
    runs = [subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=e, cwd=ROOT,
                           timeout=120) for e in (env, dict(env, RELPROP_PROGRESS="1"))]
    assert [(p.returncode, p.stdout) for p in runs] == [(0, "done\n")] * 2, runs[0].stderr[-2000:]
    assert runs[0].stderr == ""
    assert "relprop: smoothgrad 2/3 [00:" in runs[1].stderr
