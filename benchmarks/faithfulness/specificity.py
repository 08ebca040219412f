"""Class-specificity on two-object images (Chefer, Gur & Wolf, CVPR 2021, Fig. 3): explain each of the
two classes of an image and see whether the map lands on the object of the explained class.

Per explanation: the share of the map's positive mass that lies on the explained object among the two
objects (0.5 = the two objects get the same mass, as a class-agnostic map does on average), whether
the map's maximum lies on the explained object, and relprop.evaluation.segmentation_scores of the map
against the explained object's mask and against the other object's mask (AP, mIoU).
"""
from __future__ import annotations

from typing import Dict, List

import numpy as np
import torch

import relprop
import relprop.evaluation as E

import synth


def _mass_share(maps: torch.Tensor, own: torch.Tensor, other: torch.Tensor) -> np.ndarray:
    """Share of the positive part of each map on the explained object among both objects (NaN where
    the map has no positive mass on either)."""
    pos = maps.float().clamp_min(0)
    a = (pos * own).sum((1, 2))
    b = (pos * other).sum((1, 2))
    s = a / (a + b)
    return torch.where((a + b) > 0, s, torch.full_like(s, float("nan"))).numpy()


def class_specificity(model, two: Dict, methods: List[str], opts: Dict, batch: int) -> Dict[str, Dict]:
    """Explain each of the two classes of every two-object image (paper Fig. 3) and score the maps against
    the explained object's mask and the other object's mask."""
    x = synth.normalize(two["images"])
    cls, masks = two["classes"], two["masks"]
    share = {m: [] for m in methods}
    seg_own = {m: [] for m in methods}
    seg_other = {m: [] for m in methods}
    top1 = {m: [] for m in methods}
    for s in range(0, x.shape[0], batch):
        xs = x[s:s + batch]
        for o in (0, 1):
            own, other = masks[s:s + batch, o], masks[s:s + batch, 1 - o]
            exps = relprop.explain(model, xs, target=cls[s:s + batch, o], method=methods, **opts)
            for m, e in zip(methods, exps):
                share[m].append(_mass_share(e.map, own, other))
                seg_own[m].append(E.segmentation_scores(e, own))
                seg_other[m].append(E.segmentation_scores(e, other))
                flat = e.map.reshape(e.map.shape[0], -1)
                arg = flat.argmax(1)
                top1[m].append((own.reshape(own.shape[0], -1).gather(1, arg[:, None])[:, 0]).numpy())
    out = {}
    for m in methods:
        sh = np.concatenate(share[m])
        so, sx = E.SegmentationResult.concat(seg_own[m]), E.SegmentationResult.concat(seg_other[m])
        out[m] = {"spec_share": float(np.nanmean(sh)), "spec_top1_on_own": float(np.concatenate(top1[m]).mean()),
                  "spec_ap_own": so.mean_ap, "spec_ap_other": sx.mean_ap, "spec_miou_own": so.mean_miou}
    return out
