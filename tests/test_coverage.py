"""relprop.coverage: every op of the captured graph with its module path and handling, the
attention blocks found, and `relprop explain --coverage` on the command line."""
import os

import numpy as np
import pytest
import torch
from PIL import Image

import models
import relprop
from relprop import cli
from relprop.graph.capture import CACHE
from relprop.rules.rule_registry import get_preset
from snapshot import assert_same, snapshot

FAMILIES = {
    "timm_vit_tiny": (models.timm_vit_tiny, lambda m: models.image_batch(m)),
    "hf_bert_eager": (lambda: models.hf_bert("eager"), lambda m: models.text_batch()),
    "hf_gpt2_cls": (models.hf_gpt2_cls, lambda m: models.decoder_batch()),
    "hf_gpt2_lm_eager": (lambda: models.hf_gpt2_lm("eager"), lambda m: models.decoder_batch()),
    "hf_llama": (models.hf_llama, lambda m: models.decoder_batch()),
    "timm_vit_rectangular": (models.timm_vit_rectangular, lambda m: models.sized_images(m)),
    "timm_dinov2_reg4": (models.timm_dinov2_reg4, lambda m: models.sized_images(m)),
    "timm_vit_reg4_gap": (models.timm_vit_reg4_gap, lambda m: models.sized_images(m)),
    "hf_dinov2_registers": (models.hf_dinov2_registers, lambda m: models.sized_images(m)),
}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_no_missing_op_and_blocks_found(name):
    """Every family of the issue: no op on the relevance path lacks a rule, the two attention
    blocks are listed with their heads and tokens, and every op of the graph is in the report."""
    build, inputs = FAMILIES[name]
    model = build()
    x = inputs(model)
    report = relprop.coverage(model, x)
    assert report.complete and report.missing == [], report.summary()
    assert [b.index for b in report.blocks] == [0, 1]
    modules = dict(model.named_modules())
    assert all(b.name in modules and b.heads and b.tokens for b in report.blocks)
    captured = CACHE.get(model, relprop.graph.inputs.bind_inputs(model, x))
    calls = [n.name for n in captured.graph.nodes if n.op == "call_function"]
    assert [o.node for o in report.ops] == calls
    assert {o.status for o in report.ops} <= set(relprop.engine.coverage.STATUSES)
    text = str(report)
    assert "every op on the relevance path has a rule" in text and report.blocks[0].name in text


def test_report_names_rules_presets_and_modules():
    """Each op's line has its module path and its handling: the rule and the preset it is
    registered in, shape-only routing, the embedding source, constants."""
    model = models.hf_llama()
    report = relprop.coverage(model, models.decoder_batch())
    by_op = {}
    for o in report.ops:
        by_op.setdefault((o.op, o.status), o)
    assert by_op[("aten.linear.default", "rule")].rule == "linear.linear (chefer2021)"
    assert by_op[("aten.rsqrt.default", "rule")].rule == "pointwise.elementwise_identity (chefer2021)"
    assert by_op[("aten.neg.default", "rule")].module.endswith("self_attn")
    assert by_op[("aten.view.default", "shape-only")].rule.endswith("(base)")
    assert by_op[("aten.embedding.default", "source")].module == "model.embed_tokens"
    assert report.counts()["constant"] > 0  # the causal mask and the rotary tables need no rule
    lrp = relprop.coverage(model, models.decoder_batch(), preset="lrp")
    assert lrp.preset == "lrp" and lrp.complete
    assert "preset 'lrp'" in lrp.summary()


def test_missing_op_is_reported_with_module_and_decorator():
    """An op with no rule is 'missing' with its module path; the summary says how to register one."""
    model = models.UnruledOp().eval()
    report = relprop.coverage(model, torch.randn(2, 4))
    assert not report.complete
    (miss,) = report.missing
    assert miss.op == "aten.exp.default" and miss.module == "inner.1" and miss.module_type.endswith("models.Exp")
    summary = report.summary()
    assert "MISSING: 1 op(s)" in summary and "aten.exp.default in inner.1" in summary
    assert "@relprop.rule(torch.ops.aten.exp.default, preset='chefer2021')" in summary
    assert "attention blocks: none found" in summary
    assert "missing=1" in repr(report)


def test_registered_rule_shows_up():
    """A rule registered with @relprop.rule is what the report names for that op."""
    model = models.UnruledOp().eval()

    @relprop.rule(torch.ops.aten.exp.default, preset="chefer2021")
    def exp_identity(ctx, relevance):
        return (relevance,)

    try:
        report = relprop.coverage(model, torch.randn(2, 4))
        assert report.complete
        (op,) = [o for o in report.ops if o.op == "aten.exp.default"]
        assert op.status == "rule" and op.rule.startswith("test_coverage.exp_identity (chefer2021)")
    finally:
        get_preset("chefer2021").rules.pop(torch.ops.aten.exp.default)


def test_blocked_divisor_gets_no_relevance():
    """Ops that only feed a divisor (a norm the rules give no relevance) are 'no relevance'."""
    class Normed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(4, 4)
            self.b = torch.nn.Linear(4, 2)

        def forward(self, x):
            h = self.a(x)
            return self.b(h / (h * h).sum(-1, keepdim=True).sqrt())

    report = relprop.coverage(Normed().eval(), torch.randn(2, 4))
    statuses = {o.op: o.status for o in report.ops}
    assert statuses["aten.sqrt.default"] == "no relevance" and statuses["aten.sum.dim_IntList"] == "no relevance"
    assert statuses["aten.div.Tensor"] == "rule" and report.complete


def test_coverage_shares_the_capture_and_leaves_the_model_alone():
    """coverage() captures like explain() (same cache: explain afterwards does not trace again)
    and does not change the model."""
    model = models.hf_gpt2_cls()
    x = models.decoder_batch()
    before = snapshot(model)
    relprop.coverage(model, x)
    traces = CACHE.traces
    relprop.explain(model, x, target=1)
    assert CACHE.traces == traces
    assert_same(before, snapshot(model))


def test_unsupported_operation_names_overloads_once():
    """Errors name an overload once: aten.add.Tensor, not aten.add.Tensor.Tensor."""
    from relprop.errors import op_name
    assert op_name(torch.ops.aten.add.Tensor) == "aten.add.Tensor"
    assert op_name(torch.ops.aten.pow.Tensor_Scalar) == "aten.pow.Tensor_Scalar"
    assert op_name(torch.ops.aten.linear.default) == "aten.linear.default"


def test_cli_explain_coverage(tmp_path, capsys):
    """`relprop explain --coverage` prints the report (every op, the blocks, the summary) before
    the explanation."""
    import timm
    t = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=4, depth=2, img_size=64).eval()
    timm.models.save_for_hf(t, str(tmp_path / "vit"))
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 255, (60, 80, 3)).astype(np.uint8)).save(tmp_path / "x.png")
    code = cli.main(["explain", "--model", str(tmp_path / "vit"), "--image", str(tmp_path / "x.png"), "--coverage"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "relprop coverage of VisionTransformer" in out and "patch grid 4x4" in out
    assert "blocks.0.attn.qkv" in out and "rule: linear.linear (chefer2021)" in out
    assert "attention blocks (2):" in out and "every op on the relevance path has a rule" in out
    assert out.index("relprop coverage") < out.index("predicted")
    assert os.path.isdir(tmp_path / "vit")


class _Chain(torch.nn.Module):
    """Three different ops with no rule in sequence, linear layers between them."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c, self.d = (torch.nn.Linear(4, 4) for _ in range(4))

    def forward(self, x):
        x = torch.exp(self.a(x))
        x = torch.cumsum(self.b(x), dim=-1)
        x = torch.sin(self.c(x))
        return self.d(x)


def test_every_missing_op_is_listed_not_only_the_first():
    """The report follows the relevance path through ops without a rule (as if relevance reached all
    their live arguments), so every missing op is listed and the ops upstream of one are labelled by
    their own handling, not 'no relevance'; explain() still stops at the first one (nearest the
    output) with the UnsupportedOperation it always raised."""
    from relprop.errors import UnsupportedOperation
    model = _Chain().eval()
    x = torch.randn(2, 4)
    report = relprop.coverage(model, x)
    assert [o.op for o in report.missing] == ["aten.exp.default", "aten.cumsum.default", "aten.sin.default"]
    assert [o.module for o in report.missing] == ["", "", ""]
    statuses = [(o.op, o.status) for o in report.ops if o.op == "aten.linear.default"]
    assert statuses == [("aten.linear.default", "rule")] * 4
    assert report.counts()["no relevance"] == 0
    summary = report.summary()
    assert "MISSING: 3 op(s)" in summary
    for op in ("aten.exp.default", "aten.cumsum.default", "aten.sin.default"):
        assert op in summary
    with pytest.raises(UnsupportedOperation) as info:
        relprop.explain(model, x, target=1, method="lrp")
    node = next(n for n in CACHE.get(model, relprop.graph.inputs.bind_inputs(model, x)).graph.nodes
                if n.op == "call_function" and n.target is torch.ops.aten.sin.default)
    expected = UnsupportedOperation(node.target, "", "top level", "attnlrp")  # lrp's default preset
    assert str(info.value) == str(expected)
