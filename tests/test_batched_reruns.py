"""Methods that re-run the model batch their re-runs without changing their results.

* value zeroing evaluates the zeroed tokens of a block as one batched re-run (``batch_size`` rows):
  the same numbers as one re-run per token (``batch_size=1``);
* SmoothGrad, Integrated Gradients and ViT-CX take no gradients in the engine's trace pass (they
  re-run the model for what they read): the same numbers as with a trace that has them (another
  method in the same call asks for them).
"""
import pytest
import torch

import models
import relprop

OPTIONS = {"smoothgrad": {"n_samples": 2, "batch_size": 3}, "integrated_gradients": {"n_steps": 3, "batch_size": 2}}


@pytest.mark.slow
def test_value_zeroing_batched_equals_token_by_token(zoo):
    """One batched re-run per block (default) against one re-run per zeroed token, padded text."""
    model = zoo("hf_bert_eager")
    batch = models.text_batch((7, 5, 9), first_id=3)
    many = relprop.explain(model, batch, target=0, method="value_zeroing")
    some = relprop.explain(model, batch, target=0, method="value_zeroing", batch_size=6)  # 2 tokens a re-run
    one = relprop.explain(model, batch, target=0, method="value_zeroing", batch_size=1)
    for e in (many, some):
        assert float((e.matrix - one.matrix).abs().max()) <= 1e-6
        assert float((e.scores - one.scores).abs().max()) <= 1e-6 * float(one.scores.abs().max())


@pytest.mark.slow
def test_value_zeroing_batch_size_checked(zoo):
    model = zoo("timm_vit_tiny")
    with pytest.raises(relprop.MethodError, match="batch_size"):
        relprop.explain(model, models.image_batch(model), method="value_zeroing", batch_size=0)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(OPTIONS))
def test_trace_without_gradients_same_results(zoo, name):
    """Alone, the method's trace has no gradients; with input_x_gradient in the same call it has
    them; the method's numbers are the same bit for bit."""
    model = zoo("timm_vit_tiny")
    x = models.image_batch(model, batch=2, seed=3)
    alone = relprop.explain(model, x, target=1, method=name, **OPTIONS[name])
    both = relprop.explain(model, x, target=1, method=[name, "input_x_gradient"], **OPTIONS[name])[0]
    assert torch.equal(alone.scores, both.scores) and torch.equal(alone.map, both.map)
    assert all(b.gradient is None and b.hidden_gradient is None for b in alone.blocks)
    assert all(b.gradient is not None for b in both.blocks)
