"""Weight-only quantized linear layers (torchao ``quantize_``: int8 per channel, int4 per group).

``torch.export`` lifts a quantized weight (a tensor subclass holding integers and scales) into its
plain tensors, and the graph dequantizes it, as constants, before the product: the linear rules
see an ordinary floating weight (``relprop.graph.parameters`` binds the pieces to the model's
tensors). The reference is the same model with every quantized weight replaced by its dequantized
float tensor (``weight.dequantize()``): every method's explanation equals the reference's to float
rounding, and the quantized model is left as it was. Skipped when torchao is not installed
(``pip install relprop[quant]``).
"""
import copy
import importlib.util
import warnings

import pytest
import torch

import llm_models
import relprop
from relprop.graph.parameters import plain_tensors

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="torchao is not installed"),
              pytest.mark.slow]

CALLS = {"lrp@attnlrp": dict(method="lrp", preset="attnlrp"),
         "lrp@attnlrp/interpreter": dict(method="lrp", preset="attnlrp", fast_path=False),
         "transformer_attribution": dict(method="transformer_attribution"),
         "lrp": dict(method="lrp")}


def _configs():
    from torchao.quantization import Int8WeightOnlyConfig, IntxWeightOnlyConfig
    return {"int8": Int8WeightOnlyConfig(), "int4": IntxWeightOnlyConfig(weight_dtype=torch.int4)}


def _quantized(name, config):
    from torchao.quantization import quantize_
    model = llm_models.build(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantize_(model, _configs()[config])
    return model


def dequantized(model):
    """A copy whose quantized weights are replaced by their dequantized float tensors."""
    plain = copy.deepcopy(model)
    for module in plain.modules():
        w = getattr(module, "weight", None)
        if isinstance(w, torch.Tensor) and type(w) not in (torch.Tensor, torch.nn.Parameter):
            module.weight = torch.nn.Parameter(w.dequantize(), requires_grad=False)
    return plain


@pytest.mark.parametrize("config", ["int8", "int4"])
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_quantized_equals_dequantized(name, config):
    model = _quantized(name, config)
    kinds = {type(m.weight).__name__ for m in model.modules() if isinstance(m, torch.nn.Linear)}
    assert kinds - {"Parameter", "Tensor"}, kinds  # the linear layers are quantized
    reference = dequantized(model)
    x = llm_models.batch()
    before = {k: [t.clone() for t in plain_tensors(v)] for k, v in model.state_dict().items() if torch.is_tensor(v)}
    for label, kw in CALLS.items():
        got = relprop.explain(model, x, target="next_token", **kw)
        ref = relprop.explain(reference, x, target="next_token", **kw)
        torch.testing.assert_close(got.target_scores, ref.target_scores, rtol=1e-5, atol=1e-6)
        scale = float(ref.scores.abs().max())
        assert float((got.scores - ref.scores).abs().max()) <= 1e-4 * scale, label
    after = model.state_dict()
    assert all(all(torch.equal(a, b) for a, b in zip(v, plain_tensors(after[k]))) for k, v in before.items())
