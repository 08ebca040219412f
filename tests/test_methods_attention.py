"""The attention baselines of the CVPR 2021 paper (its Table-3 ablations, lrp, partial_lrp,
raw_attention, rollout, attention_gradcam) and the ICCV 2021 gradient rollout, each checked against
a slow reference written from its formula: plain-Python loops over samples, blocks, heads and
tokens in float64 on the per-block records A, dA, R_A the explanation exposes."""
import pytest
import timm
import torch

import models
import relprop

METHODS = ["ta_without_gradient", "ta_last_block", "ta_second_block", "lrp", "partial_lrp", "raw_attention",
           "rollout", "attention_gradcam", "gradient_rollout"]
AGNOSTIC = {"raw_attention", "rollout"}
REF_MODELS = ["timm_vit_tiny", "timm_deit_tiny_distilled", "hf_vit", "hf_bert_eager", "hf_distilbert"]


# ------------------------------------------------------------------ slow references (pure Python)

def _lists(t, i):
    return t[i].double().tolist()


def _eye(n):
    return [[1.0 if r == c else 0.0 for c in range(n)] for r in range(n)]


def _matmul(x, y):
    n, k, m = len(x), len(y), len(y[0])
    return [[sum(x[r][j] * y[j][c] for j in range(k)) for c in range(m)] for r in range(n)]


def _add(x, y):
    return [[a + b for a, b in zip(rx, ry)] for rx, ry in zip(x, y)]


def _head_mean(fn, heads, n):
    """[n, n] map m[r][c] = (1/H) Σ_h fn(h, r, c)."""
    m = [[0.0] * n for _ in range(n)]
    for h in range(heads):
        for r in range(n):
            for c in range(n):
                m[r][c] += fn(h, r, c) / heads
    return m


def _pos(v):
    return v if v > 0 else 0.0


def _product(maps, normalize_rows=False):
    """(I + M_last) ... (I + M_first): output-side first (Eq. 14/16 in the paper's numbering)."""
    n = len(maps[0])
    joint = _eye(n)
    for m in maps:
        a = _add(_eye(n), m)
        if normalize_rows:
            a = [[v / sum(row) for v in row] for row in a]
        joint = _matmul(a, joint)
    return joint


def _identity_path(maps, normalize_rows=False):
    """[n] the diagonal of the identity path P = S_last ... S_first of the factors (S = I, or diag(1 / row
    sums of I + M) with ``normalize_rows``): the query rows' own share that identity="exclude" (the
    default) leaves out of the scores (relprop.methods.identity)."""
    n = len(maps[0])
    p = [1.0] * n
    if normalize_rows:
        for m in maps:
            p = [p[r] / (1 + sum(m[r])) for r in range(n)]
    return p


#: the rows each family's head reads, from the architecture: the class token, and for the distilled
#: DeiT also the distillation token (in eval its prediction is the mean of the two heads)
QUERY_ROWS = {"timm_deit_tiny_distilled": [0, 1]}


def reference(name, e, i, lengths=None, query=(0,), **opt):
    """The [n, n] matrix (or None) and the [n] query-row scores (the mean of the rows ``query``
    the head reads; the paper's [CLS] row) of method ``name`` for sample ``i``."""
    blocks = e.blocks
    if name == "lrp":
        return None, None  # checked separately (input level)
    A = [_lists(b.attention, i) for b in blocks]
    G = [_lists(b.gradient, i) for b in blocks]
    R = [_lists(b.relevance, i) if b.relevance is not None else None for b in blocks]
    H, n = len(A[0]), len(A[0][0])
    start = opt.get("start_block", 0)
    own = [0.0] * n  # the query rows' identity share (rollouts)
    if name == "ta_without_gradient":
        maps = [_head_mean(lambda h, r, c: _pos(A[k][h][r][c] * R[k][h][r][c]), H, n) for k in range(start, len(A))]
        m = _product(maps, opt.get("normalize_rows", False))
        own = _identity_path(maps, opt.get("normalize_rows", False))
    elif name in ("ta_last_block", "ta_second_block"):
        k = len(A) - 1 if name == "ta_last_block" else 1
        m = _head_mean(lambda h, r, c: _pos(G[k][h][r][c] * R[k][h][r][c]), H, n)
    elif name == "partial_lrp":
        m = _head_mean(lambda h, r, c: _pos(R[-1][h][r][c]), H, n)
    elif name == "raw_attention":
        m = _head_mean(lambda h, r, c: A[-1][h][r][c], H, n)
    elif name == "rollout":
        maps = [_head_mean(lambda h, r, c: A[k][h][r][c], H, n) for k in range(start, len(A))]
        m = _product(maps, opt.get("normalize_rows", True))
        own = _identity_path(maps, opt.get("normalize_rows", True))
    elif name == "attention_gradcam":
        if e.grid is not None:  # images: the patch columns (the last gh*gw tokens)
            cols = list(range(n - e.grid[0] * e.grid[1], n))
        else:  # text: every real (non-padding) position
            cols = list(range(lengths[i] if lengths else n))
        w = [sum(G[-1][h][q][c] for q in query for c in cols) / len(cols) / len(query) for h in range(H)]
        m = _head_mean(lambda h, r, c: w[h] * A[-1][h][r][c], H, n)
        m = [[_pos(v) for v in row] for row in m]
    elif name == "gradient_rollout":
        m = _eye(n)
        for k in range(len(A)):
            abar = _head_mean(lambda h, r, c: _pos(G[k][h][r][c] * A[k][h][r][c]), H, n)
            m = _add(m, _matmul(abar, m))
        own = [1.0] * n
    else:
        raise AssertionError(name)
    row = [sum(m[q][c] - (own[c] if q == c else 0.0) for q in query) / len(query) for c in range(n)]
    return torch.tensor(m, dtype=torch.float64), torch.tensor(row, dtype=torch.float64)


def _inputs(family, model):
    if family in models.VISION:
        return models.image_batch(model, batch=2), None
    lengths = (7, 5, 9, 3)
    return models.text_batch(lengths), lengths


def _close(a, b, rtol=1e-4):
    scale = float(b.abs().max()) or 1.0
    return torch.allclose(a.double(), b, rtol=rtol, atol=1e-6 * scale)


# ------------------------------------------------------------------ tests

@pytest.mark.parametrize("family", REF_MODELS)
def test_matrix_methods_match_slow_reference(zoo, family):
    """Every matrix method's matrix and scores equal its formula written out with loops (float64)."""
    model = zoo(family)
    x, lengths = _inputs(family, model)
    names = [m for m in METHODS if m != "lrp"]
    exps = relprop.explain(model, x, target=2, method=names)
    for name, e in zip(names, exps):
        assert e.matrix is not None, name
        for i in range(len(e)):
            mat, row = reference(name, e, i, lengths, query=QUERY_ROWS.get(family, [0]))
            if lengths is None:
                assert _close(e.matrix[i], mat), name
                assert _close(e.scores[i], row[e.prefix_tokens:]), name
            else:
                n = lengths[i]
                assert _close(e.matrix[i, :n, :n], mat[:n, :n]), name
                assert _close(e.scores[i], torch.where(e.mask[i], row, torch.zeros_like(row))), name


@pytest.mark.parametrize("family", ["timm_vit_tiny", "hf_bert_eager"])
def test_rollout_options_match_reference(zoo, family):
    """rollout and ta_without_gradient honour start_block and normalize_rows (Eq. 14/16)."""
    model = zoo(family)
    x, lengths = _inputs(family, model)
    for name, opt in [("rollout", {"start_block": 1}), ("rollout", {"normalize_rows": False}),
                      ("ta_without_gradient", {"start_block": 1, "normalize_rows": True})]:
        e = relprop.explain(model, x, target=1, method=name, **opt)
        for i in range(len(e)):
            mat, _ = reference(name, e, i, lengths, **opt)
            n = e.matrix.shape[-1] if lengths is None else lengths[i]
            assert _close(e.matrix[i, :n, :n], mat[:n, :n]), (name, opt)
    with pytest.raises(relprop.MethodError, match="start_block"):
        relprop.explain(model, x, method="rollout", start_block=2)


def test_rollout_rows_are_distributions(zoo):
    """With normalized rows every factor is row-stochastic, so the rollout's rows sum to 1."""
    model = zoo("timm_deit_small")
    e = relprop.explain(model, models.image_batch(model), method="rollout")
    assert torch.allclose(e.matrix.sum(-1), torch.ones(e.matrix.shape[:2]), atol=1e-5)
    assert (e.matrix >= 0).all()


@pytest.mark.parametrize("preset", ["lrp", None])
@pytest.mark.parametrize("family", ["timm_vit_tiny", "hf_vit"])
def test_lrp_vision_is_the_input_relevance_of_its_preset(zoo, family, preset):
    """lrp: the pixel relevance of its preset ('attnlrp' by default, 'lrp' the paper's plain-LRP baseline)
    summed over colour channels, as the rule-by-rule walk computes it; scores = patch sums."""
    model = zoo(family)
    x = models.image_batch(model)
    used = preset or "attnlrp"
    e = relprop.explain(model, x, target=1, method="lrp", **({} if preset is None else {"preset": preset}))
    ref = relprop.explain(model, x, target=1, preset=used).input_relevance.double()  # [B, C, H, W]
    # the default runs AttnLRP's one-backward fast path: equal to the walk to float32 rounding of its order
    rtol, atol = (1e-5, 1e-9) if used == "lrp" else (0, 5e-5)
    gh, gw = e.grid
    ph, pw = x.shape[-2] // gh, x.shape[-1] // gw
    for i in range(2):
        pix = ref[i].sum(0)
        assert torch.allclose(e.map[i].double(), pix, rtol=rtol, atol=atol * float(pix.abs().max()))
        for p in range(gh * gw):
            r, c = divmod(p, gw)
            cell = sum(float(pix[y, z]) for y in range(r * ph, (r + 1) * ph) for z in range(c * pw, (c + 1) * pw))
            assert abs(float(e.scores[i, p]) - cell) <= 1e-4 * float(pix.abs().sum())
    assert e.preset == used and e.signed
    assert (e.scores < 0).any() and (e.scores > 0).any()  # signed: kept, not clamped
    chefer = relprop.explain(model, x, target=1).input_relevance
    assert not torch.allclose(chefer, ref.float())  # a different rule set


@pytest.mark.parametrize("preset", ["lrp", None])
@pytest.mark.parametrize("family", ["hf_bert_eager", "hf_distilbert"])
def test_lrp_text_is_the_token_relevance_of_its_preset(zoo, family, preset):
    """lrp on text: the token embeddings' relevance under its preset ('attnlrp' by default, 'lrp' the
    paper's baseline), padding masked to 0."""
    model = zoo(family)
    lengths = (7, 5, 9, 3)
    x = models.text_batch(lengths)
    used = preset or "attnlrp"
    e = relprop.explain(model, x, target=0, method="lrp", **({} if preset is None else {"preset": preset}))
    assert e.preset == used
    ref = relprop.explain(model, x, target=0, preset=used).input_relevance
    for i, n in enumerate(lengths):
        scale = float(ref[i, :n].abs().max())
        atol = 1e-9 if used == "lrp" else 5e-5 * scale  # the default's fast path against the walk
        assert torch.allclose(e.scores[i, :n], ref[i, :n], rtol=1e-5 if used == "lrp" else 0, atol=atol)
        assert (e.scores[i, n:] == 0).all()


@pytest.mark.parametrize("family", ["timm_vit_tiny", "hf_bert_eager"])
def test_lrp_not_conservative_but_transformer_attribution_is(zoo, family):
    """The plain-LRP baseline (preset 'lrp') loses conservation (separate ± denominators); the paper's rules
    keep it, and so does lrp's default (AttnLRP), which the same call walks rule by rule beside TA."""
    model = zoo(family)
    x, _ = _inputs(family, model)
    with pytest.warns(relprop.RelpropWarning, match="does not balance under preset 'lrp'"):
        plain = relprop.explain(model, x, target=1, method="lrp", preset="lrp")
    lrp, ta = relprop.explain(model, x, target=1, method=["lrp", "transformer_attribution"])
    assert plain.conservation.preset == "lrp" and float(plain.conservation.error.min()) > 1e-2
    assert lrp.conservation.preset == "attnlrp" and ta.conservation.preset == "chefer2021"
    assert float(lrp.conservation.error.max()) < 1e-4
    assert float(ta.conservation.error.max()) < 1e-4


def test_partial_lrp_uses_the_lrp_preset(zoo):
    """partial_lrp reads R_A of the last block under 'lrp', not the paper's conservative rules."""
    model = zoo("timm_vit_tiny")
    x = models.image_batch(model)
    e = relprop.explain(model, x, target=3, method="partial_lrp")
    plain = relprop.explain(model, x, target=3, preset="lrp").blocks[-1].relevance
    chefer = relprop.explain(model, x, target=3).blocks[-1].relevance
    assert e.preset == "lrp" and torch.equal(e.blocks[-1].relevance, plain)
    assert not torch.allclose(plain, chefer)


@pytest.mark.parametrize("family", ["timm_vit_tiny", "hf_bert_eager"])
def test_class_specific_and_agnostic(zoo, family):
    """Class-specific methods change with the target; raw_attention and rollout are identical."""
    model = zoo(family)
    x, _ = _inputs(family, model)
    e0 = relprop.explain(model, x, target=0, method=METHODS)
    e1 = relprop.explain(model, x, target=1, method=METHODS)
    table = relprop.methods()
    for name, a, b in zip(METHODS, e0, e1):
        assert table[name]["class_specific"] == (name not in AGNOSTIC), name
        if name in AGNOSTIC:
            assert torch.equal(a.scores, b.scores) and torch.equal(a.matrix, b.matrix), name
        else:
            # text position 0 is [CLS] itself, whose self-entry (~1) dwarfs random BERT's ~1e-8 scores
            sa, sb = (a.scores, b.scores) if family in models.VISION else (a.scores[:, 1:], b.scores[:, 1:])
            assert float((sa - sb).abs().max() / sa.abs().max()) > 1e-2, name


def test_batch_invariance_vision(zoo):
    """A batch of images explains like each image alone (max abs diff < 1e-5, relative to scale)."""
    model = zoo("timm_deit_tiny_distilled")
    x = models.image_batch(model, batch=3, seed=4)
    full = relprop.explain(model, x, target=[0, 1, 2], method=METHODS)
    for i in range(3):
        alone = relprop.explain(model, x[i:i + 1], target=i, method=METHODS)
        for name, f, a in zip(METHODS, full, alone):
            scale = max(1.0, float(a.scores.abs().max()))
            assert (f.scores[i] - a.scores[0]).abs().max() < 1e-5 * scale, name
            if f.matrix is not None:
                assert (f.matrix[i] - a.matrix[0]).abs().max() < 1e-5 * max(1.0, float(a.matrix.abs().max())), name


def test_batch_invariance_text_padded(zoo):
    """A padded batch of 4 texts of different lengths gives each text's own scores (< 1e-5)."""
    model = zoo("hf_distilbert")
    lengths = (7, 5, 9, 3)
    batch = models.text_batch(lengths, first_id=3)
    targets = [0, 1, 2, 1]
    full = relprop.explain(model, batch, target=targets, method=METHODS)
    for i, n in enumerate(lengths):
        alone = relprop.explain(model, {k: v[i:i + 1, :n] for k, v in batch.items()}, target=targets[i],
                                method=METHODS)
        for name, f, a in zip(METHODS, full, alone):
            scale = float(a.scores.abs().max())
            diff = float((f.scores[i, :n] - a.scores[0]).abs().max())
            assert diff < 1e-5 * max(scale, 1.0) and diff <= 1e-3 * scale + 1e-12, (name, diff, scale)
            assert (f.scores[i, n:] == 0).all(), name


def test_single_block_ablations_pick_their_block():
    """ta_last_block reads the block next to the output, ta_second_block blocks[1] (depth 3)."""
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", depth=3, img_size=64, num_classes=5).eval()
    x = models.image_batch(model)
    last, second = relprop.explain(model, x, target=0, method=["ta_last_block", "ta_second_block"])
    for e, k in ((last, 2), (second, 1)):
        b = e.blocks[k]
        expect = (b.gradient * b.relevance).clamp(min=0).mean(1)
        assert torch.allclose(e.matrix, expect) and torch.allclose(e.scores, expect[:, 0, 1:])
    assert not torch.allclose(last.matrix, second.matrix)
    one = timm.create_model("vit_tiny_patch16_224", depth=1, img_size=64, num_classes=5).eval()
    with pytest.raises(relprop.MethodError, match="at least 2 attention blocks"):
        relprop.explain(one, models.image_batch(one), target=0, method="ta_second_block")


def test_attention_gradcam_ignores_padding_columns(zoo):
    """Text Grad-CAM weights average dA over real tokens only: extra padding changes nothing."""
    model = zoo("hf_bert_eager")
    x = models.text_batch((5, 4))
    padded = {k: torch.cat([v, torch.zeros(2, 4, dtype=v.dtype)], 1) for k, v in x.items()}
    a = relprop.explain(model, x, target=1, method="attention_gradcam")
    b = relprop.explain(model, padded, target=1, method="attention_gradcam")
    assert torch.allclose(a.scores, b.scores[:, :5], rtol=1e-4, atol=1e-6 * float(a.scores.abs().max()))
    assert (b.scores[:, 5:] == 0).all()
