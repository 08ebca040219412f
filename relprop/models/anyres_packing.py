"""How LLaVA-NeXT and LLaVA-OneVision pack an any-resolution image's tile features into image tokens,
written out, and checked against the model's own ``pack_image_features``.

Both models run the base image and the ``rows x cols`` crops through the vision tower (``gh x gw``
patch features per tile), lay the crops' features out as one ``rows·gh x cols·gw`` grid, **unpad**
it (``unpad_image``: the ``uh x uw`` patches the image covers, not the padding), append an
``image_newline`` after each row and put the base image's ``gh·gw`` features first.
LLaVA-OneVision adds one step between the unpadding and the newlines (``vision_aspect_ratio =
"anyres_max_N"``): when the unpadded grid holds more than about N tiles' worth of patches
(``ratio = sqrt(uh·uw / (N·gh²)) > 1.1``) it **shrinks** the grid to ``oh x ow = ⌊uh / ratio⌋ x ⌊uw /
ratio⌋`` with ``torch.nn.functional.interpolate(mode="bilinear")`` (``align_corners=False``). Each of
its tokens is then a weighted sum of up to 2 x 2 patches' features, the weights the product of a row
weight and a column weight (bilinear interpolation is separable):

    token[i, j] = Σ_a Σ_b Wh[i, a] · Ww[j, b] · patch[a, b],   Σ_a Wh[i, a] = Σ_b Ww[j, b] = 1

relprop reads ``Wh`` and ``Ww`` from the same ``interpolate`` call on the unit vectors of each axis
(:func:`line_weights`), and before it places any token checks the whole picture (order, unpadding,
shrinking, newlines) against the model: :func:`check_packing` runs the model's own
``pack_image_features`` on random tile features and compares its tokens with :func:`packed_tokens`.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Optional, Tuple

import torch
import torch.nn.functional as F

from ..errors import MethodError


@dataclasses.dataclass(frozen=True)
class AnyresLayout:
    """``rows x cols`` crops of ``size`` pixels in ``patch``-pixel patches; ``kept``: the composed
    grid's patch index (row-major over ``rows·gh x cols·gw``) of each crop patch after unpadding,
    ``[uh, uw]`` (empty when the image is one tile); ``shrunk``: ``(oh, ow)``, the crop token grid
    LLaVA-OneVision interpolates the unpadded grid down to (None: not shrunk)."""

    rows: int
    cols: int
    size: Tuple[int, int]
    patch: int
    kept: torch.Tensor
    shrunk: Optional[Tuple[int, int]] = None

    @property
    def tile_grid(self) -> Tuple[int, int]:
        return self.size[0] // self.patch, self.size[1] // self.patch

    @property
    def grid(self) -> Tuple[int, int]:
        gh, gw = self.tile_grid
        return (gh * self.rows, gw * self.cols) if self.rows else (gh, gw)

    @property
    def token_grid(self) -> Tuple[int, int]:
        """(rows, columns) of crop tokens: the unpadded grid, or the shrunk one."""
        return self.shrunk if self.shrunk is not None else tuple(self.kept.shape)

    @property
    def tokens(self) -> int:
        """Image tokens of the image: the base image's, the crops' (after unpadding and shrinking)
        and one newline per row (one newline for an image of one tile)."""
        gh, gw = self.tile_grid
        if not self.rows:
            return gh * gw + 1
        oh, ow = self.token_grid
        return gh * gw + oh * (ow + 1)


def shrunk_size(vision_aspect_ratio: Optional[str], unpadded: Tuple[int, int], side: int) -> Optional[Tuple[int, int]]:
    """``(oh, ow)`` LLaVA-OneVision's ``pack_image_features`` interpolates an unpadded crop grid of
    ``unpadded`` patches down to under ``vision_aspect_ratio = "anyres_max_N"`` (tiles of ``side x
    side`` patches; module docstring), or None when it keeps the grid (no ``vision_aspect_ratio``:
    LLaVA-NeXT)."""
    if vision_aspect_ratio is None:
        return None
    most = int(vision_aspect_ratio.strip("anyres_max_"))  # the model's own parse of "anyres_max_N"
    uh, uw = unpadded
    ratio = math.sqrt(uh * uw / (most * side ** 2))
    return (int(uh // ratio), int(uw // ratio)) if ratio > 1.1 else None


def line_weights(n_in: int, n_out: int) -> torch.Tensor:
    """[n_out, n_in] float64: the weights of bilinear interpolation (``align_corners=False``) from
    ``n_in`` to ``n_out`` points along one axis, read from ``interpolate`` on the unit vectors."""
    eye = torch.eye(n_in, dtype=torch.float64)[None, :, :, None]  # channel a: unit vector a along the axis
    return F.interpolate(eye, size=(n_out, 1), mode="bilinear")[0, :, :, 0].T.contiguous()


def spread(tokens: torch.Tensor, lay: AnyresLayout) -> torch.Tensor:
    """[..., uh, uw] from crop-token values [..., oh, ow]: each token's value spread over the patches
    it interpolates by their bilinear weights (Σ unchanged: each token's weights sum to 1); the
    values themselves when the grid is not shrunk."""
    if lay.shrunk is None:
        return tokens
    (oh, ow), (uh, uw) = lay.shrunk, tuple(lay.kept.shape)
    wh, ww = line_weights(uh, oh).to(tokens), line_weights(uw, ow).to(tokens)
    return torch.einsum("...ij,ia,jb->...ab", tokens, wh, ww)


def packed_tokens(features: torch.Tensor, lay: AnyresLayout) -> torch.Tensor:
    """[tokens, k]: relprop's picture of ``pack_image_features`` on tile features [tiles, gh·gw, k]
    with an all-zero ``image_newline`` (module docstring)."""
    gh, gw = lay.tile_grid
    k = features.shape[-1]
    base = features[0]
    if not lay.rows:
        return torch.cat([base, base.new_zeros(1, k)])
    crops = features[1:].reshape(lay.rows, lay.cols, gh, gw, k).permute(4, 0, 2, 1, 3)
    grid = crops.reshape(k, -1)[:, lay.kept.reshape(-1)].reshape(k, *lay.kept.shape)
    if lay.shrunk is not None:
        (oh, ow), (uh, uw) = lay.shrunk, tuple(lay.kept.shape)
        grid = torch.einsum("ia,jb,kab->kij", line_weights(uh, oh).to(grid), line_weights(uw, ow).to(grid), grid)
    grid = torch.cat([grid, grid.new_zeros(k, grid.shape[1], 1)], 2)  # the newline after each row
    return torch.cat([base, grid.reshape(k, -1).T])


def check_packing(model: Any, lay: AnyresLayout, size, extra: Mapping[str, Any], name: str) -> None:
    """Run the model's ``pack_image_features`` (with ``extra``, its family's arguments) on random tile
    features of ``lay`` and the image size ``size`` and compare its tokens with
    :func:`packed_tokens`.

    Raises
    ------
    MethodError
        the model packs the tiles otherwise (or its ``pack_image_features`` cannot be run).
    """
    gh, gw = lay.tile_grid
    tiles = 1 + lay.rows * lay.cols
    probe = torch.randn(tiles, gh * gw, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    inner = getattr(model, "model", model)
    try:
        got = inner.pack_image_features(image_features=[probe], image_sizes=[list(size)],
                                        image_newline=probe.new_zeros(3), **extra)[0][0]
    except Exception as e:  # noqa: BLE001 - any failure: the packing cannot be checked, so it is refused
        raise MethodError(f"{name}: relprop checks its picture of the image tokens against the model's "
                          f"pack_image_features, which failed on a probe ({type(e).__name__}: {e}); relprop does "
                          "not know this version's packing") from None
    want = packed_tokens(probe, lay)
    if tuple(got.shape) != tuple(want.shape) or not torch.allclose(got, want, rtol=1e-9, atol=1e-12):
        raise MethodError(f"{name}: the model's pack_image_features packs the {lay.rows}x{lay.cols} tiles of this "
                          f"image into {tuple(got.shape)[0]} tokens otherwise than relprop's picture of it (the base "
                          f"image, the unpadded {lay.kept.shape[0]}x{lay.kept.shape[1]} crop patches"
                          + (f" shrunk to {lay.shrunk[0]}x{lay.shrunk[1]}" if lay.shrunk else "")
                          + ", a newline per row); relprop does not place its image tokens")
