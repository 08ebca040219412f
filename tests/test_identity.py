"""What a rollout's scores keep of each query row's identity share (``identity=``,
:mod:`relprop.methods.identity`), against slow references built from the paper's formulas.

C = Ā_{B-1} · … · Ā_0 with Ā_b = I + M_b (Eq. 13–14), each factor divided by its row sums for attention
rollout (Eq. 15–16): split Ā_b = S_b + N_b into its identity part (I, or diag(1/s_b)) and its map part;
P = Π S_b is the identity path. The references multiply the factors in float64 and subtract.

* ``"exclude"`` (default) = q · (C − P): on a [CLS] model bit for bit the scores of ``"keep"`` (q · C)
  on every token shown; on a mean-pooled model q · C less q_j P_jj; on a decoder the last token alone
  changes; ≥ 0 where the maps are; the folded fold gives the same;
* ``"exclude_self"`` = Σ_{i≠j} q_i C_ij;
* a map uniform to float32 resolution is a RelpropWarning that names the cause (a kept identity share).
"""
from __future__ import annotations

import inspect
import warnings

import pytest
import torch
import transformers
from hypothesis import given, settings, strategies as st

import models
import relprop
from relprop.explanation import flatness
from relprop.methods.identity import excluded_row

ROLLOUTS = ["transformer_attribution", "rollout", "gradient_rollout", "ta_without_gradient"]


class MeanPooledBert(torch.nn.Module):
    """A tiny BERT encoder read by mean pooling over the attention mask and a linear head (the
    sentence-transformers reading of the demo model)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        cfg = models._text_cfg(transformers.BertConfig, attn_implementation="eager")
        self.encoder = transformers.BertModel(cfg, add_pooling_layer=False)
        self.head = torch.nn.Linear(cfg.hidden_size, 3)
        self.config = cfg

    def forward(self, input_ids, attention_mask):
        h = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        m = attention_mask[..., None].to(h.dtype)
        return self.head((h * m).sum(1) / m.sum(1))


@pytest.fixture(scope="module")
def pooled():
    return MeanPooledBert().eval()


@pytest.fixture(scope="module")
def batch():
    return models.text_batch((7, 5))


# ------------------------------------------------------------------ the slow reference
def _maps(exp, method):
    """Each block's fused map M_b, float64, from the explanation's block records (the paper's formulas)."""
    out = []
    for b in exp.blocks:
        a, g = b.attention.double(), b.gradient.double()
        if method == "transformer_attribution":
            m = (g * b.relevance.double()).clamp(min=0).mean(1)      # Eq. 13: E_h[(∇A ⊙ R_A)⁺]
        elif method == "ta_without_gradient":
            m = (a * b.relevance.double()).clamp(min=0).mean(1)      # Table 3 (i)
        elif method == "gradient_rollout":
            m = (g * a).clamp(min=0).mean(1)                         # ICCV 2021, Eq. 5
        else:
            m = a.mean(1)                                            # Eq. 15
        out.append(m)
    return out


def reference(exp, method, identity):
    """q · C, q · (C − P) or Σ_{i≠j} q_i C_ij, multiplied out in float64 (blocks input → output)."""
    normalize = method == "rollout"
    n = exp.blocks[0].attention.shape[-1]
    eye = torch.eye(n, dtype=torch.float64)
    c = p = None
    for m in _maps(exp, method):
        a = eye + m
        s = a.sum(-1, keepdim=True) if normalize else torch.ones_like(a[..., :1])
        a, d = a / s, eye / s  # the factor, and its identity part S_b
        c = a if c is None else a @ c
        p = d if p is None else d @ p
    q = exp.query.double()
    if identity == "keep":
        return torch.einsum("bi,bij->bj", q, c)
    if identity == "exclude":
        return torch.einsum("bi,bij->bj", q, c - p)
    return torch.einsum("bi,bij->bj", q, c * (1 - eye))


def _close(exp, ref, rtol=1e-5):
    shown = exp.mask
    got = exp.scores.double()
    scale = ref[shown].abs().max()
    assert torch.allclose(got[shown], ref[shown], rtol=0, atol=rtol * float(scale) + 1e-12), \
        float((got[shown] - ref[shown]).abs().max() / scale)


@pytest.fixture(scope="module")
def pooled_exps(pooled, batch):
    """identity -> {method: Explanation} on the mean-pooled model (one explain call per identity)."""
    return {identity: dict(zip(ROLLOUTS, relprop.explain(pooled, batch, method=ROLLOUTS, identity=identity)))
            for identity in ("exclude", "keep", "exclude_self")}


@pytest.mark.parametrize("identity", ["exclude", "keep", "exclude_self"])
def test_mean_pooled_scores_are_the_reference(pooled_exps, batch, identity):
    real = batch["attention_mask"].bool()
    for method, exp in pooled_exps[identity].items():
        assert torch.allclose(exp.query[real], (1 / real.sum(1, keepdim=True).float()).expand_as(real)[real])
        _close(exp, reference(exp, method, identity))


def test_exclude_is_keep_less_the_identity_path_and_nonnegative(pooled_exps):
    """On a mean-pooled model q · C − q · (C − P) = q_j P_jj (1/N for I + M); every excluded score ≥ 0;
    "exclude" is the default."""
    for method in ROLLOUTS:
        keep, excl = pooled_exps["keep"][method], pooled_exps["exclude"][method]
        ref_keep, ref_excl = reference(keep, method, "keep"), reference(keep, method, "exclude")
        shown = keep.mask
        assert torch.allclose((ref_keep - ref_excl)[shown], (keep.scores.double() - excl.scores.double())[shown],
                              atol=1e-6 * float(ref_keep.abs().max())), method
        assert bool((excl.scores[shown] >= 0).all()), method
    for method in ROLLOUTS:
        assert inspect.signature(relprop.methods.get_method(method).fn).parameters["identity"].default == "exclude"


@pytest.mark.parametrize("name, make, inputs", [
    ("hf_bert", lambda: models.hf_bert(), lambda m: models.text_batch()),
    ("hf_vit", lambda: models.hf_vit(), lambda m: models.image_batch(m)),
])
def test_class_token_models_keep_the_papers_scores_bit_for_bit(name, make, inputs):
    """[CLS] models: the identity share lands on [CLS], which the map leaves out: "exclude" (the default)
    gives Eq. 14's scores (and matrix) bit for bit. (The tiny BERT's config names no special token, so
    its [CLS] is shown: there, and only there, the score loses the identity share, as the reference says.)"""
    model = make()
    x = inputs(model)
    keeps = relprop.explain(model, x, method=ROLLOUTS, identity="keep")
    defaults = relprop.explain(model, x, method=ROLLOUTS)
    for method, keep, default in zip(ROLLOUTS, keeps, defaults):
        assert torch.equal(keep.matrix, default.matrix)
        assert bool((keep.query[:, 0] == 1).all())  # the class token's row
        if keep.map is not None:
            assert torch.equal(keep.scores, default.scores) and torch.equal(keep.map, default.map)
        else:
            assert torch.equal(keep.scores[:, 1:], default.scores[:, 1:])
            cls = reference(keep, method, "exclude")[:, 0]
            assert torch.allclose(default.scores[:, 0].double(), cls, atol=1e-6)
            assert bool((default.scores[:, 0] < 1).all())


def test_decoder_last_token_loses_only_its_identity_share():
    model = models.hf_gpt2_lm()
    x = models.decoder_batch((7, 5))
    methods = ["transformer_attribution", "gradient_rollout", "rollout"]
    keeps = relprop.explain(model, x, method=methods, target="next_token", identity="keep")
    excls = relprop.explain(model, x, method=methods, target="next_token")
    rows, last = torch.arange(2), torch.tensor([6, 4])
    for method, keep, excl in zip(methods, keeps, excls):
        other = torch.ones_like(keep.scores, dtype=torch.bool)
        other[rows, last] = False
        assert torch.equal(keep.scores[other], excl.scores[other])
        ref = reference(keep, method, "exclude")
        assert torch.allclose(excl.scores[rows, last].double(), ref[rows, last], atol=1e-6)
        # kept, the identity share (1 for I + M) makes the last token the top of the map whatever the input
        if method != "rollout":
            assert bool((keep.scores[rows, last] >= 1).all())


@pytest.mark.parametrize("identity", ["exclude", "keep"])
def test_folded_fold_gives_the_same_scores(pooled, batch, pooled_exps, identity):
    methods = ["transformer_attribution", "gradient_rollout", "rollout"]
    folded = relprop.explain(pooled, batch, method=methods, identity=identity, keep_blocks=False)
    for method, exp in zip(methods, folded):
        full = pooled_exps[identity][method]
        scale = float(full.scores.abs().max())
        assert torch.allclose(full.scores, exp.scores, rtol=0, atol=1e-5 * scale), method


def test_exclude_self_is_not_folded_and_bad_choices_are_refused(pooled, batch):
    exp = relprop.explain(pooled, batch, method="transformer_attribution", identity="exclude_self", keep_blocks=False)
    assert any("exclude_self" in n for n in exp.notes)
    with pytest.raises(relprop.OptionError, match="identity=.*Choices: \\['exclude', 'keep', 'exclude_self'\\]"):
        relprop.explain(pooled, batch, method="rollout", identity="drop")


# ------------------------------------------------------------------ the fold itself
@settings(max_examples=40, deadline=None)
@given(n=st.integers(2, 6), blocks=st.integers(1, 4), normalize=st.booleans(), scale=st.sampled_from([1e-8, 1e-3, 1.0]),
       seed=st.integers(0, 10_000))
def test_excluded_row_is_q_times_c_minus_p(n, blocks, normalize, scale, seed):
    """For random non-negative maps (down to 1e-8 of the identity: far below float32's resolution of
    q · C) the fold equals q · (C − P) computed in float64, to float32 rounding of its own size."""
    g = torch.Generator().manual_seed(seed)
    maps = [torch.rand(2, n, n, generator=g, dtype=torch.float64) * scale for _ in range(blocks)]
    q = torch.rand(2, n, generator=g, dtype=torch.float64)
    eye = torch.eye(n, dtype=torch.float64)
    c = p = eye.expand(2, n, n)
    for m in maps:
        a = eye + m
        s = a.sum(-1, keepdim=True) if normalize else torch.ones_like(a[..., :1])
        c, p = (a / s) @ c, (eye / s) @ p
    want = torch.einsum("bi,bij->bj", q, c - p)
    got = excluded_row(q.float(), [m.float() for m in maps], normalize).double()
    assert torch.allclose(got, want, rtol=1e-5, atol=0), float(((got - want).abs() / want.abs()).max())
    assert bool((got >= 0).all())


# ------------------------------------------------------------------ flat maps are a warning
def test_uniform_map_is_a_warning_naming_the_cause():
    """A mean-pooled video encoder (VideoMAE, tiny config): with identity='keep' every score is 1/N to
    float32 resolution, and explain() says so and why; the default map has contrast."""
    torch.manual_seed(0)
    cfg = transformers.VideoMAEConfig(image_size=16, patch_size=8, num_channels=3, num_frames=4, tubelet_size=2,
                                      hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=64, num_labels=3, use_mean_pooling=True)
    model = transformers.VideoMAEForVideoClassification(cfg).eval()
    x = torch.randn(2, 4, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    with pytest.warns(relprop.RelpropWarning, match="uniform to torch.float32 resolution.*identity='keep'"):
        kept = relprop.explain(model, x, method="transformer_attribution", identity="keep")
    assert any("uniform" in n for n in kept.notes)
    with warnings.catch_warnings():
        warnings.simplefilter("error", relprop.RelpropWarning)
        exp = relprop.explain(model, x, method="transformer_attribution")
    assert flatness.flat_samples(exp.scores, exp.mask) == []


def test_flat_samples_threshold():
    s = torch.tensor([[1.0, 1.0 + 4e-7, 1.0], [1.0, 1.0 + 2e-6, 1.0], [0.0, 0.0, 0.0], [3.0, 1.0, 2.0]])
    assert flatness.flat_samples(s) == [0, 2]
    mask = torch.tensor([[True] * 3, [True] * 3, [True] * 3, [True, False, False]])
    assert flatness.flat_samples(s, mask) == [0, 2]  # one shown position: not a map to judge
