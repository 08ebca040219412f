"""relprop's methods behind captum's attribution interface.

captum's attribution objects are built around a forward function and are called as
``attribute(inputs, target=None, additional_forward_args=None)``; the forward function is called as
``forward_func(*inputs, *additional_forward_args)`` and the attribution has the shape of
``inputs``. :class:`CaptumAttribution` keeps that contract for any method of
``relprop.methods()``: the model is explained with :func:`relprop.explain` on the same positional
arguments, so the two libraries bind the arguments the same way.

How relprop's scores take the shape of the input (relprop scores tokens, patches or pixels, captum
expects one number per input element):

* token ids ``[batch, tokens]`` (an integer tensor): ``exp.scores`` as they are (special tokens and
  padding 0);
* token embeddings ``[batch, tokens, dim]`` (``inputs_embeds``): each token's score spread evenly
  over its ``dim`` entries (the sum over the last axis is the token's score);
* images ``[batch, C, H, W]``: for the input-level methods (``lrp``, the gradient methods), whose
  map ``exp.map`` is the pixel relevance summed over the colour channels, that pixel relevance
  (``exp.input_relevance``) as it is; for the rollout-style methods the map (patch scores upsampled
  bilinearly) spread evenly over the ``C`` channels. In both cases the channel sum is ``exp.map``.

:class:`LLMRelpropAttribution` answers captum's ``LLMAttribution`` workflow (a prompt and a target
string; per-target-token rows) with :func:`relprop.explain_generation` (teacher-forced on the target)
and returns a ``captum.attr.LLMAttributionResult``.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple, Union

import torch

from ..api import explain
from ..errors import InputError
from ..generation import explain_generation


def _as_tuple(x) -> Tuple[Any, ...]:
    if x is None:
        return ()
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _spread(scores: torch.Tensor, like: torch.Tensor, dims: Sequence[int]) -> torch.Tensor:
    """``scores`` broadcast to ``like``'s shape over ``dims``, divided by their size (sums kept)."""
    out = scores
    count = 1
    for d in sorted(dims):
        out = out.unsqueeze(d)
        count *= like.shape[d]
    return (out / count).expand(like.shape).to(like.dtype if like.is_floating_point() else out.dtype)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    scale = float(b.abs().max()) or 1.0
    return bool(((a.to(b.dtype) - b).abs() <= 1e-5 * scale).all())


def shaped_like(exp, x: torch.Tensor) -> torch.Tensor:
    """One explanation's scores in the shape of the explained input ``x`` (the module docstring)."""
    if not x.is_floating_point():  # token ids
        if exp.scores.shape != x.shape:
            raise InputError(f"relprop's scores have shape {tuple(exp.scores.shape)}, the token ids {tuple(x.shape)}: "
                             "explain the ids the model reads (no extra tokens added by the model)")
        return exp.scores
    if x.dim() == 4:  # images [batch, C, H, W]
        if exp.map is None or tuple(exp.map.shape[-2:]) != tuple(x.shape[-2:]):
            raise InputError(f"method '{exp.method}' gives no map at the input resolution {tuple(x.shape[-2:])}")
        rel = exp.input_relevance
        if rel is not None and tuple(rel.shape) == tuple(x.shape) and _same(rel.sum(1), exp.map):
            return rel  # an input-level method: its map is this pixel relevance summed over the channels
        return _spread(exp.map, x, [1])
    if x.dim() == 3 and exp.scores.shape == x.shape[:2]:  # token embeddings [batch, tokens, dim]
        return _spread(exp.scores, x, [2])
    raise InputError(f"cannot give relprop's scores {tuple(exp.scores.shape)} the shape of an input of shape "
                     f"{tuple(x.shape)}: captum-style attributions are made for token ids [batch, tokens], token "
                     "embeddings [batch, tokens, dim] and images [batch, channels, height, width]")


class CaptumAttribution:
    """A relprop method with captum's ``Attribution`` interface.

    Parameters
    ----------
    model
        the model (``forward_func``): a ``transformers``/``timm`` model, unmodified.
    method
        a name from ``relprop.methods()``; default Transformer Attribution (Chefer, Gur & Wolf,
        CVPR 2021, Eq. 13-14).
    preset
        the relevance rules (as ``relprop.explain``).
    **options
        method options and ``relprop.explain`` keywords (``keep_blocks=``, ``eps=``, ...),
        given to every call.

    Examples
    --------
    >>> attr = CaptumAttribution(vit)
    >>> a = attr.attribute(pixels, target=3)          # [batch, 3, H, W], the channel sum is the map
    >>> captum.metrics.infidelity(vit, perturb_fn, pixels, a, target=3)
    """

    def __init__(self, model: torch.nn.Module, method: str = "transformer_attribution", preset: Any = None,
                 **options):
        self.forward_func = model
        self.method, self.preset, self.options = method, preset, options
        #: the :class:`relprop.Explanation` of the last call (notes, conservation, per-block records)
        self.last_explanation = None

    def attribute(self, inputs: Union[torch.Tensor, Tuple[torch.Tensor, ...]], target: Any = None,
                  additional_forward_args: Any = None, **kwargs) -> Union[torch.Tensor, Tuple[torch.Tensor]]:
        """Attribute ``target``'s score to ``inputs`` (a tensor, or a tuple holding one tensor).

        ``target`` is captum's: None (the predicted class), a class index, or one per sample;
        ``additional_forward_args`` are the model's further positional arguments (e.g. the attention
        mask after the token ids); ``kwargs`` are method options for this call. Returns a tensor (a
        tuple when ``inputs`` is a tuple) of the inputs' shape.
        """
        many = isinstance(inputs, (tuple, list))
        xs = _as_tuple(inputs)
        if len(xs) != 1 or not torch.is_tensor(xs[0]):
            raise InputError(f"CaptumAttribution explains one input tensor; got {len(xs)} "
                             f"({', '.join(type(x).__name__ for x in xs)}): pass the others as "
                             "additional_forward_args")
        if isinstance(target, (list, tuple)):
            target = torch.as_tensor(target)
        args = xs + _as_tuple(additional_forward_args)
        exp = explain(self.forward_func, args, target=target, method=self.method, preset=self.preset,
                      **{**self.options, **kwargs})
        self.last_explanation = exp
        out = shaped_like(exp, xs[0]).detach().contiguous()
        return (out,) if many else out

    def has_convergence_delta(self) -> bool:
        """captum's question: does ``attribute`` return a convergence delta? (No.)"""
        return False

    @property
    def multiplies_by_inputs(self) -> bool:
        """captum's question: are the attributions global (multiplied by the inputs)? True for relevance."""
        return True


class LLMRelpropAttribution:
    """relprop on captum's ``LLMAttribution`` text workflow: why a language model writes ``target``
    after ``prompt``.

    ``attribute(prompt, target)`` explains each token of ``target`` (teacher-forced) with
    ``relprop.explain_generation`` and returns a ``captum.attr.LLMAttributionResult`` whose
    ``token_attr`` [target tokens, prompt tokens] holds each target token's relevance on the prompt
    tokens and ``seq_attr`` [prompt tokens] their sum over the target tokens (the relevance of the sum
    of the target tokens' logits: relevance is additive in the explained score). Default method:
    AttnLRP (Achtibat et al., ICML 2024), as ``relprop.explain_generation``.
    """

    def __init__(self, model: torch.nn.Module, tokenizer: Any, method: str = "lrp", preset: Any = "attnlrp",
                 **options):
        self.model, self.tokenizer = model, tokenizer
        self.method, self.preset, self.options = method, preset, options
        #: the :class:`relprop.GenerationExplanation` of the last call
        self.last_explanation = None

    def attribute(self, prompt: str, target: Optional[str] = None, max_new_tokens: int = 16, **kwargs):
        """``captum.attr.LLMAttributionResult`` for ``target`` after ``prompt`` (None: the greedy
        continuation of ``max_new_tokens`` tokens)."""
        from captum.attr import LLMAttributionResult  # optional dependency: imported when used

        target_ids = None
        if target is not None:
            target_ids = torch.tensor(self.tokenizer(target, add_special_tokens=False)["input_ids"])
            if target_ids.numel() == 0:
                raise InputError(f"the target {target!r} has no tokens")
        gen = explain_generation(self.model, self.tokenizer, prompt, max_new_tokens=max_new_tokens,
                                 method=self.method, preset=self.preset, target=target_ids,
                                 **{**self.options, **kwargs})
        self.last_explanation = gen
        n = gen.source_length
        token_attr = gen.matrix[:, :n].detach().cpu().float().numpy()
        labels = gen.labels or [str(int(i)) for i in gen.columns]
        rows = gen.row_labels or [str(int(i)) for i in gen.rows]
        return LLMAttributionResult(input_tokens=list(labels[:n]), output_tokens=list(rows),
                                    seq_attr=token_attr.sum(0), token_attr=token_attr)
