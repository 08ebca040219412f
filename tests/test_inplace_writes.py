"""In-place writes in a model's forward (``out[:, 1:] = h``, ``scores[..., 0] = ...``, a recurrent state
written step by step) are exported as ``aten.copy`` + ``slice_scatter`` / ``select_scatter``; relprop
explains them through their functional form (:func:`relprop.graph.decompositions.copy_functional`),
for gradient methods, rollouts and LRP, checked against autograd and a hand rollout."""
from __future__ import annotations

import warnings

import pytest
import torch

import relprop


class SliceWrites(torch.nn.Module):
    """Writes a slice and a column of a fresh tensor, then reads the whole."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 3)

    def forward(self, x):
        h = self.a(x)
        out = torch.zeros_like(h)
        out[:, 1:] = h[:, 1:] * 2
        out[:, 0] = h[:, 0]
        return self.b(out.mean(1))


class SteppedRNN(torch.nn.Module):
    """A recurrent cell whose states are written into a preallocated tensor step by step."""

    def __init__(self):
        super().__init__()
        self.cell = torch.nn.RNNCell(4, 5)
        self.head = torch.nn.Linear(5, 3)

    def forward(self, x):
        b, t, _ = x.shape
        states = x.new_zeros(b, t, 5)
        h = x.new_zeros(b, 5)
        for i in range(t):
            h = self.cell(x[:, i], h)
            states[:, i] = h
        return self.head(states.mean(1))


class WrittenScores(torch.nn.Module):
    """One self-attention whose scores are changed in place before the softmax (a slice assignment, as
    MViTv2's and Funnel's attention do), mean-pooled."""

    def __init__(self, d=8):
        super().__init__()
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.proj = torch.nn.Linear(d, d)
        self.head = torch.nn.Linear(d, 3)

    def attention(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
        scores[:, 1:, 1:] = scores[:, 1:, 1:] * 0.5
        return scores.softmax(-1), v

    def forward(self, x):
        a, v = self.attention(x)
        h = x + self.proj(a @ v)
        return self.head(h.mean(1))


def _explain(model, x, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return relprop.explain(model, x, target=1, **kw)


def _gradient_x_input(model, x):
    x = x.clone().requires_grad_(True)
    model(x)[:, 1].sum().backward()
    return (x.grad * x).sum(-1)


@pytest.mark.parametrize("cls", [SliceWrites, SteppedRNN, WrittenScores])
def test_gradient_methods_through_writes(cls):
    torch.manual_seed(0)
    model = cls().eval()
    x = torch.randn(2, 5, 8 if cls is WrittenScores else 4, generator=torch.Generator().manual_seed(1))
    e = _explain(model, x, method="input_x_gradient")
    assert torch.allclose(e.scores, _gradient_x_input(model, x), atol=1e-5)


@pytest.mark.parametrize("cls", [SliceWrites, SteppedRNN, WrittenScores])
@pytest.mark.parametrize("preset", ["attnlrp", "cp_lrp"])
def test_lrp_through_writes_conserves(cls, preset):
    """The writes route relevance (the overwritten elements get none, the written ones their source's):
    the ledger closes, on the rule walk and on the fast path alike."""
    torch.manual_seed(0)
    model = cls().eval()
    x = torch.randn(2, 5, 8 if cls is WrittenScores else 4, generator=torch.Generator().manual_seed(2))
    walked = _explain(model, x, method="lrp", preset=preset, fast_path=False)
    assert float(walked.conservation.error.max()) < 1e-4
    fast = _explain(model, x, method="lrp", preset=preset)
    assert torch.allclose(fast.scores, walked.scores, atol=1e-5, rtol=1e-4)
    if cls is SliceWrites:  # a linear model: AttnLRP's ε-rules give gradient × input exactly
        assert torch.allclose(walked.scores, _gradient_x_input(model, x), atol=1e-5)


def test_rollout_of_written_scores_is_the_models_attention():
    """The attention block behind the written scores is found, and its map is the model's own."""
    torch.manual_seed(0)
    model = WrittenScores().eval()
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(3))
    e = _explain(model, x, method="raw_attention")
    with torch.no_grad():
        a, _ = model.attention(x)
    assert len(e.blocks) == 1
    assert torch.allclose(e.blocks[0].attention.reshape(a.shape), a, atol=1e-6)
    r = _explain(model, x, method="rollout", identity="keep")
    hand = 0.5 * a + 0.5 * torch.eye(5)  # one block: Abnar & Zuidema's ½(A + I), mean-pooled query
    hand = hand / hand.sum(-1, keepdim=True)
    assert torch.allclose(r.scores, hand.mean(1), atol=1e-5)
