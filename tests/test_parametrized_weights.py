"""Weights under a real parametrization (``torch.nn.utils.parametrize``, e.g. weight norm as in
Wav2Vec2's positional convolution): ``torch.export`` names their tensors
``<module>.parametrizations.weight.original0/1`` like the lifted pieces of a quantized weight, but
here they are the module's own parameters (relprop/graph/parameters.py looks them up first).
Reference: the same model with the parametrization removed (the computed weight kept as a plain
parameter): every method explains both alike, and the parametrized model is left as it was."""
import pytest
import torch
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import weight_norm

import relprop
from tests import models


def _weight_normed():
    torch.manual_seed(0)
    model = models.hf_bert()
    for layer in model.bert.encoder.layer:
        weight_norm(layer.intermediate.dense, "weight")
    weight_norm(model.classifier, "weight")
    return model


@pytest.fixture(scope="module")
def pair():
    # two builds, not a deepcopy: a parametrized module's class is made for it and a copy shares it,
    # so removing the copy's parametrization would remove the original's too
    model, plain = _weight_normed(), _weight_normed()
    for module in plain.modules():
        if parametrize.is_parametrized(module):
            parametrize.remove_parametrizations(module, "weight", leave_parametrized=True)
    return model, plain


@pytest.mark.parametrize("call", [dict(method="lrp", preset="attnlrp"), dict(method="transformer_attribution"),
                                  dict(method="lrp", preset="attnlrp", fast_path=False)])
def test_weight_norm_explains_like_its_plain_weights(pair, call):
    model, plain = pair
    batch = models.text_batch()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    got = relprop.explain(model, batch, target=1, **call)
    want = relprop.explain(plain, batch, target=1, **call)
    scale = want.scores.abs().max()
    assert scale > 0
    assert torch.allclose(got.scores, want.scores, rtol=0, atol=1e-5 * scale), (got.scores - want.scores).abs().max()
    assert parametrize.is_parametrized(model.classifier, "weight")
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
