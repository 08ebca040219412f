"""relprop as a Quantus ``explain_func``.

Quantus metrics call ``explain_func(model=model, inputs=x_batch, targets=y_batch, **kwargs)`` with
numpy arrays and expect a numpy array of attributions back (images: ``[batch, 1, H, W]``, which the
metric broadcasts over the colour channels). :func:`quantus_explain_func` answers with the map of a
relprop method: for the rollout-style methods the patch scores upsampled bilinearly to the input
resolution, for the input-level methods (``lrp``, the gradient methods) the pixel relevance summed
over the colour channels (``Explanation.map`` in both cases).

relprop's own perturbation test (:func:`relprop.evaluation.perturbation_curve`) and Quantus's
``PixelFlipping`` remove the same pixels in the same order when given the same map, the same
baseline and steps of whole pixels; the target probabilities they record then agree to float
rounding (``tests/test_interop.py``). Quantus's ``PixelFlipping`` ranks every element of the
attributions broadcast to the input's shape, so for steps of whole pixels give it the map repeated
over the channels (``np.repeat(a, channels, axis=1)``) and ``features_in_step`` = channels × pixels
per step.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..api import explain
from ..errors import InputError
from ..evaluation._util import model_device


def quantus_explain_func(model: torch.nn.Module, inputs: Any, targets: Any, method: str = "transformer_attribution",
                         preset: Any = None, **options) -> np.ndarray:
    """Attributions of ``targets`` for ``inputs`` by a relprop method, in Quantus's format.

    Parameters
    ----------
    model
        the model Quantus evaluates (a ``torch.nn.Module`` returning logits).
    inputs
        ``[batch, C, H, W]`` images or ``[batch, tokens]`` token ids (numpy or torch).
    targets
        one class index per sample (numpy or torch), or one for all.
    method, preset, options
        as for ``relprop.explain``; default Transformer Attribution
        (Chefer, Gur & Wolf, CVPR 2021, Eq. 13-14).

    Returns
    -------
    numpy.ndarray
        ``[batch, 1, H, W]`` for images (``Explanation.map``), ``[batch, tokens]`` for token ids
        (``Explanation.scores``), float32.
    """
    x = torch.as_tensor(np.asarray(inputs) if not torch.is_tensor(inputs) else inputs)
    if x.is_floating_point():
        x = x.float()
    x = x.to(model_device(model))
    t = torch.as_tensor(np.asarray(targets) if not torch.is_tensor(targets) else targets).long()
    if t.dim() == 0:
        t = t.expand(x.shape[0])
    images = x.is_floating_point() and x.dim() == 4
    if not images and (x.is_floating_point() or x.dim() != 2):
        raise InputError(f"quantus_explain_func explains images [batch, C, H, W] or token ids [batch, tokens], "
                         f"not a {x.dtype} tensor of shape {tuple(x.shape)}")
    exp = explain(model, x, target=t.to(x.device), method=method, preset=preset, **options)
    if images and exp.map is None:
        raise InputError(f"method '{exp.method}' gives no map for these images")
    out = exp.map[:, None] if images else exp.scores
    return out.detach().float().cpu().numpy()
