"""Activation maximization (the survey of transformer explainability methods, §2.4; Erhan et al. 2009;
Simonyan et al. 2014; Olah et al., "Feature Visualization", Distill 2017): the input that maximizes
one unit of the model,

    I* = argmax_I  S(I) − λ‖I‖²,

found by gradient ascent. :func:`maximize_activation` evaluates the model through its captured graph (the same
``torch.export`` capture :func:`relprop.explain` uses, so any block of any supported model can be
read without hooks on the model); the model is not modified.

Units (a string, or a :class:`Unit`):

=====================  ===================================================================================
``class:C``            the score (logit) of class C
``neuron:B:I[:T]``     hidden unit I of the MLP of block B (the activation after its first linear layer)
                       at token T; without T, its mean over the tokens
``channel:B:I``        the same unit's mean over every token (a "channel" of the feature map)
``head:B:H``           the attention head H of block B pays to the class token (token 0), averaged over
                       the other tokens' queries
``norm:B:T``           the norm of token T's output of block B
``layer:B``            the mean of the output activations of block B
=====================  ===================================================================================

Images are optimized at the model's input size in its normalized input space and kept within the
range of valid pixels ([0, 1] before the normalization). Text models get a relaxed input: a sequence
of free vectors in place of the word embeddings, reported as the nearest tokens (cosine similarity
with the embedding matrix). Regularizers: the survey's L2 (``l2``), and the common remedies for the
patch checkerboard of ViTs: ``jitter`` (random shifts of up to that many pixels each step, Mordvintsev
et al. 2015), ``blur`` (a Gaussian blur of that σ every ``blur_every`` steps, Yosinski et al. 2015) and
``tv`` (total variation, Mahendran & Vedaldi 2015). Seeded and deterministic.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from ..api import prepare
from ..engine.forward import forward
from ..errors import InputError, OptionError
from ..graph.nodes import module_paths
from ..targets import logits_of
from ..api.raw_inputs import model_image_size

aten = torch.ops.aten

#: unit kinds and what they read
UNIT_KINDS = ("class", "neuron", "channel", "head", "norm", "layer")
_ACTIVATIONS = {aten.gelu.default, aten.silu.default, aten.relu.default}


@dataclasses.dataclass(frozen=True)
class Unit:
    """One unit to maximize (see the module docstring): ``kind`` and its indices."""

    kind: str
    block: Optional[int] = None
    index: Optional[int] = None
    token: Optional[int] = None

    @staticmethod
    def parse(spec: Any) -> "Unit":
        """A :class:`Unit` from ``"class:207"``, ``"neuron:3:100"``, ``"neuron:3:100:5"``,
        ``"channel:3:100"``, ``"head:11:2"``, ``"norm:5:0"``, ``"layer:4"``; an int is a class."""
        if isinstance(spec, Unit):
            return spec
        if isinstance(spec, int) and not isinstance(spec, bool):
            return Unit("class", index=spec)
        text = str(spec).strip()
        m = re.fullmatch(r"([a-z]+)((?::-?\d+)*)", text)
        kind = m.group(1) if m else None
        nums = [int(v) for v in m.group(2).split(":")[1:]] if m else []
        want = {"class": (1, 1), "neuron": (2, 3), "channel": (2, 2), "head": (2, 2), "norm": (2, 2), "layer": (1, 1)}
        if kind not in want or not want[kind][0] <= len(nums) <= want[kind][1]:
            raise OptionError(f"unit {spec!r} is not a unit. Choices: class:C, neuron:B:I[:T], channel:B:I, head:B:H, "
                              "norm:B:T, layer:B (B a block counted from the input, negative from the output)")
        if kind == "class":
            return Unit("class", index=nums[0])
        if kind == "layer":
            return Unit("layer", block=nums[0])
        if kind in ("norm",):
            return Unit("norm", block=nums[0], token=nums[1])
        return Unit(kind, block=nums[0], index=nums[1], token=nums[2] if len(nums) > 2 else None)

    def __str__(self) -> str:
        parts = [self.kind] + [str(v) for v in (self.block, self.index, self.token) if v is not None]
        return ":".join(parts)


@dataclasses.dataclass
class MaximizingInput:
    """What :func:`maximize_activation` found: the input that maximizes the unit.

    Attributes
    ----------
    unit : the unit maximized.
    input : the optimized model input ([1, C, H, W] normalized pixels, or [1, length, hidden]
        relaxed word embeddings for text).
    image : [H, W, 3] float array in [0, 1] (images; None for text).
    values : the unit's value at every step (before the step's update; with ``jitter``, on that
        step's shifted copy), then at the result (``input`` itself, never shifted).
    start_value : the unit's value on the random start (``values[0]``).
    tokens : text models: the nearest token of each relaxed position (None for images).
    """

    unit: Unit
    input: torch.Tensor
    image: Any
    values: List[float]
    tokens: Optional[List[str]] = None

    @property
    def start_value(self) -> float:
        return self.values[0]

    def save(self, path: str) -> str:
        """Write the image as a PNG (images only)."""
        if self.image is None:
            raise InputError("a text model's maximizing input has no image; read .tokens")
        from PIL import Image  # optional dependency (relprop[viz])
        import numpy as np
        Image.fromarray((np.clip(self.image, 0, 1) * 255).round().astype("uint8")).save(path)
        return path


def _gaussian_blur(x: torch.Tensor, sigma: float) -> torch.Tensor:
    radius = max(1, int(round(2 * sigma)))
    t = torch.arange(-radius, radius + 1, dtype=x.dtype, device=x.device)
    k = torch.exp(-(t ** 2) / (2 * sigma ** 2))
    k = k / k.sum()
    c = x.shape[1]
    x = F.conv2d(F.pad(x, (radius, radius, 0, 0), mode="reflect"), k.view(1, 1, 1, -1).repeat(c, 1, 1, 1), groups=c)
    return F.conv2d(F.pad(x, (0, 0, radius, radius), mode="reflect"), k.view(1, 1, -1, 1).repeat(c, 1, 1, 1), groups=c)


def total_variation(x: torch.Tensor) -> torch.Tensor:
    """Σ |x[i+1, j] − x[i, j]| + |x[i, j+1] − x[i, j]| over the image, mean per pixel (anisotropic TV)."""
    return (x[..., 1:, :] - x[..., :-1, :]).abs().mean() + (x[..., :, 1:] - x[..., :, :-1]).abs().mean()


def _block(captured, b: Optional[int]):
    blocks = captured.analysis.blocks
    n = len(blocks)
    if b is None or not -n <= b < n:
        raise OptionError(f"block {b} out of range: the model has attention blocks 0..{n - 1} (negative values count "
                          "from the output)")
    return blocks[b]


def _mlp_node(captured, info):
    """The MLP activation of block ``info`` (the first activation op in its layer after the attention)."""
    order = {n: i for i, n in enumerate(captured.graph.nodes)}
    for n in captured.graph.nodes:
        if n.op == "call_function" and n.target in _ACTIVATIONS and order[n] > order[info.product] \
                and info.layer and info.layer in module_paths(n):
            return n
    raise InputError(f"no MLP activation (gelu/silu/relu after the attention) was found in layer '{info.layer}'; "
                     "units neuron/channel need one")


def unit_value(unit: Unit, captured, env, outputs, wrt: Optional[str]) -> torch.Tensor:
    """The unit's value (a scalar tensor, differentiable) from a forward pass's values."""
    if unit.kind == "class":
        logits = logits_of(outputs, wrt)
        if not -logits.shape[-1] <= unit.index < logits.shape[-1]:
            raise OptionError(f"class {unit.index} out of range: the model has {logits.shape[-1]} classes")
        return logits[0, unit.index]
    info = _block(captured, unit.block)
    if unit.kind in ("neuron", "channel"):
        h = env[_mlp_node(captured, info)][0]  # [tokens, hidden]
        if not -h.shape[-1] <= unit.index < h.shape[-1]:
            raise OptionError(f"unit index {unit.index} out of range: the MLP of block {unit.block} has {h.shape[-1]} "
                              "units")
        col = h[..., unit.index]
        return col.mean() if unit.token is None or unit.kind == "channel" else col[unit.token]
    if unit.kind == "head":
        a = env[info.attention]
        if a.dim() != 4:
            raise InputError(f"block {unit.block}'s attention is not [batch, heads, tokens, tokens] ({tuple(a.shape)})")
        if not -a.shape[1] <= unit.index < a.shape[1]:
            raise OptionError(f"head {unit.index} out of range: block {unit.block} has {a.shape[1]} heads")
        return a[0, unit.index, 1:, 0].mean()
    out = env[info.output][0]  # [tokens, hidden]
    if unit.kind == "norm":
        if not -out.shape[0] <= unit.token < out.shape[0]:
            raise OptionError(f"token {unit.token} out of range: block {unit.block} has {out.shape[0]} tokens")
        return torch.linalg.vector_norm(out[unit.token].float())
    return out.float().mean()


def maximize_activation(model: torch.nn.Module, unit: Any, *, steps: int = 200, lr: float = 0.05, l2: float = 1e-3,
                        jitter: int = 0, blur: float = 0.0, blur_every: int = 4, tv: float = 0.0, seed: int = 0,
                        image_size: Optional[Tuple[int, int]] = None, normalization: Any = None, length: int = 8,
                        tokenizer: Any = None, progress: bool = True) -> MaximizingInput:
    """Activation maximization (survey §2.4): gradient ascent (Adam, learning rate ``lr``) on
    S(I) − λ‖I‖² (λ = ``l2``; ‖I‖² the mean square of the normalized input) minus ``tv`` x total
    variation, for ``steps`` steps, from a seeded random start.

    Parameters
    ----------
    model
        an image or text classifier (HF or timm); not modified.
    unit
        what to maximize, a string (or a ``Unit``; an int is a class; a block B counts from the input, a
        negative B from the output): ``"class:C"`` the logit of class C; ``"neuron:B:I[:T]"`` hidden unit I of
        the MLP of block B (after its first linear layer) at token T, without T its mean over the tokens;
        ``"channel:B:I"`` that unit's mean over every token; ``"head:B:H"`` the attention head H of block B pays
        to the class token, averaged over the other tokens' queries; ``"norm:B:T"`` the norm of token T's output
        of block B; ``"layer:B"`` the mean output activation of block B.
    jitter, blur, blur_every, tv
        regularizers against the patch checkerboard of ViTs (0: off): random shifts of up to ``jitter``
        pixels each step, a Gaussian blur of σ = ``blur`` every ``blur_every`` steps, ``tv`` x the total
        variation.
    image_size, normalization
        images: default the model's own input size and normalization (else (0.5, 0.5, 0.5) /
        (0.5, 0.5, 0.5)); ``normalization`` is ``(mean, std)``.
    length
        text: the number of relaxed positions (a [CLS]-like first position included).
    tokenizer
        text: names the nearest tokens (else their ids as strings).
    seed
        the random start and the jitter come from ``torch.Generator().manual_seed(seed)``:
        the same seed gives the same result.

    Returns
    -------
    MaximizingInput
        the input, the image (or nearest tokens) and the unit's value per step.
    """
    u = Unit.parse(unit)
    for name, v in (("steps", steps), ("length", length), ("blur_every", blur_every)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise OptionError(f"{name} must be an int >= 1, not {v!r}")
    for name, v in (("lr", lr), ("l2", l2), ("blur", blur), ("tv", tv)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
            raise OptionError(f"{name} must be a number >= 0, not {v!r}")
    if isinstance(jitter, bool) or not isinstance(jitter, int) or jitter < 0:
        raise OptionError(f"jitter must be an int >= 0 (pixels), not {jitter!r}")
    from tqdm.auto import tqdm  # optional dependency (relprop[eval])

    gen = torch.Generator().manual_seed(int(seed))
    device = next(iter(model.parameters())).device
    embedding = None if _is_vision(model) else _word_embedding(model)
    if embedding is not None:
        dummy = {"input_ids": torch.zeros(1, length, dtype=torch.long, device=device),
                 "attention_mask": torch.ones(1, length, dtype=torch.long, device=device)}
        prepared = prepare(model, dummy, None)
        weight = embedding.weight.detach()
        scale = weight.norm(dim=1).mean().cpu() / weight.shape[1] ** .5
        start = torch.randn(1, length, weight.shape[1], generator=gen) * scale
        lo = hi = None
    else:
        size = tuple(image_size or model_image_size(model) or (224, 224))
        norm = normalization if normalization is not None else model_normalization(model)
        mean, std = (torch.tensor(norm[0]), torch.tensor(norm[1])) if norm else (torch.full((3,), .5),) * 2
        mean, std = mean.view(1, -1, 1, 1).to(device), std.view(1, -1, 1, 1).to(device)
        dummy = torch.zeros(1, mean.shape[1], *size, device=device)
        prepared = prepare(model, dummy, None)
        lo, hi = (0 - mean) / std, (1 - mean) / std
        start = ((torch.rand(1, mean.shape[1], *size, generator=gen).to(device) * 0.2 + 0.4) - mean) / std
    captured = prepared.captured
    x = start.to(device).clone().requires_grad_(True)
    opt = torch.optim.Adam([x], lr=lr)
    values: List[float] = []
    with tqdm(total=steps, desc=f"maximize_activation {u}", disable=not progress) as bar:
        for step in range(steps + 1):
            inp = x
            # the last evaluation (step == steps) scores the returned input itself, never a shifted copy
            if jitter and embedding is None and step < steps:
                dy, dx = (int(v) for v in torch.randint(-jitter, jitter + 1, (2,), generator=gen))
                inp = torch.roll(x, shifts=(dy, dx), dims=(2, 3))
            with torch.enable_grad():
                env, outputs = forward(captured, model, prepared.kwargs, perturb=lambda v, inp=inp: inp)
                source = captured.analysis.sources[0]
                value = unit_value(u, captured, env, outputs, captured.primary)
                values.append(float(value.detach()))
                if step == steps:
                    break
                (g,) = torch.autograd.grad(value, env[source], allow_unused=True)
                if g is None:
                    raise InputError(f"unit {u} does not depend on the input")
                opt.zero_grad()
                # descend -(S - penalty): -S's gradient g reaches x through inp (the jitter), the penalty directly
                loss = -(inp * g).sum() + l2 * x.pow(2).mean()
                if tv and embedding is None:
                    loss = loss + tv * total_variation(x)
                loss.backward()
            opt.step()
            with torch.no_grad():
                if embedding is None:
                    if blur and (step + 1) % blur_every == 0:
                        x.copy_(_gaussian_blur(x, blur))
                    x.copy_(torch.max(torch.min(x, hi), lo))
            bar.update(1)
    result = x.detach()
    if embedding is not None:
        w = F.normalize(embedding.weight.detach().float(), dim=1)
        ids = (F.normalize(result[0].float(), dim=1) @ w.T).argmax(1).tolist()
        tokens = tokenizer.convert_ids_to_tokens(ids) if tokenizer is not None else [str(i) for i in ids]
        return MaximizingInput(u, result, None, values, tokens)
    image = (result * std + mean).clamp(0, 1)[0].permute(1, 2, 0).cpu().numpy()
    return MaximizingInput(u, result, image, values)


def _is_vision(model) -> bool:
    return model_image_size(model) is not None


def _word_embedding(model):
    """The word-embedding layer of a text model (its own ``get_input_embeddings()``, or that of the
    first submodule that has one, e.g. a wrapped encoder); an InputError when there is none."""
    for m in model.modules():
        get = getattr(m, "get_input_embeddings", None)
        if callable(get):
            emb = get()
            if isinstance(emb, torch.nn.Embedding):
                return emb
    raise InputError(f"{type(model).__name__}: neither an image size (config.image_size, patch_embed.img_size) nor "
                     "a word embedding (get_input_embeddings) was found, so relprop cannot tell what input to "
                     "optimize; maximize_activation takes HuggingFace/timm image models and HuggingFace text models")



def model_normalization(model) -> Optional[Tuple[Sequence[float], Sequence[float]]]:
    """(mean, std) of a timm model's ``pretrained_cfg``, else None (pass ``normalization=``)."""
    cfg = getattr(model, "pretrained_cfg", None)
    if isinstance(cfg, dict) and cfg.get("mean") is not None and cfg.get("std") is not None:
        return tuple(cfg["mean"]), tuple(cfg["std"])
    return None


__all__: Sequence[str] = ("MaximizingInput", "UNIT_KINDS", "Unit", "maximize_activation", "total_variation",
                          "unit_value")
