"""A map whose relevance should not be trusted says so (:mod:`relprop.explanation.relevance_checks`):
relevance the rules amplified while the ledger balances, and a ledger that does not balance."""
from __future__ import annotations

import re
import warnings

import pytest
import torch

import relprop
from relprop.explanation import relevance_checks

from models import hf_bert, text_batch


class _Cancelling(torch.nn.Module):
    """A head whose bias nearly cancels its input for sample 0: logit = w·h + b ≈ 0.05 with w·h ≈ 60."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 2)

    def forward(self, x):
        return self.head(torch.relu(self.lin(x)).mean(1))


def _cancelling():
    m = _Cancelling().eval()
    x = torch.rand(2, 3, 4, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        h = torch.relu(m.lin(x)).mean(1)
        m.head.weight.fill_(100.0)
        m.head.bias.zero_()
        m.head.bias[0] = 0.05 - 100.0 * float(h[0].sum())
    return m, x


def _explain(*args, **kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        e = relprop.explain(*args, **kwargs)
    return e, [str(w.message) for w in caught if issubclass(w.category, relprop.RelpropWarning)]


@pytest.mark.parametrize("fast_path", [None, False])
def test_amplified_relevance_is_a_warning(fast_path):
    m, x = _cancelling()
    e, messages = _explain(m, x, method="lrp", preset="attnlrp", target=0, fast_path=fast_path)
    amplified = [s for s in messages if "the rules amplified it" in s]
    assert len(amplified) == 1 and "sample(s) [0" in amplified[0], messages
    assert amplified[0] in e.notes
    # the reported ratio is the map's own: input relevance over the logit (AttnLRP seeds the logit's value)
    reached = float(e.input_relevance[0].sum())
    logit = float(e.target_scores[0])
    ratio = float(re.search(r"is ([0-9.e+]+)x the relevance injected", amplified[0]).group(1))
    assert ratio == pytest.approx(abs(reached / logit), rel=1e-2)
    assert abs(reached / logit) > relevance_checks.AMPLIFIED
    if fast_path is False:  # the ledger balances, and names the share that cancels the input's
        assert float(e.conservation.error.max()) < 1e-4
        assert "while the ledger balances" in amplified[0] and "by head.bias" in amplified[0]
    else:
        assert "fast_path=False" in amplified[0]


def test_unbalanced_ledger_is_a_warning():
    """Plain LRP (preset 'lrp') on BERT creates relevance it does not book: the warning gives the books."""
    model, x = hf_bert(), text_batch()
    e, messages = _explain(model, x, method="lrp", preset="lrp", target=0)
    unbalanced = [s for s in messages if "does not balance" in s]
    error = e.conservation.error
    assert float(error.max()) > relevance_checks.OPEN
    assert len(unbalanced) == 1 and "preset 'lrp'" in unbalanced[0] and "'attnlrp'" in unbalanced[0]
    first = int(torch.nonzero(error > relevance_checks.OPEN)[0])
    reported = float(re.search(r"relative error ([0-9.e+-]+)\)", unbalanced[0]).group(1))
    assert reported == pytest.approx(float(error[first]), rel=1e-2)


@pytest.mark.parametrize("preset", ["attnlrp", "cp_lrp"])
def test_balanced_relevance_says_nothing(preset):
    model, x = hf_bert(), text_batch()
    for fast_path in (None, False):
        e, messages = _explain(model, x, method="lrp", preset=preset, target=0, fast_path=fast_path)
        assert not [s for s in messages if "balance" in s or "amplified" in s], messages


def test_injected_relevance_of_the_fast_path_is_the_ledgers(monkeypatch):
    """The fast path books no ledger; the relevance its seed injects (Trace.injected) is what the walk's
    ledger books as injected."""
    model, x = hf_bert(), text_batch()
    captured = []
    original = relevance_checks.check

    def spy(method, preset, trace, input_relevance, notes):
        captured.append(trace.conservation.injected if trace.conservation is not None else trace.injected)
        return original(method, preset, trace, input_relevance, notes)

    monkeypatch.setattr(relevance_checks, "check", spy)
    _explain(model, x, method="lrp", preset="attnlrp", target=0)
    _explain(model, x, method="lrp", preset="attnlrp", target=0, fast_path=False)
    fast, walked = captured
    assert torch.allclose(fast, walked, rtol=1e-5, atol=1e-6)
