"""Hybrid (convolution + attention) models end to end: every op has a rule in every preset, the
interpreter conserves relevance, and the fast path (one modified-gradient backward) gives the
interpreter's input relevance, on a tiny hand-built hybrid holding every op of the family (BatchNorm
2d/1d, hardswish, hardsigmoid gate, clamp, average/max pooling, upsampling, GroupNorm, attention)
and on tiny random timm LeViT and MobileViT (HF MobileViT and LeViT: coverage).
"""
from __future__ import annotations

import copy

import pytest
import timm
import torch
import torch.nn as nn
import torch.nn.functional as F
import transformers

import relprop
from relprop.errors import UnsupportedOperation

PRESETS = ["chefer2021", "lrp", "attnlrp", "cp_lrp"]


def randomize_norms(model: nn.Module, seed: int = 0) -> nn.Module:
    """Non-trivial BatchNorm statistics and affine parameters (a fresh BatchNorm is the identity)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                c = m.num_features
                m.running_mean.copy_(0.3 * torch.randn(c, generator=g))
                m.running_var.copy_(0.5 + torch.rand(c, generator=g))
                if m.affine:
                    m.weight.copy_(1 + 0.2 * torch.randn(c, generator=g))
                    m.bias.copy_(0.2 * torch.randn(c, generator=g))
    return model


class TinyHybrid(nn.Module):
    """Convolutional stem and stages (BatchNorm, hardswish, clamp, pooling, upsampling, GroupNorm,
    a hardsigmoid squeeze-excite gate), then one attention block over the tokens (LeViT-style
    BatchNorm1d on the flattened tokens) and an averaged head."""

    def __init__(self, dim=8, classes=3):
        super().__init__()
        self.stem = nn.Conv2d(3, dim, 3, 2, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(dim)
        self.conv = nn.Conv2d(dim, dim, 3, 1, 1)
        self.bn2 = nn.BatchNorm2d(dim)
        self.gn = nn.GroupNorm(2, dim)
        self.se_reduce = nn.Conv2d(dim, 4, 1)
        self.se_expand = nn.Conv2d(4, dim, 1)
        self.norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.bn_tokens = nn.BatchNorm1d(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        x = F.hardswish(self.bn1(self.stem(x)))                                      # [B, C, 8, 8]
        x = x + F.avg_pool2d(x, 3, 1, 1, count_include_pad=False)                     # PoolFormer mixer
        x = torch.clamp(self.bn2(self.conv(x)), -2.0, 4.0)                            # ReLU6-like bound
        x = F.max_pool2d(x, 2)                                                        # [B, C, 4, 4]
        x = F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False)    # [B, C, 8, 8]
        x = F.avg_pool2d(x, 2)                                                        # [B, C, 4, 4]
        x = self.gn(x)
        x = x * F.hardsigmoid(self.se_expand(F.hardswish(self.se_reduce(x.mean((2, 3), keepdim=True)))))
        t = x.flatten(2).transpose(1, 2)                                              # [B, 16, C]
        q, k, v = self.qkv(self.norm(t)).chunk(3, dim=-1)
        a = torch.softmax(q @ k.transpose(-1, -2) * t.shape[-1] ** -0.5, dim=-1)
        t = t + self.proj(a @ v)
        t = self.bn_tokens(t.flatten(0, 1)).reshape_as(t)
        return self.head(F.adaptive_avg_pool1d(t.transpose(1, 2), 1).flatten(1))


def tiny_hybrid():
    torch.manual_seed(0)
    return randomize_norms(TinyHybrid().eval())


def timm_levit():
    torch.manual_seed(0)
    m = timm.create_model("levit_128s", pretrained=False, num_classes=5, img_size=64).eval()
    return randomize_norms(m)


def timm_mobilevit():
    torch.manual_seed(0)
    return randomize_norms(timm.create_model("mobilevit_xxs", pretrained=False, num_classes=5).eval())


def _hf_reinit(model):
    """HF's initialization (std 0.02) makes the activations of these random models vanish: torch's."""
    torch.manual_seed(0)
    for m in model.modules():
        if isinstance(m, (nn.Conv2d, nn.Linear, nn.modules.batchnorm._BatchNorm, nn.LayerNorm)):
            m.reset_parameters()
    return randomize_norms(model.eval())


def hf_mobilevit():
    cfg = transformers.MobileViTConfig(image_size=64, num_labels=5, hidden_sizes=[16, 24, 32],
                                       neck_hidden_sizes=[8, 8, 16, 16, 24, 24, 48])
    return _hf_reinit(transformers.MobileViTForImageClassification(cfg))


def hf_levit():
    return _hf_reinit(transformers.LevitForImageClassification(transformers.LevitConfig(image_size=64, num_labels=5)))


def images(size=16, batch=2, seed=0):
    return torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(seed))


MODELS = {"tiny_hybrid": (tiny_hybrid, 16), "timm_levit": (timm_levit, 64), "timm_mobilevit": (timm_mobilevit, 64),
          "hf_mobilevit": (hf_mobilevit, 64), "hf_levit": (hf_levit, 64)}


@pytest.fixture(scope="module")
def built():
    cache = {}

    def get(name):
        if name not in cache:
            make, size = MODELS[name]
            cache[name] = (make(), images(size))
        return cache[name]
    return get


@pytest.mark.parametrize("name", list(MODELS))
def test_every_op_has_a_rule(built, name):
    """No op on the relevance path of these hybrids lacks a rule, in any built-in preset."""
    model, x = built(name)
    for preset in PRESETS:
        report = relprop.coverage(model, x, preset=preset)
        assert report.complete, report.summary()
    ops = {o.op for o in relprop.coverage(model, x).ops if o.status == "rule"}
    assert "aten._native_batch_norm_legit_no_training.default" in ops


def test_tiny_hybrid_holds_every_new_op(built):
    """The hand-built hybrid's graph has each op family these rules are for, on the relevance path."""
    model, x = built("tiny_hybrid")
    ops = {o.op for o in relprop.coverage(model, x).ops if o.status == "rule"}
    for op in ("_native_batch_norm_legit_no_training", "hardswish", "hardsigmoid", "clamp", "avg_pool2d",
               "max_pool2d_with_indices", "upsample_bilinear2d", "native_group_norm", "softmax"):
        assert any(op in o for o in ops), (op, sorted(ops))


CONSERVING = [("tiny_hybrid", "chefer2021"), ("tiny_hybrid", "attnlrp"), ("tiny_hybrid", "cp_lrp"),
              ("timm_levit", "attnlrp"),
              pytest.param("timm_levit", "chefer2021", marks=pytest.mark.slow),
              pytest.param("timm_mobilevit", "attnlrp", marks=pytest.mark.slow),
              pytest.param("timm_mobilevit", "cp_lrp", marks=pytest.mark.slow)]


@pytest.mark.parametrize("name, preset", CONSERVING)
def test_hybrid_conserves_in_float64(built, name, preset):
    """float64 and eps=0: per sample, input relevance + absorbed (biases, BatchNorm shifts, ...) =
    injected to float64 rounding (< 1e-10). (With eps > 0 the stabilizer itself takes a share where
    a denominator is small. MobileViT is not checked under chefer2021: its depthwise convolutions
    meet outputs whose alpha1-beta0 denominator is 0, which that rule drops.)"""
    model, x = built(name)
    m = copy.deepcopy(model).double()
    e = relprop.explain(m, x.double(), target=1, method="lrp", preset=preset, fast_path=False, eps=0.0)
    assert e.input_relevance.dtype == torch.float64
    assert float(e.conservation.error.max()) < 1e-10, e.conservation
    assert torch.isfinite(e.input_relevance).all()


@pytest.mark.parametrize("preset", ["attnlrp", "cp_lrp"])
@pytest.mark.parametrize("name", ["tiny_hybrid", "timm_levit", "timm_mobilevit", "hf_mobilevit"])
def test_hybrid_fast_path_equals_interpreter(built, name, preset):
    """The one-backward fast path (BatchNorm, GroupNorm, pooling forms with the ε stabilizer) gives
    the interpreter's input relevance: < 2e-5 of the largest in float32 at the default eps."""
    model, x = built(name)
    fast = relprop.explain(model, x, target=1, method="lrp", preset=preset)
    ref = relprop.explain(model, x, target=1, method="lrp", preset=preset, fast_path=False)
    assert fast.conservation is None and ref.conservation is not None
    scale = float(ref.input_relevance.abs().max())
    assert scale > 0
    assert float((fast.input_relevance - ref.input_relevance).abs().max()) < 2e-5 * scale


def test_tiny_hybrid_fast_path_float64_any_eps(built):
    """float64, eps from 0 to 1e-3: fast path ≡ interpreter to float64 rounding."""
    model, x = built("tiny_hybrid")
    m, xx = copy.deepcopy(model).double(), x.double()
    for eps in (0.0, 1e-6, 1e-3):
        fast = relprop.explain(m, xx, target=1, method="lrp", preset="attnlrp", eps=eps)
        ref = relprop.explain(m, xx, target=1, method="lrp", preset="attnlrp", eps=eps, fast_path=False)
        scale = float(ref.input_relevance.abs().max())
        assert float((fast.input_relevance - ref.input_relevance).abs().max()) < 1e-12 * scale, eps


class WithInstanceNorm(nn.Module):
    """InstanceNorm without running statistics: ``_native_batch_norm_legit.no_stats`` (a tuple
    output, boolean and float arguments), an op with no rule in any preset."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, 1, 1)
        self.norm = nn.InstanceNorm2d(4, affine=True)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.norm(self.conv(x)).mean((2, 3)))


@pytest.mark.parametrize("preset", ["chefer2021", "attnlrp"])
def test_unsupported_z_rule_on_tuple_output_op(preset):
    """An op without a rule raises UnsupportedOperation; with ``unsupported="z_rule"`` the generic
    rule handles it (tuple output, non-tensor arguments) and gives finite relevance."""
    torch.manual_seed(0)
    model = WithInstanceNorm().eval()
    x = images(8)
    report = relprop.coverage(model, x, preset=preset)
    assert [o.op for o in report.missing] == ["aten._native_batch_norm_legit.no_stats"]
    with pytest.raises(UnsupportedOperation, match="_native_batch_norm_legit"):
        relprop.explain(model, x, target=1, method="lrp", preset=preset)
    e = relprop.explain(model, x, target=1, method="lrp", preset=preset, unsupported="z_rule")
    assert torch.isfinite(e.input_relevance).all() and float(e.input_relevance.abs().max()) > 0
