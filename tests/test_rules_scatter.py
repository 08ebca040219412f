"""Rules for writes into a tensor and for homogeneous reductions (relprop/rules/scatter.py), against slow
references written from their formulas with Python loops, with conservation, and end to end: the
interpreter and the one-backward fast path give the same relevance, which conserves.

* ``index_put`` (``x[mask] = v``, Wav2Vec2's masked frames; ``x[idx] += v``, F.fold), ``slice_scatter``,
  ``select_scatter``: every element's relevance goes to where it came from (writes), or the z-rule of the
  sum (accumulate);
* ``linalg_vector_norm``, ``amax``/``amin``, ``max.dim``/``min.dim``: R_i = x_i ∂f/∂x_i · R / f, exact by
  Euler's theorem (|x_i|^p / Σ|x|^p · R for a p-norm; all of R to the maximum).
"""
from __future__ import annotations

import itertools

import pytest
import torch

import relprop
from rule_helpers import make_ctx, rand, rule_of, sdiv

aten = torch.ops.aten
PRESETS = ["chefer2021", "lrp", "attnlrp"]


def _shares(op, args, live, relevance, preset):
    out = op(*args)
    ctx = make_ctx(op, args, out, live, preset=preset)
    return rule_of(op, preset)(ctx, relevance), out


@pytest.mark.parametrize("preset", PRESETS)
def test_index_put_boolean_write_routes_every_element_back(preset):
    x = rand((2, 5, 3), 0)
    mask = torch.tensor([[True, False, False, True, False], [False, False, True, False, False]])
    v = rand((3,), 1)  # one vector written into every masked frame (Wav2Vec2's masked_spec_embed)
    r = rand((2, 5, 3), 2)
    (rx, _, rv, *_), _ = _shares(aten.index_put.default, (x, [mask], v), (True, False, True), r, preset)
    want_x = torch.zeros_like(x)
    want_v = torch.zeros_like(v)
    for b, t, c in itertools.product(range(2), range(5), range(3)):
        if mask[b, t]:
            want_v[c] += float(r[b, t, c])
        else:
            want_x[b, t, c] = float(r[b, t, c])
    assert torch.allclose(rx, want_x) and torch.allclose(rv, want_v)
    assert torch.allclose(rx.sum() + rv.sum(), r.sum())  # conservation


@pytest.mark.parametrize("preset", PRESETS)
def test_index_put_accumulate_is_the_z_rule_of_the_sum(preset):
    x = rand((6,), 3)
    idx = torch.tensor([0, 2, 2, 5])
    v = rand((4,), 4)
    r = rand((6,), 5)
    (rx, _, rv, *_), y = _shares(aten.index_put.default, (x, [idx], v, True), (True, False, True, False), r, preset)
    want_x = [float(x[i]) * sdiv(float(r[i]), float(y[i])) for i in range(6)]
    want_v = [float(v[k]) * sdiv(float(r[idx[k]]), float(y[idx[k]])) for k in range(4)]
    assert torch.allclose(rx, torch.tensor(want_x, dtype=rx.dtype), atol=1e-6)
    assert torch.allclose(rv, torch.tensor(want_v, dtype=rv.dtype), atol=1e-6)
    assert abs(float(rx.sum() + rv.sum() - r.sum())) < 1e-5 * float(r.abs().sum())


def test_slice_and_select_scatter_route_back():
    x, src = rand((3, 7), 6), rand((3, 2), 7)
    r = rand((3, 7), 8)
    (rx, rs, *_), _ = _shares(aten.slice_scatter.default, (x, src, 1, 2, 6, 2), (True, True), r, "chefer2021")
    for i, j in itertools.product(range(3), range(7)):
        written = j in (2, 4)
        assert float(rx[i, j]) == (0.0 if written else float(r[i, j]))
        if written:
            assert float(rs[i, (j - 2) // 2]) == float(r[i, j])
    assert torch.allclose(rx.sum() + rs.sum(), r.sum())
    (rx, rs, *_), _ = _shares(aten.select_scatter.default, (x, rand((3,), 9), 1, 4), (True, True), r, "chefer2021")
    assert torch.equal(rs, r[:, 4]) and bool((rx[:, 4] == 0).all()) and torch.equal(rx[:, :4], r[:, :4])


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("p", [2.0, 1.0, 3.0])
def test_vector_norm_shares_are_powers_of_the_elements(preset, p):
    x = rand((2, 4, 5), 10)
    r = rand((2, 4), 11)
    (rx, *_), _ = _shares(aten.linalg_vector_norm.default, (x, p, [-1]), (True, False, False), r, preset)
    for b, t in itertools.product(range(2), range(4)):
        total = sum(abs(float(x[b, t, i])) ** p for i in range(5))
        for i in range(5):
            want = abs(float(x[b, t, i])) ** p / total * float(r[b, t])
            assert abs(float(rx[b, t, i]) - want) < 1e-5 * abs(float(r[b, t])) + 1e-7
    assert torch.allclose(rx.sum(-1), r.to(rx.dtype), rtol=1e-5, atol=1e-6)  # Euler: exactly R


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("op", [aten.amax.default, aten.amin.default, aten.max.dim, aten.min.dim])
def test_max_and_min_give_all_relevance_to_the_extreme(preset, op):
    x = rand((3, 6), 12)
    x[1, 2] = x[1, 4] = x[1].max() + 1.0  # a tie in row 1 (for max)
    x[2, 0] = x[2, 3] = x[2].min() - 1.0  # and in row 2 (for min)
    r = rand((3,), 13)
    args = (x, [1]) if op in (aten.amax.default, aten.amin.default) else (x, 1)
    rel = r if op in (aten.amax.default, aten.amin.default) else [r, None]
    (rx, *_), _ = _shares(op, args, (True, False), rel, preset)
    pick = max if op in (aten.amax.default, aten.max.dim) else min
    index = None if op in (aten.amax.default, aten.amin.default) else op(x, 1)[1]
    for b in range(3):
        best = pick(float(v) for v in x[b])
        # amax/amin split a tie evenly (their gradient does); max.dim/min.dim give it to the index they return
        winners = [j for j in range(6) if float(x[b, j]) == best] if index is None else [int(index[b])]
        for j in range(6):
            want = float(r[b]) / len(winners) if j in winners else 0.0
            assert abs(float(rx[b, j]) - want) < 1e-6, (b, j)
    assert torch.allclose(rx.sum(-1), r.to(rx.dtype), atol=1e-6)


class Writes(torch.nn.Module):
    """Every op of relprop/rules/scatter.py on the relevance path: a boolean write (Wav2Vec2), a slice
    write into a longer buffer, a p-norm, a maximum and max.dim, feeding a linear head."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(4, 4)
        self.fill = torch.nn.Parameter(torch.randn(4))
        self.head = torch.nn.Linear(13, 3)

    def forward(self, x, frame_mask):
        h = self.proj(x)
        h = h.clone()
        h[frame_mask] = self.fill                               # index_put with a boolean mask
        buf = torch.zeros(h.shape[0], h.shape[1] + 2, 4, dtype=h.dtype)
        buf = torch.slice_scatter(buf, h, 1, 1, h.shape[1] + 1)  # slice_scatter
        norms = torch.linalg.vector_norm(buf, dim=-1)           # [batch, T + 2]
        top = buf.amax(dim=1)                                   # [batch, 4]
        low = buf.min(dim=1).values                             # max.dim / min.dim
        return self.head(torch.cat([norms[:, :5], top, low], -1))


def test_end_to_end_interpreter_and_fast_path_agree_and_conserve():
    model = Writes().eval()
    x = torch.randn(2, 5, 4, generator=torch.Generator().manual_seed(1))
    mask = torch.tensor([[False, True, False, False, True], [False, False, False, True, False]])
    slow = relprop.explain(model, {"x": x, "frame_mask": mask}, method="lrp", preset="attnlrp", fast_path=False,
                           target=1)
    fast = relprop.explain(model, {"x": x, "frame_mask": mask}, method="lrp", preset="attnlrp", target=1)
    assert torch.allclose(slow.scores, fast.scores, atol=1e-5 * float(slow.scores.abs().max()))
    assert float(slow.conservation.error.max()) < 1e-4
    z = relprop.explain(model, {"x": x, "frame_mask": mask}, method="lrp", target=1)  # the paper's rules
    assert torch.isfinite(z.scores).all()
