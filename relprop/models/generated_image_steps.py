"""Attribution of the text a vision-language model generates about an image, for the families relprop
explains one prompt with its image per call: Qwen2-VL and Qwen2.5-VL (:mod:`relprop.models.qwen_images`),
Idefics3 and SmolVLM (:mod:`relprop.models.vlm_tiles`), LLaVA-NeXT and LLaVA-OneVision
(:mod:`relprop.models.vlm_anyres`).

The model writes tokens y_1 … y_G greedily from the whole prompt, image included
(:func:`relprop.models.generated_image_text.greedy`: the pixels fed at every step, no cache; the generated
tokens continue the ``attention_mask`` with ones and Qwen's ``mm_token_type_ids`` with 0, text).
Explaining y_t is explaining the logit of y_t (minus that of the ``contrast`` token) at the last position
of the prompt followed by y_1 … y_{t-1}, with the image, as for the other families
(:mod:`relprop.models.generated_image_text`). These families' captured call takes one sample (Qwen's vision
tower packs a batch's images into one sequence; LLaVA-NeXT's tiles are all samples' tiles; Idefics3's
tile layout is checked per call), so the steps are not batched as teacher-forced copies: **each step is
one** :func:`relprop.explain` **call on its own prefix**, exactly the call a user would make, and what
depends on the length is recomputed by it for each step (Qwen's 3-D rotary positions from the model's
``get_rope_index``, the placeholder count checked against the tile or crop layout). G tokens are G
calls, and G captures the first time (one per sequence length).

The result is an :class:`relprop.models.generated_image_text.ImageGenerationExplanation`: ``matrix``
(row t: step t's ``streams["input_ids"]``, the later columns 0), ``patches`` (step t's
``streams["pixel_values"]`` on the family's patch grid: Qwen's gh x gw patches, the tiles' or crops'
composed grid), ``maps`` (step t's ``map``), ``streams`` (Idefics3's ``"global_image"``, LLaVA-NeXT's
``"base_image"``, per step), ``explanation`` (the G one-sample Explanations, ``step(t)``).
"""
from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Tuple

import torch

from . import qwen_images, vlm_anyres, vlm_tiles
from .generated_image_text import (MM_TYPES, ImageGenerationExplanation, check_family, continued, generated,
                                   token_labels)
from .vision_language import IDS, PIXELS, model_type
from ..errors import InputError, MethodError
from ..targets.target_scores import teacher_forced

#: config.model_type -> name of the families explained here, one relprop.explain call per generated token
STEPWISE = {**qwen_images.QWEN, **vlm_tiles.TILED, **vlm_anyres.ANYRES}
_MASK = "attention_mask"
#: the keys of each family's prompt carried to every step (the tile grid keys go to relprop.explain only)
_KEYS = {**{k: (IDS, _MASK, MM_TYPES, PIXELS, "image_grid_thw") for k in qwen_images.QWEN},
         **{k: (IDS, _MASK, PIXELS, "pixel_attention_mask") + vlm_tiles.GRID_KEYS for k in vlm_tiles.TILED},
         **{k: (IDS, _MASK, PIXELS, vlm_anyres.SIZES) + ((vlm_anyres.IMAGES_PER_PROMPT,) if k == "llava_onevision"
                                                             else ()) for k in vlm_anyres.ANYRES}}


def _refuse_batch(model, kind: str, what: str) -> MethodError:
    return MethodError(f"{type(model).__name__} ({STEPWISE[kind]}): {what}; relprop explains this family one prompt "
                       "with its image per call, so explain_generation takes one prompt (pass a list of prompts, "
                       "each with its image, for several)")


def prompt_inputs(model, prompt: Mapping) -> Tuple[dict, dict, Any]:
    """(the model's inputs, the tile grid keys as given, the tile grid (rows, cols) or None) of one prompt
    with its image, checked before anything is generated: the family's keys only, one sample, an all-ones
    mask, and the image layout the family's relprop.explain checks (Qwen's rows, Idefics3's tiles,
    LLaVA-NeXT's crops against the placeholders).

    Raises
    ------
    MethodError
        a batch of several prompts or images, or an image layout the family's explain refuses.
    InputError
        another key (relprop would drop it), no ``input_ids``, a mask that masks tokens.
    """
    kind = model_type(model)
    keys = _KEYS[kind]
    extra = sorted(str(k) for k in prompt if k not in keys)
    if extra:
        raise InputError(f"explain_generation carries {list(keys)} of a {STEPWISE[kind]} prompt to every step and "
                         f"would drop {extra}; pass a prompt without them (or explain one next token: "
                         "relprop.explain(model, inputs, target='next_token'))")
    ids, pixels = prompt.get(IDS), prompt[PIXELS]
    if not torch.is_tensor(ids) or ids.dim() != 2 or ids.is_floating_point():
        raise InputError(f"a {STEPWISE[kind]} prompt needs its 'input_ids' [1, length] (token ids)")
    if ids.shape[0] != 1:
        raise _refuse_batch(model, kind, f"a batch of {ids.shape[0]} prompts")
    if kind not in qwen_images.QWEN and (pixels.dim() != 5 or pixels.shape[0] != 1):
        raise _refuse_batch(model, kind, f"pixel_values of shape {tuple(pixels.shape)}, not one sample's tiles "
                            "[1, tiles, C, H, W]")
    mask = prompt.get(_MASK)
    if torch.is_tensor(mask) and (tuple(mask.shape) != tuple(ids.shape) or not bool((mask != 0).all())):
        raise InputError("the prompt's attention_mask must be all ones, one per token; explain_generation takes one "
                         "unpadded prompt")
    if MM_TYPES in prompt and tuple(prompt[MM_TYPES].shape) != tuple(ids.shape):
        raise InputError(f"the prompt's {MM_TYPES} has shape {tuple(prompt[MM_TYPES].shape)}, its input_ids "
                         f"{tuple(ids.shape)}")
    inputs, tile_grid = vlm_tiles.split_grid_keys(model, dict(prompt))
    grid_keys = {k: prompt[k] for k in vlm_tiles.GRID_KEYS if k in prompt}
    vlm_tiles.check(model, inputs, tile_grid)
    if kind in vlm_anyres.ANYRES:
        vlm_anyres.layout(model, inputs)
    if kind in qwen_images.QWEN:
        qwen_images.adapt(model, inputs)
    return inputs, grid_keys, tile_grid


def _picture(model, inputs: dict, tile_grid) -> Tuple[Tuple[int, int], torch.Tensor]:
    """(patch grid, image [1, C, H, W]) the maps lie on: Qwen's image read back from its rows,
    Idefics3's tiles and LLaVA-NeXT's crops put back together."""
    kind, pixels = model_type(model), inputs[PIXELS].detach().to("cpu", copy=True)
    if kind in qwen_images.QWEN:
        thw = inputs["image_grid_thw"]
        grid = (int(thw[0, 1]), int(thw[0, 2]))
        return grid, qwen_images.image_of(pixels, grid, model.config)
    if kind in vlm_tiles.TILED:
        lay = vlm_tiles.layout(model, inputs, tile_grid)
        return lay.grid, vlm_tiles.compose_image(pixels, lay)
    lay = vlm_anyres.layout(model, inputs)
    return lay.grid, vlm_anyres.compose_pixels(pixels, lay)


def _step(explain, model, inputs: dict, grid_keys: dict, kind: str, gen: torch.Tensor, t: int,
          alt: Optional[torch.Tensor], method, preset, options):
    """The one-sample Explanation of step ``t``: the prompt + ``gen[:t]`` with the image, the logit of
    ``gen[t]`` (minus that of ``alt[t]``) at the last position."""
    seq = continued(inputs, kind, gen[None, :t])
    last = torch.tensor([seq[IDS].shape[1] - 1])
    score = teacher_forced(last, gen[t:t + 1], None if alt is None else alt[t:t + 1])
    exp = explain(model, {**seq, **grid_keys}, target=score, method=method, preset=preset, **options)
    streams = exp.streams or {}
    if IDS not in streams or PIXELS not in streams:
        raise MethodError(f"{type(model).__name__}: the explanation holds no per-token and per-patch scores "
                          f"(streams {sorted(streams)}); explain_generation of an image prompt needs a method "
                          "with per-token scores over the prompt (lrp, input_x_gradient, the rollouts, ...)")
    return exp


def explain_one(explain, model, tokenizer, prompt: Mapping, max_new_tokens: int, method, preset, target, contrast,
                batch_size: Optional[int], options: dict, as_tokens) -> ImageGenerationExplanation:
    """:func:`relprop.explain_generation` of one prompt with its image for a family of :data:`STEPWISE`
    (module docstring): one call of ``explain`` (:func:`relprop.explain`, passed down by the api layer) per
    generated token. ``as_tokens(x, n, name)``
    checks ``contrast``; ``batch_size`` (copies per call) does not apply: each call is one step."""
    check_family(model, prompt, options)  # a refused family's reason first, before its keys are read
    inputs, grid_keys, tile_grid = prompt_inputs(model, prompt)
    kind = model_type(model)
    ids = inputs[IDS]
    gen = generated(model, inputs, max_new_tokens, target)
    g, n = gen.numel(), int(ids.shape[1])
    alt = None if contrast is None else as_tokens(contrast, g, "contrast")
    exps = [_step(explain, model, inputs, grid_keys, kind, gen, t, alt, method, preset, options) for t in range(g)]
    matrix = torch.zeros(g, n + g - 1)
    for t, e in enumerate(exps):
        matrix[t, :n + t] = e.streams[IDS][0].detach().float()
    patches = torch.stack([e.streams[PIXELS][0].detach().float() for e in exps])
    maps = torch.stack([e.map[0].detach().float() for e in exps]) if all(e.map is not None for e in exps) else None
    others = sorted(set.intersection(*(set(e.streams) for e in exps)) - {IDS, PIXELS})
    streams: Dict[str, Any] = {k: torch.stack([e.streams[k][0].detach().float() for e in exps]) for k in others}
    grid, image = _picture(model, inputs, tile_grid)
    columns = continued(inputs, kind, gen[None, :-1])[IDS][0]
    labels, row_labels = token_labels(tokenizer, columns, gen)
    recomputed = {**{k: "its 3-D rotary positions (get_rope_index)" for k in qwen_images.QWEN},
                  **{k: "its tile layout against the placeholders" for k in vlm_tiles.TILED},
                  **{k: "its crop layout against the placeholders" for k in vlm_anyres.ANYRES}}[kind]
    notes = [f"{STEPWISE[kind]}: {g} generated token(s), each explained with the image by its own relprop.explain "
             f"call on the prompt + the tokens generated before it ({g} call(s), one sample each: this family is "
             f"explained one prompt with its image per call, so its steps are not batched as teacher-forced "
             f"copies; each call recomputes {recomputed})"
             + ("; batch_size does not apply" if batch_size is not None else "")]
    return ImageGenerationExplanation(matrix=matrix, patches=patches, maps=maps, grid=grid, image=image, rows=gen,
                                      columns=columns, source_length=n, method=method, preset=preset, labels=labels,
                                      row_labels=row_labels, contrast=alt, explanation=exps, chunk_rows=[1] * g,
                                      notes=notes, streams=streams)
