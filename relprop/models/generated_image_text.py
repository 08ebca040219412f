"""Attribution of the text a vision-language model generates about an image: the multimodal branch of
:func:`relprop.explain_generation`.

For a prompt of text and one image (a processor's output: ``input_ids`` with the image placeholders,
``pixel_values``, optionally ``attention_mask`` and ``token_type_ids``), a supported vision-language
model (:mod:`relprop.models.vision_language`) writes tokens y_1 … y_G greedily.
Explaining y_t is explaining the logit of y_t at the last position of prompt + y_1 … y_{t-1}, with the
image (teacher forcing, as for text). Each step gives the relevance of every prompt token and earlier
generated token (a row of ``matrix``) and of every patch of the image (a row of ``patches``; with the
methods that read the input relevance also the pixel map, ``maps``), in one run per step
(:func:`relprop.explain` with the pixels and the prompt as sources).

How it is computed: as for text (:mod:`relprop.api.generated_text`), the language model is causal, so
step t explained on the whole teacher-forced sequence with its target read at position p_t equals step t
explained on its own prefix: the G steps are G copies of the sequence (each with the image), explained
in chunks of ``batch_size`` copies, one :func:`relprop.explain` call per chunk. A chunk holds the image's
vision-tower tokens as well as the sequence, so the default chunk counts both against
:data:`relprop.api.generated_text.TOKENS_PER_CALL`. A vision-language model is captured for one batch
size (its graph does not take every batch), so the last chunk is filled up to the chunk size with
copies of its last step (their rows are dropped): every chunk reuses one capture. Greedy generation
feeds the whole prompt (pixels included) at every step, without a cache; the generated tokens continue
the prompt's ``attention_mask`` with ones and its ``token_type_ids`` as the family's ``generate`` does
(PaliGemma: 1, the causal suffix; others: the last prompt value; Qwen's ``mm_token_type_ids``: 0, text).

This module explains LLaVA, PaliGemma and Gemma-3 (:data:`GENERATION`), whose captured graph takes a
batch of copies. The families explained one prompt with its image per call (Qwen2-VL, Qwen2.5-VL,
Idefics3, SmolVLM, LLaVA-NeXT) are explained one call per generated token by
:mod:`relprop.models.generated_image_steps`, into the same :class:`ImageGenerationExplanation`.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Mapping, Optional

import torch

from .vision_language import EXPLAINED, IDS, PIXELS, explained_input, model_type, token_layout
from ..errors import InputError, MethodError, TargetError
from ..graph.state import eval_mode
from ..targets.target_scores import teacher_forced
from ..viz import vision_text as viz_vision_text

#: the keys of a vision-language prompt that explain_generation carries to every step
PROMPT_KEYS = (IDS, "attention_mask", "token_type_ids", PIXELS)
#: token_type_ids of a generated token, per family (the value its ``generate`` appends); others repeat
#: the prompt's last value
_GENERATED_TYPE = {"paligemma": 1}
#: Qwen2-VL's and Qwen2.5-VL's per-token modality (0 text, 1 image): a generated token is text
MM_TYPES = "mm_token_type_ids"


def is_image_prompt(model, prompt) -> bool:
    """True when ``prompt`` is a mapping with a ``pixel_values`` tensor and ``model`` is a vision-language
    model (:func:`relprop.models.vision_language.model_type`): the prompt explain_generation explains here."""
    return isinstance(prompt, Mapping) and torch.is_tensor(prompt.get(PIXELS)) and model_type(model) is not None


@dataclasses.dataclass
class ImageGenerationExplanation:
    """One image prompt's generation attribution (a vision-language model).

    ``matrix`` [generated tokens, columns]: row t is the relevance of each prompt token and earlier
    generated token for the t-th generated token (the image placeholders are 0 with the methods that
    read the input relevance, whose pixels hold the image's share; with the rollout methods the
    placeholders carry the image tokens' scores). ``patches`` [generated tokens, patches]: row t is the
    image's relevance for the t-th token per patch of the vision tower's grid (row-major, ``grid``),
    ``maps`` [generated tokens, H, W] the pixel maps (methods that read the input relevance; else None).
    ``image`` the [1, C, H, W] pixels (the image the maps lie on: Qwen's read back from its rows,
    Idefics3's tiles and LLaVA-NeXT's crops put back together). ``columns``/``rows`` token ids,
    ``labels``/``row_labels`` their strings (with a tokenizer), ``source_length`` the prompt's length.
    ``streams``: the family's other image parts per generated token, as its Explanation's ``streams``
    (Idefics3, SmolVLM: ``"global_image"`` [G, H, W], a part of ``maps``; LLaVA-NeXT: ``"base_image"``
    [G, H, W], kept apart from ``maps``, so Σ ``matrix[t]`` + Σ ``patches[t]`` + Σ base image + absorbed
    = the score; with the rollouts its patches [G, patches]); empty for the others.
    """

    matrix: torch.Tensor
    patches: torch.Tensor
    maps: Optional[torch.Tensor]
    grid: tuple
    image: torch.Tensor
    rows: torch.Tensor
    columns: torch.Tensor
    source_length: int
    method: str
    preset: Optional[str]
    labels: Optional[List[str]] = None
    row_labels: Optional[List[str]] = None
    contrast: Optional[torch.Tensor] = None
    #: the Explanation of each chunk of teacher-forced copies, in row order (its batch may hold filler
    #: copies after the last row; ``step(t)`` picks step t's sample)
    explanation: List[Any] = dataclasses.field(default_factory=list)
    #: the number of rows each chunk's Explanation holds (the rest are filler)
    chunk_rows: List[int] = dataclasses.field(default_factory=list)
    notes: List[str] = dataclasses.field(default_factory=list)
    #: the family's other image parts per generated token (class docstring)
    streams: Dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)

    def step(self, t: int):
        """The one-sample ``relprop.Explanation`` of generated token ``t`` (its copy of the sequence):
        its conservation ledger, its pixel map, ``save()``/``show()`` of the image and prompt. The copy
        holds the whole teacher-forced sequence: the tokens after step t's prefix are in its
        ``streams["input_ids"]`` with relevance 0 (not read)."""
        g = int(self.rows.numel())
        if not -g <= t < g:
            raise InputError(f"step {t} out of range: {g} generated token(s)")
        t %= g
        for exp, n in zip(self.explanation, self.chunk_rows):
            if t < n:
                return exp[t]
            t -= n
        raise InputError("no chunk holds this step")  # unreachable: chunk_rows sum to the rows

    def html(self) -> str:
        """A standalone HTML page: per generated token, the image with its relevance and the matrix
        row of the tokens it read (``relprop.viz.vision_text.generation_html``)."""
        return viz_vision_text.generation_html(self)

    _repr_html_ = viz_vision_text.generation_notebook_html  # drawn inline in a notebook

    def save(self, path: str, **kwargs) -> str:
        """Write the picture to ``path``: ``.html`` (``html``) or an image (``.png``, ``.pdf``): one
        heatmap over the image per generated token above the token matrix."""
        if str(path).endswith(".html"):
            with open(path, "w", encoding="utf-8") as f:
                f.write(self.html())
            return str(path)
        return viz_vision_text.save_generation_figure(self, path, **kwargs)


def prompt_inputs(model, prompt: Mapping) -> dict:
    """The prompt's tensors (``PROMPT_KEYS``) checked: one sample, one image, an all-ones mask.

    Raises
    ------
    InputError
        another key (relprop would drop it), several samples or images, a mask that masks tokens.
    MethodError
        the family is refused by :func:`relprop.models.vision_language.explained_input`.
    """
    extra = sorted(str(k) for k in prompt if k not in PROMPT_KEYS)
    if extra:
        raise InputError(f"explain_generation carries {list(PROMPT_KEYS)} of a vision-language prompt to every "
                         f"step and would drop {extra}; pass a prompt without them (or explain one next token: "
                         "relprop.explain(model, inputs, target='next_token'))")
    if IDS not in prompt:
        raise InputError("a vision-language prompt needs its 'input_ids'")
    out = {k: prompt[k] for k in PROMPT_KEYS if k in prompt}
    ids, pixels = out[IDS], out[PIXELS]
    if ids.dim() != 2 or ids.shape[0] != 1 or ids.is_floating_point():
        raise InputError(f"the prompt's input_ids must be one sample [1, length]; got {tuple(ids.shape)} (pass a "
                         "list of prompts for several)")
    if pixels.dim() != 4 or pixels.shape[0] != 1:
        raise InputError(f"explain_generation explains a prompt with one image: pixel_values [1, C, H, W]; got "
                         f"{tuple(pixels.shape)}")
    mask = out.get("attention_mask")
    if torch.is_tensor(mask) and not bool((mask != 0).all()):
        raise InputError("the prompt's attention_mask masks some of its tokens; explain_generation takes one "
                         "unpadded prompt")
    for k in ("attention_mask", "token_type_ids"):
        if k in out and tuple(out[k].shape) != tuple(ids.shape):
            raise InputError(f"the prompt's {k} has shape {tuple(out[k].shape)}, its input_ids {tuple(ids.shape)}")
    return out


#: config.model_type of the families explained here, a batch of teacher-forced copies per call (the
#: families explained one image at a time, through a wrapper or per tile layout, are explained one call
#: per step: relprop.models.generated_image_steps)
GENERATION = ("llava", "paligemma", "gemma3")


def check_family(model, inputs, options) -> None:
    """Refuse before generating what :func:`relprop.explain` would refuse for this family."""
    wrt = options.get("wrt")
    if wrt is None and model_type(model) in EXPLAINED:
        wrt = PIXELS  # the explained families: the methods choose the input later
    explained_input(model, inputs, (), wrt)


def continued(inputs: dict, kind: str, new: torch.Tensor) -> dict:
    """``inputs`` with the token ids ``new`` [1, k] appended (mask and token types continued)."""
    out = dict(inputs)
    out[IDS] = torch.cat([inputs[IDS], new.to(inputs[IDS].dtype)], 1)
    k = new.shape[1]
    if "attention_mask" in inputs:
        out["attention_mask"] = torch.cat([inputs["attention_mask"], inputs["attention_mask"].new_ones(1, k)], 1)
    if "token_type_ids" in inputs:
        types = inputs["token_type_ids"]
        value = _GENERATED_TYPE.get(kind, int(types[0, -1]))
        out["token_type_ids"] = torch.cat([types, types.new_full((1, k), value)], 1)
    if MM_TYPES in inputs:
        out[MM_TYPES] = torch.cat([inputs[MM_TYPES], inputs[MM_TYPES].new_zeros(1, k)], 1)
    return out


@torch.no_grad()
def greedy(model, inputs: dict, steps: int, eos: Optional[int]) -> torch.Tensor:
    """Greedy continuation of a vision-language prompt: [steps or fewer] token ids, the whole prompt
    (image included) fed at every step, stopping after ``eos``."""
    kind = model_type(model)
    out = []
    seq = inputs
    with eval_mode(model):
        for _ in range(steps):
            tok = int(model(**seq, use_cache=False).logits[0, -1].argmax())
            out.append(tok)
            seq = continued(seq, kind, torch.tensor([[tok]]))
            if eos is not None and tok == eos:
                break
    return torch.tensor(out, dtype=torch.long)


def _copies(inputs: dict, n: int) -> dict:
    return {k: v.expand((n,) + tuple(v.shape[1:])).contiguous() for k, v in inputs.items()}


def _chunk(explain, model, full: dict, positions, tok, other, size: int, method, preset, options):
    """(Explanation, rows): ``size`` copies of ``full``, the first ``len(tok)`` reading their targets
    (copy i: the logit of ``tok[i]``, minus that of ``other[i]``, at ``positions[i]``), the rest
    filler copies of the last one."""
    n = tok.numel()
    pad = size - n
    positions = torch.cat([positions, positions[-1:].expand(pad)])
    tok = torch.cat([tok, tok[-1:].expand(pad)])
    other = None if other is None else torch.cat([other, other[-1:].expand(pad)])
    exp = explain(model, _copies(full, size), target=teacher_forced(positions, tok, other), method=method,
                  preset=preset, **options)
    streams = exp.streams or {}
    if IDS not in streams or PIXELS not in streams:
        raise MethodError(f"{type(model).__name__}: the explanation holds no per-token and per-patch scores "
                          f"(streams {sorted(streams)}); explain_generation of an image prompt needs a method "
                          "with per-token scores over the prompt (lrp, input_x_gradient, the rollouts, ...)")
    return exp, n


def explain_one(explain, model, tokenizer, prompt: Mapping, max_new_tokens: int, method, preset, target, contrast,
                batch_size: Optional[int], options: dict, tokens_per_call: int, as_tokens
                ) -> ImageGenerationExplanation:
    """:func:`relprop.explain_generation` of one vision-language prompt (module docstring), each chunk of
    teacher-forced copies explained by ``explain`` (:func:`relprop.explain`, passed down by the api layer).
    ``as_tokens(x, n, name)`` checks ``contrast``; ``tokens_per_call`` sizes the default chunk."""
    check_family(model, prompt, options)  # a refused family's reason first, before its keys are read
    inputs = prompt_inputs(model, prompt)
    kind = model_type(model)
    ids = inputs[IDS]
    gen = generated(model, inputs, max_new_tokens, target)
    g = gen.numel()
    alt = None if contrast is None else as_tokens(contrast, g, "contrast")
    full = continued(inputs, kind, gen[None, :-1])
    positions = torch.arange(g) + ids.shape[1] - 1
    (gh, gw), _, _, _ = token_layout(model.config)
    length = full[IDS].shape[1] + gh * gw + 1  # the sequence and the vision tower's tokens
    size = min(g, batch_size or max(1, tokens_per_call // length))
    chunks = [_chunk(explain, model, full, positions[lo:lo + size], gen[lo:lo + size],
                     None if alt is None else alt[lo:lo + size], size, method, preset, options)
              for lo in range(0, g, size)]
    exps = [e for e, _ in chunks]
    counts = [n for _, n in chunks]
    matrix = torch.cat([e.streams[IDS][:n] for e, n in chunks]).detach().float()
    patches = torch.cat([e.streams[PIXELS][:n] for e, n in chunks]).detach().float()
    maps = None
    if all(e.map is not None for e in exps):
        maps = torch.cat([e.map[:n] for e, n in chunks]).detach().float()
    cols = torch.arange(matrix.shape[1])
    matrix = torch.where(cols[None, :] <= positions[:, None], matrix, torch.zeros((), dtype=matrix.dtype))
    columns = full[IDS][0]
    labels, row_labels = token_labels(tokenizer, columns, gen)
    notes = [f"{EXPLAINED.get(kind, kind)}: {g} generated token(s) explained with the image in {len(exps)} call(s) "
             f"of {size} teacher-forced cop{'y' if size == 1 else 'ies'}"
             + (f" (the last filled up with {size - counts[-1]} copies, dropped)" if counts[-1] < size else "")]
    return ImageGenerationExplanation(matrix, patches, maps, (gh, gw), inputs[PIXELS].detach(), gen, columns,
                                      int(ids.shape[1]), method, preset, labels, row_labels, alt, exps, counts,
                                      notes)


def generated(model, inputs: dict, max_new_tokens: int, target) -> torch.Tensor:
    """The tokens to explain: ``target`` (a fixed continuation) or the greedy continuation of
    ``inputs`` (:func:`greedy`, stopping after the language model's end-of-sequence token)."""
    if target is not None:
        gen = torch.as_tensor(target, dtype=torch.long).flatten()
        if gen.numel() == 0:
            raise TargetError("target= must hold at least one token id to explain")
        return gen
    eos = getattr(getattr(model.config, "text_config", model.config), "eos_token_id", None)
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    return greedy(model, inputs, max_new_tokens, eos if isinstance(eos, int) else None)


def token_labels(tokenizer, columns: torch.Tensor, rows: torch.Tensor):
    """(column strings, row strings) from a tokenizer or a processor holding one; (None, None) without."""
    convert = getattr(tokenizer, "convert_ids_to_tokens", None) or getattr(getattr(tokenizer, "tokenizer", None),
                                                                         "convert_ids_to_tokens", None)
    if convert is None:
        return None, None
    return convert(columns.tolist()), convert(rows.tolist())
