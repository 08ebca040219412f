"""The z^B rule of the patch embedding (CVPR 2021 supplementary §B) where the convolution reads the pixels
through a rearrangement of them: a model that cuts its image into rows of patches (reshape, permute,
expand), as Qwen2-VL's processor and relprop's QwenImage do, then embeds each patch by a convolution.

The reference is the same function written with the convolution reading the image directly (one image,
per-sample bounds = the image's min and max): the rearranged model must be explained exactly like it, under
both presets that use z^B. Before, the rearranged convolution got alpha1-beta0 (a rule for hidden layers)."""
from __future__ import annotations

import pytest
import torch

import relprop
import vlm_models as V
from relprop.api import prepare
from relprop.models import qwen_images

P, C, K, H, W = 4, 3, 5, 8, 12  # patch, channels, embedding, image


class Direct(torch.nn.Module):
    """image [1, C, H, W] -> patch embedding (stride-P convolution) -> tokens in row-major order -> head."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Conv2d(C, K, P, stride=P, bias=False)
        self.head = torch.nn.Linear(K * (H // P) * (W // P), 3)

    def forward(self, pixel_values):
        t = self.embed(pixel_values)  # [1, K, H/P, W/P]
        return self.head(t.permute(0, 2, 3, 1).reshape(1, -1))


class Rows(Direct):
    """The same function, the image first cut into its patches [H/P * W/P, C, P, P] (the patches are the
    convolution's axis 0, not samples)."""

    def forward(self, pixel_values):
        x = pixel_values.reshape(C, H // P, P, W // P, P).permute(1, 3, 0, 2, 4).reshape(-1, C, P, P)
        t = self.embed(x)  # [H/P * W/P, K, 1, 1]
        return self.head(t.reshape(1, -1))


@pytest.mark.parametrize("preset", ["chefer2021", "lrp"])
def test_a_convolution_over_rows_of_patches_gets_z_box_with_the_images_bounds(preset):
    direct, rows = Direct(), Rows()
    rows.load_state_dict(direct.state_dict())
    x = torch.randn(1, C, H, W, generator=torch.Generator().manual_seed(1)) * 2 + 0.5
    torch.testing.assert_close(rows(x), direct(x))
    ref = relprop.explain(direct, x, target=2, method="lrp", preset=preset)
    got = relprop.explain(rows, x, target=2, method="lrp", preset=preset)
    torch.testing.assert_close(got.input_relevance, ref.input_relevance, rtol=1e-5, atol=1e-6)
    # z^B, not alpha1-beta0: a pixel at the image's lower bound with positive weights still gets relevance
    assert (ref.input_relevance != 0).float().mean() > 0.9
    marks = prepare(rows, x, None).captured.analysis.pixel_convs
    assert list(marks.values()) == ["whole"]
    assert list(prepare(direct, x, None).captured.analysis.pixel_convs.values()) == [True]


def test_a_batch_of_rows_keeps_bounds_per_row():
    """Several samples and the sample axis lost: bounds along axis 0 (per row of patches), as before, never
    across the samples (each sample is explained as alone)."""
    class Batch(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.embed = torch.nn.Conv2d(C, K, P, stride=P, bias=False)

        def forward(self, pixel_values):
            b = pixel_values.shape[0]
            x = pixel_values.reshape(b, C, H // P, P, W // P, P).permute(0, 2, 4, 1, 3, 5).reshape(-1, C, P, P)
            return self.embed(x).reshape(b, -1).sum(-1, keepdim=True) * torch.ones(1, 2)

    m = Batch()
    x = torch.randn(2, C, H, W, generator=torch.Generator().manual_seed(2))
    assert list(prepare(m, x, None).captured.analysis.pixel_convs.values()) == [True]


def test_qwen_patch_embedding_reads_the_images_pixels():
    """Qwen2-VL's Conv3d patch embedding over the rows QwenImage cuts: z^B with the image's bounds."""
    model = V.qwen2_vl()
    inputs = V.qwen_inputs(V.qwen_image())
    wrapped, kwargs = qwen_images.explained_call(model, inputs)
    marks = prepare(wrapped, kwargs, "pixel_values").captured.analysis.pixel_convs
    assert list(marks.values()) == ["whole"], marks
