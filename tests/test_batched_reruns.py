"""Value zeroing evaluates the zeroed tokens of a block as one batched re-run (``batch_size``
rows): the same numbers as one re-run per token (``batch_size=1``)."""
import pytest

import models
import relprop


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
