"""The model's tensor behind a parameter or buffer name of a captured program.

``torch.export`` lifts a parameter that is a tensor subclass (a quantized weight of torchao,
``Int8Tensor``, or of another library that stores integers and scales) into the plain tensors it
is made of and names them ``<module>.parametrizations.<name>.original<i>``: the ``i``-th plain tensor
of the subclass, flattened depth first (``__tensor_flatten__``). The graph then computes the
dequantized weight from them (casts, products with the scales) as constants, and the linear rules
see an ordinary floating weight. :func:`model_tensor` finds those tensors on the model as it is.
A module with a real parametrization (``torch.nn.utils.parametrize``: weight norm, as in Wav2Vec2's
positional convolution) has parameters of the same names, ``original0``, ``original1``: those are
the tensors, looked up first.
"""
from __future__ import annotations

from typing import List

import torch

_LIFTED = ".parametrizations."


def plain_tensors(t: torch.Tensor) -> List[torch.Tensor]:
    """The plain tensors a (possibly nested) tensor subclass is made of, depth first; ``[t]`` for a
    plain tensor."""
    flatten = getattr(t, "__tensor_flatten__", None)
    if flatten is None or type(t) in (torch.Tensor, torch.nn.Parameter):
        return [t]
    names, _ = flatten()
    return [p for name in names for p in plain_tensors(getattr(t, name))]


def model_tensor(model: torch.nn.Module, target: str, kind: str = "param") -> torch.Tensor:
    """``model.get_parameter(target)`` (``get_buffer`` for ``kind="buffer"``), also for a name
    ``torch.export`` gave a piece of a tensor-subclass parameter (module docstring)."""
    get = model.get_parameter if kind == "param" else model.get_buffer
    if _LIFTED not in target:
        return get(target)
    try:  # a real parametrization (torch.nn.utils.parametrize, e.g. Wav2Vec2's weight norm) owns these names
        return get(target)
    except AttributeError:
        pass
    owner, rest = target.split(_LIFTED, 1)
    name, piece = rest.rsplit(".", 1)
    module = model.get_submodule(owner) if owner else model
    whole = getattr(module, name)
    return plain_tensors(whole)[int(piece[len("original"):])]
