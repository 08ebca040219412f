"""Attribution of generated text: :func:`explain_generation`.

For a prompt, a language model (decoder-only) or an encoder–decoder writes tokens y_1 … y_G one at
a time; token y_t is the model's next-token prediction on the prompt (or source) and y_1 … y_{t-1}.
Explaining y_t is explaining the logit of y_t at the last position of that prefix (teacher
forcing; with ``contrast=``, the logit of y_t minus that of an alternative token). The result is a
[G × columns] relevance matrix per sample: row t holds the relevance of each prompt/source token
and of each earlier target token for y_t; later columns are zero.

How it is computed: a causal decoder's output at position p depends on positions ≤ p only (the
masked attention weights to later positions are exactly zero), so step t explained on the whole
sequence with the target read at position p_t equals step t explained on the prefix alone. The G
steps are run as batches of copies of the full teacher-forced sequence (copy t reads the target
at its own position): one captured graph for every step and one forward and one backward pass per
generated token (with the AttnLRP fast path, ``method="lrp", preset="attnlrp"``, the default).
The copies are explained in chunks of ``batch_size`` (default: as many as hold about
:data:`TOKENS_PER_CALL` tokens), one call of :func:`relprop.explain` per chunk, so that a long
prompt with many generated tokens never holds every copy at once; each row depends only on its own
copy, so the chunks give the rows of one batched call.
"""
from __future__ import annotations

import dataclasses
from typing import Any, List, Mapping, Optional, Sequence, Union

import torch

from .front_door import explain
from ..errors import InputError, OptionError, TargetError
from ..graph.capture import CACHE
from ..graph.state import eval_mode
from ..models import adapter_for
from ..targets.target_scores import teacher_forced
from ..viz import generation as viz_generation

#: the default chunk of teacher-forced copies explained in one call holds about this many tokens
TOKENS_PER_CALL = 4096


@dataclasses.dataclass
class GenerationExplanation:
    """One sample's generation attribution.

    ``matrix`` [generated tokens, columns]: row t is the relevance of each column token for the t-th
    generated token (columns: the source / prompt tokens, then for an encoder–decoder the decoder's
    start token and the generated tokens; for a decoder-only model the prompt continues into the
    generated tokens). ``columns``/``rows`` are the token ids, ``labels``/``row_labels`` their
    strings (with a tokenizer), ``source_length`` the number of source/prompt columns.
    """

    matrix: torch.Tensor
    rows: torch.Tensor
    columns: torch.Tensor
    source_length: int
    method: str
    preset: Optional[str]
    labels: Optional[List[str]] = None
    row_labels: Optional[List[str]] = None
    contrast: Optional[torch.Tensor] = None
    #: the batched Explanation of the G teacher-forced steps; a list of them, in row order, when the
    #: copies were explained in several chunks (``batch_size``)
    explanation: Any = None
    #: what the call did that a user may want to know (e.g. how many graph captures it needed)
    notes: List[str] = dataclasses.field(default_factory=list)

    def html(self) -> str:
        """An HTML heatmap of the matrix (rows: generated tokens; columns: the tokens they read)."""
        return viz_generation.matrix_html(self.matrix, self._row_text(), self._column_text(), self.source_length,
                                          title=f"{self.method}" + (f" ({self.preset})" if self.preset else ""))

    _repr_html_ = viz_generation.notebook_html  # the matrix drawn inline in a notebook

    def save(self, path: str, **kwargs) -> str:
        """Write the heatmap to ``path``: ``.html`` (``html``) or an image (``.png``, ``.pdf``)."""
        if str(path).endswith(".html"):
            with open(path, "w", encoding="utf-8") as f:
                f.write(self.html())
            return str(path)
        return viz_generation.matrix_figure(self.matrix, self._row_text(), self._column_text(), self.source_length,
                                            path, **kwargs)

    def _row_text(self):
        return self.row_labels or [str(int(t)) for t in self.rows]

    def _column_text(self):
        return self.labels or [str(int(t)) for t in self.columns]


def _is_encoder_decoder(model) -> bool:
    return bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))


#: the keys of a tokenizer's output that a one-sample text prompt may carry (its ids; an all-ones mask)
_TEXT_KEYS = ("input_ids", "attention_mask", "token_type_ids")


def _ids(tokenizer, prompt, model) -> torch.Tensor:
    if torch.is_tensor(prompt) and prompt.is_floating_point():  # an image or log-mel features: one sample
        if prompt.dim() not in (3, 4) or prompt.shape[0] != 1:
            raise InputError(f"a float prompt must be one image [1, C, H, W] or one feature matrix [1, F, T]; got "
                             f"{tuple(prompt.shape)}")
        return prompt
    if torch.is_tensor(prompt):
        ids = prompt
    elif isinstance(prompt, Mapping):
        dropped = sorted(str(k) for k in prompt if k not in _TEXT_KEYS)
        if dropped:  # e.g. pixel_values for a model that is no vision-language model: another prompt without them
            raise InputError(f"explain_generation explains a text prompt (its input_ids) and would drop the prompt's "
                             f"{dropped}: the model would generate from the text alone. {type(model).__name__} is "
                             "not a vision-language model (a config with vision_config, text_config and an image "
                             "token id) whose image prompts explain_generation explains; explain one next token: "
                             "relprop.explain(model, inputs, target='next_token')")
        if "input_ids" not in prompt:
            raise InputError("a prompt given as a dict needs its 'input_ids'")
        ids = prompt["input_ids"]
        mask = prompt.get("attention_mask")
        if torch.is_tensor(mask) and not bool((mask != 0).all()):
            raise InputError("the prompt's attention_mask masks some of its tokens; explain_generation takes one "
                             "unpadded prompt (pass its ids without the padding)")
    elif isinstance(prompt, str):
        if tokenizer is None:
            raise InputError("explain_generation got a prompt string and no tokenizer; pass tokenizer= or the "
                             "prompt's token ids (a [1, length] tensor)")
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    else:
        raise InputError(f"prompt must be a str, a [1, length] tensor of ids or a tokenizer's output, not "
                         f"{type(prompt).__name__}")
    if ids.dim() == 1:
        ids = ids[None]
    if ids.dim() != 2 or ids.shape[0] != 1 or ids.is_floating_point():
        raise InputError(f"the prompt's ids must be one sample [1, length] of token ids; got {tuple(ids.shape)} "
                         "(pass a list of prompts for several samples)")
    return ids


def _start_token(model) -> int:
    cfg = model.config
    start = getattr(cfg, "decoder_start_token_id", None)
    if start is None:
        start = getattr(getattr(model, "generation_config", None), "decoder_start_token_id", None)
    if start is None:
        raise InputError(f"{type(model).__name__}'s config names no decoder_start_token_id")
    return int(start)


@torch.no_grad()
def _greedy(model, src: torch.Tensor, prefix: torch.Tensor, steps: int, eos: Optional[int]) -> torch.Tensor:
    """Greedy continuation of ``prefix`` (decoder-only: the prompt; encoder–decoder: the start token,
    with ``src`` as the source): [steps or fewer] new token ids, stopping after ``eos``."""
    out = []
    seq = prefix
    with eval_mode(model):
        for _ in range(steps):
            if src is None:
                logits = model(input_ids=seq, use_cache=False).logits
            else:
                logits = model(**{_source_name(src): src}, decoder_input_ids=seq, use_cache=False).logits
            tok = int(logits[0, -1].argmax())
            out.append(tok)
            seq = torch.cat([seq, seq.new_tensor([[tok]])], 1)
            if eos is not None and tok == eos:
                break
    return torch.tensor(out, dtype=torch.long)


def _source_name(src: torch.Tensor) -> str:
    """The encoder input's name: ``input_ids``, ``pixel_values`` (an image) or ``input_features``."""
    if not src.is_floating_point():
        return "input_ids"
    return "pixel_values" if src.dim() == 4 else "input_features"


def _per_column(r: torch.Tensor) -> torch.Tensor:
    """A stream's relevance as [rows, columns]: log-mel relevance [rows, features, frames] summed per frame."""
    return r.sum(1) if r.dim() == 3 else r.flatten(1)


def _as_tokens(x, n: int, name: str) -> torch.Tensor:
    t = torch.as_tensor(x, dtype=torch.long).flatten()
    if t.numel() == 1 and n > 1 and name == "contrast":
        t = t.expand(n)
    if t.numel() != n:
        raise TargetError(f"{name} must give one token id per generated token ({n}), got {t.numel()}")
    return t


def explain_generation(model, tokenizer=None, prompt: Union[str, torch.Tensor, Sequence] = "", *,
                       max_new_tokens: int = 16, method: str = "lrp", preset: Optional[str] = "attnlrp",
                       target: Any = None, contrast: Any = None, batch_size: Optional[int] = None, **options
                       ) -> Union[GenerationExplanation, List[GenerationExplanation]]:
    """Explain every token a model generates for ``prompt``: row t of the result is the relevance of each
    prompt (or source) token and each earlier generated token for the t-th generated token
    (docs/models/generation.md).

    Parameters
    ----------
    model
        a causal language model (``*ForCausalLM``) or an encoder–decoder (T5, BART, Marian, ...).
    tokenizer
        turns a prompt string into ids and ids into the labels of the picture (optional when
        ``prompt`` holds ids).
    prompt
        a string, a [1, length] tensor of ids or a tokenizer's output (input_ids, an all-ones
        attention_mask, token_type_ids; any other key is refused rather than dropped); a list of them
        gives a list of results. For a vision-language model whose family relprop knows
        (``relprop.models.families``) a processor's output with one image: each generated token is
        explained with the image, the result an ``ImageGenerationExplanation``
        (``relprop.models.generated_image_text``: ``matrix`` over the prompt and generated tokens,
        ``patches`` per patch of the image, ``maps``), in chunks of teacher-forced copies or, for the
        families explained one prompt with its image per call, one ``relprop.explain`` call per step
        (the adapter's ``generation``: ``relprop.models.generated_image_steps``).
        For an encoder–decoder it is the source: ids, or one image [1, C, H, W]
        (``VisionEncoderDecoderModel``: columns are the image's patches) or one log-mel feature
        matrix [1, mel bins, frames] (Whisper: columns are the frames, or the encoder's tokens for
        the rollout methods).
    max_new_tokens
        how many tokens to generate greedily (stopping after the end-of-sequence token).
    method, preset, options
        as for ``relprop.explain``; default AttnLRP (Achtibat et al., ICML
        2024) with its one-backward fast path. A method with per-token scores over the explained input
        (``lrp``, ``gradient_rollout``, ``transformer_attribution``, ``input_x_gradient``, ...).
    target
        None (the greedy continuation) or the token ids of a fixed continuation to explain
        (teacher-forced; nothing is generated).
    contrast
        None, or one alternative token id (or one per generated token): each row then
        explains logit(y_t) − logit(alternative), why the model wrote y_t rather than it.
    batch_size
        how many teacher-forced copies of the sequence one call of ``relprop.explain``
        explains (the memory of a call grows with it). None (default): as many as hold about
        ``TOKENS_PER_CALL`` tokens, at least one. The rows do not depend on it (to float
        rounding of the batched products). Not used by the families explained one call per
        step.

    Returns
    -------
    GenerationExplanation
        the attribution of every generated token (a list of them for a list of prompts);
        an ``ImageGenerationExplanation`` for a vision-language model's image prompt.
    """
    before = CACHE.captures
    many = isinstance(prompt, (list, tuple)) and not torch.is_tensor(prompt)
    results = [_explain_one(model, tokenizer, p, max_new_tokens, method, preset, target, contrast, batch_size, options)
               for p in (prompt if many else [prompt])]
    captures = CACHE.captures - before
    lengths = {int(r.columns.numel()) for r in results}
    for r in results:
        r.notes.append(f"{captures} graph capture(s) (torch.export or the disk cache) for {len(results)} prompt(s) "
                       f"explained at {len(lengths)} distinct sequence length(s)")
    return results if many else results[0]


def _explain_one(model, tokenizer, prompt, max_new_tokens, method, preset, target, contrast, batch_size, options
                 ) -> GenerationExplanation:
    """:func:`explain_generation` of one prompt."""
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise InputError(f"max_new_tokens must be a positive int, not {max_new_tokens!r}")
    if batch_size is not None and (not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1):
        raise OptionError(f"batch_size must be a positive int (copies of the sequence per call) or None, not "
                          f"{batch_size!r}")
    family = adapter_for(model).explain_generation(explain, model, tokenizer, prompt, max_new_tokens, method, preset,
                                                   target, contrast, batch_size, options, TOKENS_PER_CALL, _as_tokens)
    if family is not None:  # a prompt the model's family explains its own way (relprop.models: with its image)
        return family
    ids = _ids(tokenizer, prompt, model)
    enc_dec = _is_encoder_decoder(model)
    prefix = torch.tensor([[_start_token(model)]], dtype=torch.long) if enc_dec else ids
    if target is None:
        eos = getattr(model.config, "eos_token_id", None)
        gen = _greedy(model, ids if enc_dec else None, prefix, max_new_tokens, eos if isinstance(eos, int) else None)
    else:
        gen = torch.as_tensor(target, dtype=torch.long).flatten()
        if gen.numel() == 0:
            raise TargetError("target= must hold at least one token id to explain")
    g = gen.numel()
    alt = None if contrast is None else _as_tokens(contrast, g, "contrast")
    # one copy of the teacher-forced sequence per generated token; copy t reads its target at p_t
    full = torch.cat([prefix, gen[None, :-1].to(prefix.dtype)], 1)  # the tokens any step reads
    positions = torch.arange(g) + prefix.shape[1] - 1
    src_name = _source_name(ids) if enc_dec else "input_ids"
    length = full.shape[1] + (ids.shape[1] if enc_dec and src_name == "input_ids" else 0)
    size = batch_size or max(1, TOKENS_PER_CALL // length)
    chunks = [_explain_chunk(model, ids, full, src_name, enc_dec, positions[lo:lo + size], gen[lo:lo + size],
                             None if alt is None else alt[lo:lo + size], method, preset, options)
              for lo in range(0, g, size)]
    exps = [e for e, _ in chunks]
    matrix = torch.cat([m for _, m in chunks], 0)
    if enc_dec:
        n_src = matrix.shape[1] - full.shape[1]
        # an image's or features' columns are its patches or frames, numbered
        columns = torch.cat([ids[0] if src_name == "input_ids" else torch.arange(n_src), full[0]])
    else:
        columns, n_src = full[0], ids.shape[1]
    matrix = _causal(matrix, positions + (n_src if enc_dec else 0))
    labels = row_labels = None
    if tokenizer is not None and src_name == "input_ids":
        labels = tokenizer.convert_ids_to_tokens(columns.tolist())
        row_labels = tokenizer.convert_ids_to_tokens(gen.tolist())
    return GenerationExplanation(matrix, gen, columns, int(n_src), method, preset, labels, row_labels, alt,
                                 exps[0] if len(exps) == 1 else exps)


def _explain_chunk(model, ids, full, src_name, enc_dec, positions, tok, other, method, preset, options):
    """(Explanation, [rows, columns] relevance) of one chunk of teacher-forced copies: copy i explains
    the logit of ``tok[i]`` (minus that of ``other[i]``) at position ``positions[i]``."""
    n = tok.numel()
    score = teacher_forced(positions, tok, other)
    if enc_dec:
        inputs = {src_name: ids.expand((n,) + tuple(ids.shape[1:])), "decoder_input_ids": full.expand(n, -1)}
    else:
        inputs = {"input_ids": full.expand(n, -1)}
    exp = explain(model, inputs, target=score, method=method, preset=preset, **options)
    if not enc_dec:
        return exp, exp.scores.detach().float()
    streams = exp.streams or {}
    if "decoder_input_ids" not in streams:
        raise InputError(f"relprop found no second token stream in {type(model).__name__} (encoder–decoder); "
                         "the decoder's tokens cannot be scored")
    matrix = torch.cat([_per_column(streams[src_name]), streams["decoder_input_ids"]], 1)
    return exp, matrix.detach().float()


def _causal(matrix: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """Zero the columns after each row's last read position (exactly zero already for the rules and
    gradients; the special-token masks of the Explanation are not applied here)."""
    cols = torch.arange(matrix.shape[1])
    return torch.where(cols[None, :] <= last[:, None], matrix, torch.zeros((), dtype=matrix.dtype))
