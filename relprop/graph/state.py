"""Leave the model exactly as it was: train/eval flags are restored in a ``finally``.

relprop never patches a class, a module or a global. The only thing it changes, for the duration
of a capture, is the ``training`` flag of the model's modules (``torch.export`` must see the model
in eval mode so that dropout is not baked into the graph); :func:`eval_mode` puts every flag back,
also when the capture raises.
"""
from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def eval_mode(model: torch.nn.Module):
    """Temporarily put every submodule in eval mode; restore each module's own flag afterwards."""
    flags = [(m, m.training) for m in model.modules()]
    try:
        for m, _ in flags:
            m.training = False
        yield model
    finally:
        for m, flag in flags:
            m.training = flag
