"""The adapters of the vision-language families relprop explains (:mod:`relprop.models.adapter`), each a
few lines over the modules that know the family:

* :data:`QWEN_VL`: Qwen2-VL, Qwen2.5-VL (:mod:`relprop.models.qwen_images`: the vision tower's packed
  rows read back into one image; batches of prompts sample by sample, :mod:`relprop.models.vlm_batches`);
* :data:`TILED_VLM`: Idefics3, SmolVLM (:mod:`relprop.models.vlm_tiles`: tiles and the global image);
* :data:`ANYRES_VLM`: LLaVA-NeXT, LLaVA-OneVision (:mod:`relprop.models.vlm_anyres`: any-resolution crops);
* :data:`IMAGE_TOKEN_VLM`: LLaVA, PaliGemma, Gemma-3 (:mod:`relprop.models.vision_language`: one image's
  tokens on the vision tower's patch grid);
* :data:`UNKNOWN_VLM`: any other vision-language model (a config with a vision and a text config and an
  image token id): explained onto the input ``wrt=`` names, or refused with the reason.

Every adapter runs the same steps in the same order (:class:`VisionLanguageAdapter`); each step acts only on
its own family's models, so a family's adapter differs in what it matches and how it generates.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

from . import generated_image_steps, generated_image_text, qwen_images, vision_language, vlm_anyres, vlm_batches, \
    vlm_tiles
from .adapter import Adapted, ModelAdapter
from .remembered_prompt import remember_prompt


class VisionLanguageAdapter(ModelAdapter):
    """A vision-language family: ``types`` (``config.model_type`` → the family's name) it matches, and
    ``generation``, how its prompts with an image are explained token by token."""

    def __init__(self, types: Dict[str, str], generation: str, name: Optional[str] = None):
        self.types, self.generation = dict(types), generation
        self.name = name or ", ".join(self.types.values())

    def matches(self, model: Any) -> bool:
        return getattr(getattr(model, "config", None), "model_type", None) in self.types

    def splits(self, model: Any, inputs: Any) -> bool:
        return vlm_batches.is_batch(model, inputs)

    def split_batch(self, model, inputs, target, special_tokens_mask):
        return vlm_batches.split(model, inputs, target, special_tokens_mask)

    def join(self, runs, samples, length, many, model):
        return vlm_batches.joined(runs, samples, length, many, model)

    def prepare(self, model, inputs, methods, wrt) -> Adapted:
        inputs, tile_grid = vlm_tiles.split_grid_keys(model, inputs)
        vlm_tiles.check(model, inputs, tile_grid)  # a tile layout relprop cannot verify is refused before any work
        inputs = vlm_anyres.plain_sizes(model, inputs)  # checked, image_sizes as ints (traceable)
        wrt = vision_language.explained_input(model, inputs, methods, wrt)
        model, inputs = qwen_images.explained_call(model, inputs)  # one image as pixels [1, C, H, W]
        return Adapted(model, inputs, wrt, tile_grid)

    def capture_call(self, model, inputs):
        inputs = vlm_anyres.plain_sizes(model, inputs)
        return qwen_images.explained_call(model, inputs)

    def compose(self, results, model, inputs, primary, layout, tokenizer=None) -> None:
        vision_language.place_image_tokens(results, model, inputs, primary)
        vlm_tiles.compose(results, model, inputs, primary, layout)
        vlm_anyres.compose(results, model, inputs, primary)
        remember_prompt(results, model=model, inputs=inputs, tokenizer=tokenizer)

    def explain_generation(self, explain, model, tokenizer, prompt, max_new_tokens, method, preset, target, contrast,
                           batch_size, options, tokens_per_call, as_tokens):
        if not generated_image_text.is_image_prompt(model, prompt):
            return None  # a prompt without its image: the language model's text generation
        if self.generation == "steps":
            return generated_image_steps.explain_one(explain, model, tokenizer, prompt, max_new_tokens, method, preset,
                                                     target, contrast, batch_size, options, as_tokens)
        return generated_image_text.explain_one(explain, model, tokenizer, prompt, max_new_tokens, method, preset,
                                                target, contrast, batch_size, options, tokens_per_call, as_tokens)


class _UnknownVisionLanguage(VisionLanguageAdapter):
    """Any other vision-language model: its steps refuse what relprop cannot place (or follow ``wrt=``)."""

    def matches(self, model: Any) -> bool:
        return vision_language.model_type(model) is not None


QWEN_VL = VisionLanguageAdapter(qwen_images.QWEN, "steps")
TILED_VLM = VisionLanguageAdapter(vlm_tiles.TILED, "steps")
ANYRES_VLM = VisionLanguageAdapter(vlm_anyres.ANYRES, "steps")
IMAGE_TOKEN_VLM = VisionLanguageAdapter({k: vision_language.SUPPORTED[k] for k in generated_image_text.GENERATION},
                                        "batched")
UNKNOWN_VLM = _UnknownVisionLanguage({}, "batched", name="vision-language model")
