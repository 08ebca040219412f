"""Properties every explanation method shares: the registry describes each one, methods
asked for together share one forward pass, class-specific methods depend on the target and
class-agnostic ones do not, and a batch explains like its samples one by one."""
import pytest
import torch

import models
import relprop
from relprop.engine.forward import STATS

EXPECTED = {
    "transformer_attribution", "ta_without_gradient", "ta_last_block", "ta_second_block", "lrp", "partial_lrp",
    "raw_attention", "rollout", "attention_gradcam", "gradient_rollout", "cat", "attcat", "grads", "attgrads",
    "attention_norm", "input_x_gradient", "smoothgrad", "integrated_gradients", "gradcam", "value_zeroing", "vit_cx",
}
#: options that keep the sampling methods small in tests
FAST = {"smoothgrad": {"n_samples": 3}, "integrated_gradients": {"n_steps": 4}}


def _registered():
    return sorted(relprop.methods())


def test_every_method_is_registered_and_described():
    """relprop.methods(): every name with a description, class-specificity, sign and reference."""
    table = relprop.methods()
    assert EXPECTED <= set(table), sorted(EXPECTED - set(table))
    for name, row in table.items():
        assert row["description"] and row["reference"], name
        assert isinstance(row["class_specific"], bool) and isinstance(row["signed"], bool)


def test_methods_share_one_forward_pass(zoo):
    """rollout and transformer_attribution asked together: one Explanation each, from one pass."""
    model = zoo("timm_vit_tiny")
    x = models.image_batch(model)
    relprop.explain(model, x, target=1)  # capture
    before = STATS["forward"]
    both = relprop.explain(model, x, target=1, method=["rollout", "transformer_attribution", "raw_attention"])
    assert STATS["forward"] - before == 1
    assert [e.method for e in both] == ["rollout", "transformer_attribution", "raw_attention"]
    alone = relprop.explain(model, x, target=1, method="rollout")
    assert torch.equal(both[0].scores, alone.scores)
    assert torch.equal(both[1].scores, relprop.explain(model, x, target=1).scores)


def _applies(name, family):
    if name == "vit_cx" and family in models.TEXT:
        return False
    return True


@pytest.mark.parametrize("family", ["timm_vit_tiny", "hf_bert_eager"])
def test_class_specific_and_agnostic(zoo, family):
    """Class-specific methods give different scores for two targets; class-agnostic ones identical."""
    table = relprop.methods()
    model = zoo(family)
    x = models.image_batch(model) if family in models.VISION else models.text_batch()
    for name in _registered():
        if not _applies(name, family):
            continue
        opts = FAST.get(name, {})
        a = relprop.explain(model, x, target=0, method=name, **opts).scores
        b = relprop.explain(model, x, target=1, method=name, **opts).scores
        if family in models.TEXT:  # position 0 is [CLS] itself (a rollout's self-entry is ~1)
            a, b = a[:, 1:], b[:, 1:]
        rel = float((a - b).abs().max() / a.abs().max().clamp_min(1e-30))
        if table[name]["class_specific"]:
            assert rel > 1e-3, (name, rel)
        else:
            assert rel == 0.0, (name, rel)


@pytest.mark.parametrize("family", ["timm_deit_tiny_distilled", "hf_distilbert"])
def test_batch_invariance_every_method(zoo, family):
    """Every method: a batch explains like each sample alone (max abs diff < 1e-5, relative to scale)."""
    model = zoo(family)
    for name in _registered():
        if not _applies(name, family):
            continue
        opts = FAST.get(name, {})
        if family in models.VISION:
            x = models.image_batch(model, batch=3, seed=4)
            full = relprop.explain(model, x, target=[0, 1, 2], method=name, **opts)
            for i in range(3):
                alone = relprop.explain(model, x[i:i + 1], target=i, method=name, **opts)
                scale = max(1.0, float(alone.scores.abs().max()))
                assert (full.scores[i] - alone.scores[0]).abs().max() < 1e-5 * scale, name
        else:
            lengths = (6, 3, 8)
            batch = models.text_batch(lengths, first_id=3)
            full = relprop.explain(model, batch, target=[0, 1, 2], method=name, **opts)
            for i, n in enumerate(lengths):
                alone = relprop.explain(model, {k: v[i:i + 1, :n] for k, v in batch.items()}, target=i,
                                        method=name, **opts)
                scale = max(float(alone.scores.abs().max()), 1e-30)
                diff = float((full.scores[i, :n] - alone.scores[0]).abs().max())
                assert diff < 1e-5 * max(scale, 1.0) and diff <= 1e-3 * scale + 1e-12, (name, diff, scale)


def test_text_special_tokens_and_padding_masked(zoo):
    """Text scores: padding and the config's special ids ([CLS]/[SEP]/[PAD]) are 0 and masked."""
    model = zoo("hf_bert_eager")
    cls_id, sep_id = 2, 3
    model.config.cls_token_id, model.config.sep_token_id = cls_id, sep_id
    try:
        batch = models.text_batch((6, 4), first_id=5)
        for i, n in enumerate((6, 4)):
            batch["input_ids"][i, 0] = cls_id
            batch["input_ids"][i, n - 1] = sep_id
        e = relprop.explain(model, batch, target=0)
        assert not e.mask[:, 0].any() and not e.mask[0, 5] and not e.mask[1, 3:].any()
        assert e.mask[0, 1:5].all() and e.mask[1, 1:3].all()
        assert (e.scores[~e.mask] == 0).all()
        assert e.matrix.shape == (2, 6, 6)
    finally:
        del model.config.cls_token_id, model.config.sep_token_id


def test_method_without_blocks_names_what_is_missing():
    """A model without attention: attention methods say so and name the methods that apply."""
    class Mlp(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(4, 8), torch.nn.Linear(8, 3)

        def forward(self, x):
            return self.b(torch.relu(self.a(x)))

    model = Mlp().eval()
    with pytest.raises(relprop.MethodError, match="attention blocks.*input_x_gradient|input_x_gradient.*attention"):
        relprop.explain(model, torch.randn(2, 4), target=0, method="rollout")
