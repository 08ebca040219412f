"""Explanations as soft segmentations (Chefer, Gur & Wolf, CVPR 2021, §4 and Table 2).

Each map is compared with a binary object mask (True = foreground):

* **pixel accuracy** and **mIoU** after thresholding the map at its own mean (a pixel is foreground
  where map > mean of that map, as the authors' ``imagenet_seg_eval.py``, which min-max normalizes
  the map first: the same threshold);
* mIoU is the mean of the IoU of the two classes, foreground and background (Table 2's "mIoU" is
  over these two classes). A class absent from both the thresholded map and the mask (empty union)
  is left out of that mean;
* **mAP**: the average precision of the soft map as a score for the foreground pixels
  (``sklearn.metrics.average_precision_score``), threshold-free. Undefined (NaN) for a mask with no
  foreground, and such images are left out of the average.

Every number is computed **per image** and then averaged over the images. (The authors' script pools
the intersections and unions over the whole dataset before dividing, and its AP scores the map
against both classes; :attr:`SegmentationResult.pooled_miou` gives the pooled variant.)
A map whose size differs from its mask's is resized to it bilinearly first.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import InputError
from ..explanation import Explanation
from . import _util


@dataclasses.dataclass
class SegmentationResult:
    """Per-image segmentation scores (arrays of length [images]) and their means.

    ``intersection`` and ``union`` are [images, 2] pixel counts (background, foreground), kept for the
    pooled mIoU.
    """

    pixel_accuracy: np.ndarray
    iou_foreground: np.ndarray
    iou_background: np.ndarray
    miou: np.ndarray
    ap: np.ndarray
    intersection: np.ndarray
    union: np.ndarray

    def __len__(self) -> int:
        return int(self.pixel_accuracy.shape[0])

    @property
    def mean_pixel_accuracy(self) -> float:
        return _nanmean(self.pixel_accuracy)

    @property
    def mean_miou(self) -> float:
        return _nanmean(self.miou)

    @property
    def mean_ap(self) -> float:
        """mAP: mean over the images of their average precision."""
        return _nanmean(self.ap)

    @property
    def pooled_miou(self) -> float:
        """mIoU with intersections and unions summed over all images first (the authors' script)."""
        inter, union = self.intersection.sum(0), self.union.sum(0)
        ok = union > 0
        return float((inter[ok] / union[ok]).mean()) if ok.any() else float("nan")

    @staticmethod
    def concat(results: Sequence["SegmentationResult"]) -> "SegmentationResult":
        results = list(results)
        if not results:
            raise InputError("no results to concatenate")
        return SegmentationResult(*[np.concatenate([getattr(r, f.name) for r in results], axis=0)
                                    for f in dataclasses.fields(SegmentationResult)])

    def __repr__(self) -> str:
        return (f"SegmentationResult(images={len(self)}, pixel_accuracy={self.mean_pixel_accuracy:.4f}, "
                f"miou={self.mean_miou:.4f}, map={self.mean_ap:.4f})")


def segmentation_scores(maps: Any, masks: Any) -> SegmentationResult:
    """Pixel accuracy, mIoU (threshold at each map's mean) and AP (soft map) of each map against its mask.

    Parameters
    ----------
    maps
        an ``relprop.Explanation`` of images (its ``map``), or [images, H, W] maps.
    masks
        [images, H, W] (or [images, 1, H, W]) masks; nonzero = foreground.

    Returns
    -------
    SegmentationResult
    """
    if isinstance(maps, Explanation):
        if maps.map is None:
            raise InputError(f"explanation '{maps.method}' has no image map (text explanations cannot be "
                             "scored as segmentations)")
        maps = maps.map
    maps = torch.as_tensor(maps).detach().float()
    masks = torch.as_tensor(masks).detach()
    if masks.dim() == 4 and masks.shape[1] == 1:
        masks = masks[:, 0]
    if maps.dim() == 4 and maps.shape[1] == 1:
        maps = maps[:, 0]
    if maps.dim() != 3 or masks.dim() != 3 or maps.shape[0] != masks.shape[0]:
        raise InputError(f"maps {tuple(maps.shape)} and masks {tuple(masks.shape)}: expected [images, H, W] each")
    masks = masks.to(maps.device) != 0
    if maps.shape[-2:] != masks.shape[-2:]:
        maps = F.interpolate(maps[:, None], size=tuple(masks.shape[-2:]), mode="bilinear", align_corners=False)[:, 0]
    maps = torch.nan_to_num(maps, nan=0.0)
    n = maps.shape[0]
    flat, truth = maps.reshape(n, -1), masks.reshape(n, -1)
    pred = flat > flat.mean(1, keepdim=True)
    accuracy = (pred == truth).float().mean(1)
    inter = torch.stack([(~pred & ~truth).sum(1), (pred & truth).sum(1)], 1).double()
    union = torch.stack([(~pred | ~truth).sum(1), (pred | truth).sum(1)], 1).double()
    iou = torch.where(union > 0, inter / union.clamp_min(1), torch.full_like(union, float("nan")))
    miou = _util.to_numpy(iou)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        miou_mean = np.nanmean(miou, axis=1)
    truth_np, flat_np = _util.to_numpy(truth), _util.to_numpy(flat).astype(np.float64)
    from sklearn.metrics import average_precision_score  # imported when used (start-up time)
    ap = np.array([average_precision_score(truth_np[i], flat_np[i]) if truth_np[i].any() else np.nan
                   for i in range(n)], dtype=np.float64)
    return SegmentationResult(pixel_accuracy=_util.to_numpy(accuracy).astype(np.float64),
                              iou_foreground=miou[:, 1], iou_background=miou[:, 0], miou=miou_mean, ap=ap,
                              intersection=_util.to_numpy(inter), union=_util.to_numpy(union))


def _nanmean(a: np.ndarray) -> float:
    a = np.asarray(a, dtype=np.float64)
    ok = ~np.isnan(a)
    return float(a[ok].mean()) if ok.any() else float("nan")
