"""Swin (timm and HuggingFace), unmodified: window attention mapped onto the token grid of each
stage, patch merging between stages, the pooled output as the query, the window ops' rules
. Tiny random models: 32x32 images, patch 4 (8x8 then 4x4 tokens), windows of 2x2."""
import copy

import pytest
import torch
import torch.nn.functional as F

import models
import relprop
from relprop.methods.method_registry import all_methods
from relprop.methods.windowed import applicable_methods
from relprop.rules import rule_registry as registry
from relprop.rules.context import RuleContext
from snapshot import assert_same, snapshot

aten = torch.ops.aten
NAMES = list(models.SWIN)
#: applicable methods that re-run the model many times get few samples here
FAST = dict(n_samples=2, n_steps=2)


@pytest.fixture(scope="module")
def swin():
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = models.SWIN[name]()
        return cache[name]
    return get


def _grid(model):
    if hasattr(model, "config"):
        return model.config.image_size // 4
    return model.patch_embed.grid_size[0]


# ------------------------------------------------------------------ the window map, from the paper

def window_reference(attn, batch, grid, window, shift):
    """Global [batch, heads, L, L] map of window attention ``attn`` [batch·windows, heads, M², M²]
    written from Swin's definition (Liu et al. 2021, §3.2): the grid is rolled by -shift, cut into
    windows in raster order, and token k = i·M + j of window (wr, wc) is grid cell
    ((wr·M + i + shift) mod H, (wc·M + j + shift) mod W)."""
    h = w = grid
    nwr, nwc = h // window, w // window
    heads = attn.shape[1]
    out = torch.zeros(batch, heads, h * w, h * w)
    for b in range(batch):
        for wr in range(nwr):
            for wc in range(nwc):
                win = attn[b * nwr * nwc + wr * nwc + wc]
                cells = [((wr * window + i + shift) % h) * w + (wc * window + j + shift) % w
                         for i in range(window) for j in range(window)]
                for a, p in enumerate(cells):
                    for c, q in enumerate(cells):
                        out[b, :, p, q] = win[:, a, c]
    return out


def test_window_attention_on_the_grid_matches_swin_definition():
    """Each block's global attention is its eager window attention put back onto the grid by the
    paper's shifted-window partition (blocks 1 and 3 are shifted by one token)."""
    model = models.timm_swin(fused=False)
    x = models.swin_images(model, 2)
    eager = []
    hooks = [blk.attn.softmax.register_forward_hook(lambda m, i, o: eager.append(o.detach()))
             for layer in model.layers for blk in layer.blocks]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in hooks:
            h.remove()
    e = relprop.explain(model, x, target=1, method="raw_attention")
    grids = [8, 8, 4, 4]
    shifts = [blk.shift_size[0] for layer in model.layers for blk in layer.blocks]
    assert shifts == [0, 1, 0, 1]
    for rec, a, g, s in zip(e.blocks, eager, grids, shifts):
        ref = window_reference(a, 2, g, 2, s)
        assert rec.attention.shape == ref.shape
        assert (rec.attention - ref).abs().max() < 1e-6, rec.name
        # every token's row is one softmax over its window: sums to 1
        assert torch.allclose(rec.attention.sum(-1), torch.ones(2, ref.shape[1], g * g), atol=1e-5)


@pytest.mark.parametrize("name", NAMES)
def test_gradient_and_relevance_sit_where_the_attention_is(swin, name):
    """dA and R_A are mapped like A: non-zero only inside shared windows; A's rows sum to 1 (HF too,
    and with the padded grid, whose padding rows/columns are dropped)."""
    model = swin(name)
    e = relprop.explain(model, models.swin_images(model), target=1, method="transformer_attribution")
    assert e.blocks[0].attention.shape[-1] == _grid(model) ** 2
    for rec in e.blocks:
        outside = rec.attention == 0
        assert (rec.gradient[outside] == 0).all() and (rec.relevance[outside] == 0).all()
        rows = rec.attention.sum(-1)
        if name != "hf_swin_padded":
            assert torch.allclose(rows, torch.ones_like(rows), atol=1e-5)
        else:  # padding keys took part of each window's softmax
            assert (rows <= 1 + 1e-5).all() and (rows > 0).all()


@pytest.mark.parametrize("name", ["timm_swin", "hf_swin"])
def test_patch_merging_matrix_matches_2x2_grouping(swin, name):
    """The stage link is D[j, i] = 1/4 for the 2x2 tokens i merged into token j (Swin §3.1)."""
    model = swin(name)
    e = relprop.explain(model, models.swin_images(model), target=0, method="transformer_attribution")
    from relprop.engine import Request, execute
    from relprop.graph.capture import CACHE
    from relprop.graph.inputs import bind_inputs
    from relprop.targets import resolve
    kwargs = bind_inputs(model, models.swin_images(model))
    trace = execute(Request(CACHE.get(model, kwargs), model, kwargs, resolve(0, 2)))
    assert trace.stages.tokens == [64, 64, 16, 16] and set(trace.stages.links) == {1}
    ref = torch.zeros(16, 64)
    for r in range(8):
        for c in range(8):
            ref[(r // 2) * 4 + c // 2, r * 8 + c] = 0.25
    assert torch.equal(trace.stages.links[1], ref)
    assert e.scores.shape == (2, 64)


# ------------------------------------------------------------------ methods

@pytest.mark.parametrize("name", NAMES)
def test_every_applicable_method_runs(swin, name):
    model = swin(name)
    x = models.swin_images(model)
    methods = applicable_methods()
    assert {"transformer_attribution", "rollout", "gradient_rollout", "lrp", "raw_attention"} <= set(methods)
    exps = relprop.explain(model, x, target=[0, 1], method=methods, **FAST)
    g = _grid(model)
    for e in exps:
        assert e.scores.shape == (2, g * g), e.method
        assert e.map.shape == (2,) + tuple(x.shape[-2:]), e.method
        assert torch.isfinite(e.scores).all() and torch.isfinite(e.map).all(), e.method


@pytest.mark.parametrize("method", sorted(n for n, m in all_methods().items() if m.no_windows is not None))
def test_methods_that_do_not_apply_say_so(swin, method):
    model = swin("timm_swin")
    expected = "does not apply.*windows.*Methods that apply to SwinTransformer: .*transformer_attribution"
    with pytest.raises(relprop.MethodError, match=expected) as info:
        relprop.explain(model, models.swin_images(model), target=0, method=method)
    listed = str(info.value).split("Methods that apply to SwinTransformer:")[1]
    assert repr(method) not in listed  # the list names only methods that run on this model


def test_transformer_attribution_rolls_out_across_stages(swin):
    """Reference from Eq. 13-14 with the stage step: C = (I+M3)(I+M2) D (I+M1)(I+M0),
    scores = mean of C's rows (the pooled output) on the 8x8 grid under identity="keep"; the default
    leaves out the identity path's share, the mean of P = I I D I I = D's rows."""
    model = swin("hf_swin")
    keep = relprop.explain(model, models.swin_images(model), target=3, identity="keep")
    e = relprop.explain(model, models.swin_images(model), target=3)
    m = [(b.gradient * b.relevance).clamp(min=0).mean(1).double() for b in keep.blocks]
    d = torch.zeros(16, 64, dtype=torch.float64)
    for r in range(8):
        for c in range(8):
            d[(r // 2) * 4 + c // 2, r * 8 + c] = 0.25
    i64, i16 = torch.eye(64, dtype=torch.float64), torch.eye(16, dtype=torch.float64)
    c = (i16 + m[3]) @ (i16 + m[2]) @ d @ (i64 + m[1]) @ (i64 + m[0])
    assert torch.allclose(keep.scores.double(), c.mean(1), atol=1e-6)
    # the blocks' terms (~1e-8 on this random model) kept to float32's relative precision, not lost under 1/64
    torch.testing.assert_close(e.scores.double(), (c - d).mean(1), rtol=1e-4, atol=1e-13)
    # a single block of the last stage: its pooled row shared by the 4 tokens each one merges
    last = relprop.explain(model, models.swin_images(model), target=3, method="raw_attention")
    row = e.blocks[3].attention.mean(1).mean(1)  # [2, 16]
    assert torch.allclose(last.scores, row @ d.float(), atol=1e-6)


# ------------------------------------------------------------------ engine properties

def _zero_biases(model):
    model = copy.deepcopy(model)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("bias") or n.endswith("bias_table"):
                p.zero_()
    return model


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("bias_free", [False, True])
def test_conservation(swin, name, bias_free):
    """Input + absorbed = injected (Eq. 3, Lemmas 1-2), per sample and per block, < 1e-4."""
    model = _zero_biases(swin(name)) if bias_free else swin(name)
    e = relprop.explain(model, models.swin_images(model), target=2)
    c = e.conservation
    assert torch.allclose(c.injected, torch.ones(2))
    assert float(c.error.max()) < 1e-4, c
    assert len(c.blocks) == 4
    for b in c.blocks:
        assert float(b.error.max()) < 1e-4, b.name
    if bias_free:
        assert "relative_position" not in " ".join(k for k, v in c.absorbed_by.items() if float(v.abs().max()) > 0)


@pytest.mark.parametrize("name", NAMES)
def test_batch_invariance(swin, name):
    """A batch explains like each image alone (< 1e-5), the padded grid included."""
    model = swin(name)
    x = models.swin_images(model, batch=3, seed=4)
    full = relprop.explain(model, x, target=[0, 1, 2], method=["transformer_attribution", "rollout"])
    for i in range(3):
        alone = relprop.explain(model, x[i:i + 1], target=i, method=["transformer_attribution", "rollout"])
        for f, a in zip(full, alone):
            assert (f.scores[i] - a.scores[0]).abs().max() < 1e-5, f.method
        assert (full[0].conservation.input[i] - alone[0].conservation.input[0]).abs() < 1e-5


@pytest.mark.parametrize("name", ["timm_swin", "hf_swin"])
@pytest.mark.parametrize("method", ["ta_last_block", "lrp", "transformer_attribution"])
def test_class_specific(swin, name, method):
    """The maps depend on the target class. (At timm's initialization, std 0.02, the attention is
    almost uniform and the rollout's identity dominates: Transformer Attribution differs by ~1e-8
    between classes there, so the comparison is relative to each map's own variation.)"""
    model = swin(name)
    x = models.swin_images(model)
    a, b = (relprop.explain(model, x, target=t, method=method).scores for t in (0, 4))
    spread = (a - a.mean(-1, keepdim=True)).abs().max()
    assert (a - b).abs().max() > 0.05 * spread > 0


@pytest.mark.parametrize("name", ["timm_swin", "hf_swin"])
def test_model_untouched(swin, name):
    model = swin(name)
    before = snapshot(model)
    relprop.explain(model, models.swin_images(model), target=1, method=["transformer_attribution", "lrp"])
    with pytest.raises(relprop.MethodError):
        relprop.explain(model, models.swin_images(model), target=1, method="value_zeroing")
    assert_same(before, snapshot(model))


# ------------------------------------------------------------------ rules of the window ops

def _ctx(op, args, live=None, kwargs=None):
    out = op(*args, **(kwargs or {}))
    live = live or tuple(torch.is_tensor(a) for a in args)
    return RuleContext(node=type("N", (), {"target": op, "name": "n", "meta": {}})(), args=tuple(args),
                       kwargs=kwargs or {}, out=out, live=live, batch_dim=0, batch_size=args[0].shape[0])


def _route_reference(x_shape, index_of):
    """Adjoint of an index map written as loops: R_x[src] += R_out[dst] for every output element
    ``dst`` copied from ``src = index_of(dst)`` (None: the element is a constant)."""
    def back(rel):
        rx = torch.zeros(x_shape, dtype=torch.float64)
        rc = 0.0
        for dst in torch.cartesian_prod(*[torch.arange(s) for s in rel.shape]).reshape(-1, rel.dim()).tolist():
            src = index_of(tuple(dst))
            if src is None:
                rc += float(rel[tuple(dst)])
            else:
                rx[src] += rel[tuple(dst)]
        return rx, rc
    return back


@pytest.mark.parametrize("pad", [[1, 2], [0, 0, 1, 1, 0, 0], [1, 0, -1, 2]])
def test_constant_pad_rule_matches_reference(pad):
    x = torch.randn(2, 3, 4)
    out = F.pad(x, pad)
    rel = torch.randn(out.shape, dtype=torch.float64)
    fn = registry.lookup("chefer2021", aten.constant_pad_nd.default)
    rx, _, rpad = fn(_ctx(aten.constant_pad_nd.default, (x, pad, 0.0), live=(True, False, False)), rel)
    pads = [(pad[2 * k], pad[2 * k + 1]) for k in range(len(pad) // 2)]  # last dim first

    def index_of(dst):
        src = list(dst)
        for k, (lo, _) in enumerate(pads):
            d = x.dim() - 1 - k
            src[d] = dst[d] - lo
            if not 0 <= src[d] < x.shape[d]:
                return None
        return tuple(src)
    ref_x, ref_c = _route_reference(x.shape, index_of)(rel)
    assert torch.allclose(rx.double(), ref_x) and abs(float(rpad.sum()) - ref_c) < 1e-9
    assert abs(float(rx.sum() + rpad.sum() - rel.sum())) < 1e-9 or any(p < 0 for p in pad)


@pytest.mark.parametrize("shifts, dims", [([1, -2], [1, 2]), ([3], [0]), ([5], [])])
def test_roll_rule_matches_reference(shifts, dims):
    x = torch.randn(3, 4, 5)
    rel = torch.randn(3, 4, 5, dtype=torch.float64)
    fn = registry.lookup("chefer2021", aten.roll.default)
    (rx, *_) = fn(_ctx(aten.roll.default, (x, shifts, dims), live=(True, False, False)), rel)
    if dims:
        def index_of(dst):
            src = list(dst)
            for s, d in zip(shifts, dims):
                src[d] = (dst[d] - s) % x.shape[d]
            return tuple(src)
    else:
        def index_of(dst):
            flat = ((dst[0] * 4 + dst[1]) * 5 + dst[2] - shifts[0]) % 60
            return (flat // 20, (flat // 5) % 4, flat % 5)
    ref, _ = _route_reference(x.shape, index_of)(rel)
    assert torch.allclose(rx.double(), ref)


@pytest.mark.parametrize("op, args, index_of", [
    # overlapping sliding windows: unfold(dim=1, size=3, step=1) of [2, 5] -> [2, 3, 3]
    (aten.unfold.default, (1, 3, 1), lambda d: (d[0], d[1] + d[2])),
    # as_strided reading every other element of a [2, 6] tensor as [2, 3]
    (aten.as_strided.default, ([2, 3], [6, 2]), lambda d: (d[0], 2 * d[1])),
    (aten.flip.default, ([1],), lambda d: (d[0], 5 - d[1])),
])
def test_strided_view_rules_match_reference(op, args, index_of):
    x = torch.randn(2, 6 if op is not aten.unfold.default else 5)
    out = op(x, *args)
    rel = torch.randn(out.shape, dtype=torch.float64)
    fn = registry.lookup("chefer2021", op)
    (rx, *_) = fn(_ctx(op, (x,) + args, live=(True,) + (False,) * len(args)), rel)
    ref, _ = _route_reference(x.shape, index_of)(rel)
    assert torch.allclose(rx.double(), ref)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("preset", ["chefer2021", "lrp"])
def test_every_op_on_the_relevance_path_has_a_rule(swin, name, preset):
    """No op of the captured Swin graph lacks a rule (what the coverage report calls 'missing')."""
    from relprop.graph.capture import CACHE
    from relprop.graph.inputs import bind_inputs
    from relprop.engine.walk import check_rules
    model = swin(name)
    check_rules(CACHE.get(model, bind_inputs(model, models.swin_images(model))), preset, "error")
