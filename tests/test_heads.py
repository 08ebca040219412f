"""exp.heads (per-head maps of the query row, DINO / the survey's ref. [4]) and the one-panel-per-head
picture: checked against the attention records with loops, placed like the scores."""
import matplotlib
import pytest
import torch

import models
import relprop
from relprop.viz import heads_figure

matplotlib.use("Agg")


@pytest.fixture(scope="module")
def vit():
    model = models.timm_vit_tiny()
    return model, models.image_batch(model, batch=2)


def test_heads_are_the_query_rows_of_each_head(vit):
    model, x = vit
    for block in (0, 1):
        e = relprop.explain(model, x, target=1, method="raw_attention", end_block=block + 1)
        A = e.blocks[block].attention
        b, H, n, _ = A.shape
        assert tuple(e.heads.shape) == (b, H, n - 1)  # the class token is not a patch
        for s in range(b):
            for h in range(H):
                for j in range(1, n):
                    assert float(e.heads[s, h, j - 1]) == pytest.approx(float(A[s, h, 0, j]), abs=1e-7)
        # the mean over the heads is raw attention's scores
        assert torch.allclose(e.heads.mean(1), e.scores, atol=1e-6)


def test_heads_of_gradient_methods_and_none_elsewhere(vit):
    model, x = vit
    e = relprop.explain(model, x, target=1, method="gradient_rollout")
    last = e.blocks[-1]
    ref = (last.gradient * last.attention).clamp(min=0)[:, :, 0, 1:]
    assert torch.allclose(e.heads, ref, atol=1e-7)
    e = relprop.explain(model, x, target=1, method="attention_norm", head_fusion="max")
    assert torch.allclose(e.heads.amax(1), e.scores, atol=1e-6)
    assert relprop.explain(model, x, target=1, method="lrp").heads is None


def test_heads_text_masks_padding():
    model = models.hf_bert()
    batch = models.text_batch((7, 4))
    e = relprop.explain(model, batch, target=1, method="rollout")
    assert tuple(e.heads.shape) == (2, 4, 7)
    assert bool((e.heads[1, :, 4:] == 0).all())


def test_heads_figure_has_one_panel_per_head(vit):
    model, x = vit
    e = relprop.explain(model, x, target=1, method="raw_attention")
    fig = heads_figure(e, 0, image=x[0])
    assert len(fig.axes) == e.heads.shape[1] and [a.get_title() for a in fig.axes][0] == "head 0"
    with pytest.raises(relprop.InputError, match="no per-head maps"):
        heads_figure(relprop.explain(model, x, target=1, method="lrp"))
