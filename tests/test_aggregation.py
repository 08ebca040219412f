"""Aggregation as hyperparameters (the survey's §1.2–1.4): head fusion, positive part, discard ratio,
block range and layer aggregation of every rollout-style method, each checked against a slow
reference written from the formulas (plain-Python loops over blocks, heads and tokens, float64) on
the per-block records A, dA, R_A the explanation exposes; options are checked once (OptionError)."""
import itertools
import math

import pytest
import torch

import models
import relprop

METHODS = ["raw_attention", "rollout", "gradient_rollout", "transformer_attribution"]
DEFAULTS = {  # (positive, layers, normalize_rows) of each method's paper
    "raw_attention": (False, "last", False), "rollout": (False, "rollout", True),
    "gradient_rollout": (True, "rollout", False), "transformer_attribution": (True, "rollout", False)}


def head_map(name, rec, h, r, c):
    A, G, R = rec
    if name in ("raw_attention", "rollout"):
        return A[h][r][c]
    if name == "gradient_rollout":
        return G[h][r][c] * A[h][r][c]
    return G[h][r][c] * R[h][r][c]


def ref_fused(name, rec, fusion, positive, n):
    A, G, R = rec
    H = len(A)
    out = [[0.0] * n for _ in range(n)]
    for r in range(n):
        for c in range(n):
            vals = []
            for h in range(H):
                v = head_map(name, rec, h, r, c)
                if fusion == "gradient":
                    v = G[h][r][c] * v
                if positive:
                    v = max(v, 0.0)
                vals.append(v)
            out[r][c] = {"mean": sum(vals) / H, "gradient": sum(vals) / H, "max": max(vals), "min": min(vals)}[fusion]
    return out


def ref_discard(m, ratio, keep):
    n = len(m)
    entries = sorted(((m[r][c], r * n + c) for r in range(n) for c in range(n) if not (r == c and r in keep)))
    k = min(int(ratio * n * n), len(entries))
    out = [row[:] for row in m]
    for _, idx in entries[:k]:
        out[idx // n][idx % n] = 0.0
    return out


def ref_aggregate(name, recs, fusion, positive, discard, start, end, layers, last_k, normalize, keep):
    B = len(recs)
    s = start + B if start < 0 else start
    e = B if end is None else (end + B if end < 0 else end)
    blocks = list(range(s, e))
    if layers == "last":
        blocks = blocks[-last_k:]
    n = len(recs[0][0][0])
    maps = [ref_fused(name, recs[b], fusion, positive, n) for b in blocks]
    if discard:
        maps = [ref_discard(m, discard, keep) for m in maps]
    if layers == "rollout":
        joint = [[float(r == c) for c in range(n)] for r in range(n)]
        for m in maps:
            a = [[m[r][c] + (r == c) for c in range(n)] for r in range(n)]
            if normalize:
                a = [[v / sum(row) for v in row] for row in a]
            joint = [[sum(a[r][j] * joint[j][c] for j in range(n)) for c in range(n)] for r in range(n)]
        return joint
    total = [[sum(m[r][c] for m in maps) for c in range(n)] for r in range(n)]
    return total if layers == "sum" else [[v / len(maps) for v in row] for row in total]


def records(e, i):
    return [(b.attention[i].double().tolist(), b.gradient[i].double().tolist(),
             b.relevance[i].double().tolist() if b.relevance is not None else None) for b in e.blocks]


@pytest.fixture(scope="module")
def vit():
    model = models.timm_vit_tiny()
    return model, models.image_batch(model, batch=1)


def _check(model, x, name, opts):
    e = relprop.explain(model, x, target=1, method=name, **opts)
    pos, layers, norm = DEFAULTS[name]
    o = dict(head_fusion="mean", positive=pos, discard_ratio=0.0, start_block=0, end_block=None, layers=layers,
             last_k=1, normalize_rows=norm)
    o.update(opts)
    ref = ref_aggregate(name, records(e, 0), o["head_fusion"], o["positive"], o["discard_ratio"], o["start_block"],
                        o["end_block"], o["layers"], o["last_k"], o["normalize_rows"], keep={0})
    ref = torch.tensor(ref, dtype=torch.float64)
    got = e.matrix[0].double()
    scale = float(ref.abs().max()) or 1.0
    assert torch.allclose(got, ref, rtol=1e-4, atol=1e-6 * scale), (name, opts)
    assert torch.allclose(e.scores[0].double(), ref[0, e.prefix_tokens:], rtol=1e-4, atol=1e-6 * scale), (name, opts)


SETTINGS = [dict(head_fusion=f) for f in ("max", "min", "gradient")] + [
    dict(positive=True), dict(positive=False), dict(discard_ratio=0.5), dict(start_block=1), dict(start_block=-1),
    dict(end_block=1), dict(layers="sum"), dict(layers="last", last_k=2), dict(layers="rollout"),
    dict(head_fusion="max", discard_ratio=0.9, normalize_rows=True)]


@pytest.mark.parametrize("name", METHODS)
def test_aggregation_options_match_reference(vit, name):
    """Each aggregation option alone (and max fusion with 90% discarded) equals the loop reference."""
    model, x = vit
    for opts in SETTINGS:
        _check(model, x, name, opts)


@pytest.mark.slow
def test_aggregation_grid_matches_reference(vit):
    """Every combination of head fusion x positive x discard x range x layer aggregation equals the
    loop reference, for every rollout-style method."""
    model, x = vit
    grid = itertools.product(METHODS, ("mean", "max", "min", "gradient"), (False, True), (0.0, 0.3),
                             ((0, None), (1, None), (0, -1)), ("rollout", "sum", "last"))
    for name, fusion, pos, disc, (s, e), layers in grid:
        _check(model, x, name, dict(head_fusion=fusion, positive=pos, discard_ratio=disc, start_block=s,
                                    end_block=e, layers=layers))


def test_defaults_are_the_papers(vit):
    """Spelled-out defaults give exactly the default explanation (bit-identical)."""
    model, x = vit
    for name in METHODS:
        pos, layers, norm = DEFAULTS[name]
        a = relprop.explain(model, x, target=1, method=name)
        b = relprop.explain(model, x, target=1, method=name, head_fusion="mean", positive=pos, discard_ratio=0.0,
                            start_block=0, end_block=None, layers=layers, last_k=1, normalize_rows=norm)
        assert torch.equal(a.scores, b.scores) and torch.equal(a.matrix, b.matrix), name
    # raw attention is rollout's block map: the last block alone; rollout over one block is I + E_h A
    r = relprop.explain(model, x, target=1, method="raw_attention")
    last = relprop.explain(model, x, target=1, method="rollout", layers="last")
    assert torch.equal(r.matrix, last.matrix)


def test_discard_keeps_the_query_entry_and_drops_the_fraction(vit):
    model, x = vit
    e = relprop.explain(model, x, target=1, method="raw_attention", discard_ratio=0.75)
    m = e.matrix[0]
    n = m.shape[-1]
    assert int((m == 0).sum()) >= math.floor(0.75 * n * n)
    assert float(m[0, 0]) > 0


@pytest.mark.parametrize("opts, match", [
    (dict(head_fusion="median"),
     r"head_fusion='median' is not a choice. Choices: \['mean', 'max', 'min', 'gradient'\]"),
    (dict(layers="product"), r"Choices: \['rollout', 'sum', 'last'\]"),
    (dict(discard_ratio=1.0), r"discard_ratio=1.0 is not a choice"),
    (dict(positive="yes"), r"Choices: \[True, False\]"),
    (dict(last_k=0), r"last_k=0"),
    (dict(start_block=1.5), r"start_block=1.5"),
])
def test_bad_aggregation_options(vit, opts, match):
    model, x = vit
    with pytest.raises(relprop.OptionError, match=match):
        relprop.explain(model, x, target=1, method="rollout", **opts)


def test_block_range_errors(vit):
    model, x = vit
    with pytest.raises(relprop.MethodError, match=r"start_block=2 out of range: the model has blocks 0..1"):
        relprop.explain(model, x, target=1, method="rollout", start_block=2)
    with pytest.raises(relprop.MethodError, match=r"end_block=1 out of range"):
        relprop.explain(model, x, target=1, method="rollout", start_block=1, end_block=1)
    with pytest.raises(relprop.MethodError, match=r"last_k=3 is more than the 2 blocks"):
        relprop.explain(model, x, target=1, method="rollout", layers="last", last_k=3)
    with pytest.raises(relprop.OptionError, match=r"Choices: \['all'\]"):
        relprop.explain(model, x, target=1, method="value_zeroing", head_fusion="mean")
