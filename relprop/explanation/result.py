"""The result of :func:`relprop.explain`: :class:`Explanation`."""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional

import torch

from ..engine.trace import BlockRecord, Conservation, NotKept
from ..viz import api as viz_api
from ..viz import notebook as viz_notebook
from . import data_export as export


@dataclasses.dataclass
class Explanation:
    """Which input positions drove the target score.

    ``tokens``, ``labels``, ``target_label`` and ``image`` are what ``show()``, ``save()``, ``words()``,
    ``overlay()`` and the notebook display use when no argument says otherwise; nothing is stored on
    the model.

    Attributes
    ----------
    method
        the method's name.
    scores
        [batch, positions]. Text: one score per input id (padding and special tokens such as
        [CLS]/[SEP] are 0 and ``mask`` is False there). Images: one score per patch, in row-major patch-grid order (the
        class/distillation tokens are excluded). Sign: non-negative for the rollout-style methods;
        signed methods keep their sign (positive = supports the target).
    map
        [batch, H, W] for images: ``scores`` on the patch grid, upsampled bilinearly to the input
        resolution; for input-level methods (lrp, gradients) the pixel map itself, summed over the
        colour channels (and ``scores`` are its sums over each patch). None for text.
    mask
        [batch, positions] bool, True where ``scores`` is meaningful (text: not padding, not a
        special token).
    matrix
        [batch, tokens, tokens] aggregated token-to-token matrix (rollout-style methods;
        special tokens included) or None.
    query
        [batch, rows of ``matrix``] the weights of the rows the scores combine: the token
        states the target reads (one-hot at the class token, uniform over average-pooled tokens,
        a decoder's last position; ``relprop.methods.query``), or None for methods that read
        no query row.
    blocks
        per attention block, A, dA, R_A, h, dh (``relprop.engine.trace.BlockRecord``).
        With ``explain(..., keep_blocks=False)`` a rollout-style method folds the blocks into its
        scores and keeps no records: reading ``blocks`` (or ``matrix``) then raises a
        ``relprop.MethodError`` that names ``keep_blocks=True``.
    target
        [batch] class indices explained (None for a callable target).
    target_scores
        [batch] the explained scores (logits of the target class).
    conservation
        relevance put in, reaching the input, absorbed by constants, and per block,
        per sample (None for methods that do not propagate relevance).
    input_relevance
        relevance at the input (pixels [batch, C, H, W]; tokens [batch, positions],
        the token embeddings' relevance summed over the embedding size).
    logits
        [batch, classes] the model's output scores (if it has them).
    heads
        [batch, heads, positions] (methods that fuse attention heads: raw_attention, rollout,
        gradient_rollout, transformer_attribution, attention_norm) each head's map, before the head
        fusion, of the query row at the last block of the method's block range (choose the block
        with ``end_block=b + 1``), placed like ``scores``; the per-head maps of DINO (Caron et al.,
        ICCV 2021, Fig. 3), drawn one panel per head by ``relprop.viz.heads_figure``. None for
        the other methods.
    notes
        what relprop decided for this explanation and why, in words (e.g. why the one-backward
        fast path was not taken, or a fallback of the memory mode).
    tokens
        per sample, the token strings of the explained input (from the tokenizer given to
        ``relprop.explain`` or the pipeline's), one per position of ``scores``; None when unknown.
    labels
        the model's class names (``config.id2label``, a pipeline's, timm's
        ``pretrained_cfg["label_names"]``), or None when it has none (or only ``LABEL_i`` defaults).
    target_label
        per sample, the name of what is explained: the label name given as ``target=``,
        ``labels[target]``, or a language model's next token as text (``" Paris"``); None when unknown.
    image, image_mean, image_std
        the [batch, C, H, W] pixels the model was given, and the
        normalisation its preprocessing applied (undone for display), when known.
    image_tokens, prompt_tokens
        a vision-language model's prompt: [batch, tokens] True at the image placeholders, and per
        sample the token strings (the ids as strings without a tokenizer); ``show()``/``save()`` draw
        ``streams["input_ids"]`` on them beside the image's heatmap. None for other models.
    """

    method: str
    scores: torch.Tensor
    map: Optional[torch.Tensor]
    mask: Optional[torch.Tensor]
    matrix: Optional[torch.Tensor]
    blocks: List[BlockRecord]
    target: Optional[torch.Tensor]
    target_scores: torch.Tensor
    conservation: Optional[Conservation]
    input_relevance: Optional[torch.Tensor]
    logits: Optional[torch.Tensor]
    preset: Optional[str]
    modality: str
    grid: Optional[tuple] = None
    prefix_tokens: int = 0
    outputs: Any = None
    signed: bool = False
    class_specific: bool = True
    notes: List[str] = dataclasses.field(default_factory=list)
    query: Optional[torch.Tensor] = None
    heads: Optional[torch.Tensor] = None
    #: two-stream models (encoder–decoder, co-attention): input name -> [batch, tokens] scores of that
    #: stream's tokens (padding zeroed); ``scores`` is the explained input's entry. None otherwise
    streams: Optional[Dict[str, torch.Tensor]] = None
    #: two-stream models: the stream whose tokens the target reads (the rows of ``matrix``)
    output_stream: Optional[str] = None
    convergence_delta: Optional[torch.Tensor] = None  # integrated_gradients: Σ IG − (f(x) − f(x₀)) per sample
    tokens: Optional[List[List[str]]] = None
    labels: Any = None
    target_label: Optional[List[Optional[str]]] = None
    image: Optional[torch.Tensor] = None
    image_mean: Optional[tuple] = None
    image_std: Optional[tuple] = None
    image_tokens: Optional[torch.Tensor] = None
    prompt_tokens: Optional[List[List[str]]] = None

    def __getattribute__(self, name):
        value = object.__getattribute__(self, name)
        if type(value) is NotKept:  # a folded explanation: blocks / matrix were not kept
            value._refuse()
        if name == "prefix_tokens" and isinstance(value, torch.Tensor):  # counted on the device: read once, now
            value = int(value)
            object.__setattr__(self, name, value)
        return value

    @property
    def kept_blocks(self) -> bool:
        """False when ``blocks`` and ``matrix`` were not kept (``explain(..., keep_blocks=False)``
        folded the blocks into the scores); reading them then raises ``relprop.MethodError``."""
        return type(object.__getattribute__(self, "blocks")) is not NotKept

    def show(self, **kwargs):
        """Display the explanation (image overlay, or coloured tokens/HTML in a notebook); see
        ``relprop.viz.api.show`` for the options (``image=``, ``tokens=``, ``index=``, ...)."""
        return viz_api.show(self, **kwargs)

    def save(self, path, **kwargs):
        """Write the explanation to ``path`` (.png overlay for images, .html for text); see
        ``relprop.viz.api.save``."""
        return viz_api.save(self, path, **kwargs)

    def words(self, tokenizer=None, inputs=None, index: Optional[int] = None, **kwargs):
        """Word-level scores as ``(word, score)`` pairs (pieces merged, their scores summed), one list per
        sample or that of ``index``; see ``relprop.viz.api.words``."""
        return viz_api.words(self, tokenizer, inputs, index, **kwargs)

    def overlay(self, image=None, index: int = 0, **kwargs):
        """The overlay of sample ``index`` as an [H, W, 3] uint8 array; see ``relprop.viz.api.overlay``."""
        return viz_api.overlay(self, image, index, **kwargs)

    def __len__(self) -> int:
        return self.scores.shape[0]

    def __getitem__(self, key) -> "Explanation":
        """Sample ``key`` (negative counts from the end) as an Explanation of one sample, or the samples of
        a slice; an IndexError names the valid range. See ``relprop.explanation.data_export.select``."""
        return export.select(self, key)

    def to_dict(self, *, tokens=None, labels=None, include_map: bool = False) -> Dict[str, Any]:
        """JSON-serialisable dict: method, preset, and per sample the target (index, name, score), the
        position names (token strings, else ``"token j"``; ``"patch (r, c)"`` for images), scores and
        mask. See ``relprop.explanation.data_export.to_dict``."""
        return export.to_dict(self, tokens=tokens, labels=labels, include_map=include_map)

    def to_json(self, path=None, **kwargs) -> str:
        """``to_dict`` as a JSON string, or written to ``path`` (returned)."""
        return export.to_json(self, path, **kwargs)

    def save_npz(self, path, **kwargs) -> str:
        """Write the arrays (scores, mask, map, target, target_scores) and a JSON ``meta`` to a compressed
        ``.npz``; read it with ``load_npz`` or ``numpy.load(path)["scores"]``."""
        return export.save_npz(self, path, **kwargs)

    @classmethod
    def load_npz(cls, path) -> "Explanation":
        """The Explanation written by ``save_npz`` (its arrays and kind; no block records)."""
        return cls(**export.npz_fields(path))

    def to_table(self, *, tokens=None, labels=None):
        """A tidy table, one row per sample and position (sample, position, name, score, mask, target,
        target_label, method): a ``pandas.DataFrame`` when pandas is installed, else a list of dicts."""
        return export.to_table(self, tokens=tokens, labels=labels)

    def _repr_html_(self) -> str:
        """The explanation drawn for a notebook (Jupyter calls this): coloured tokens, or the image map as an
        inline PNG, one panel per sample, with the method and target in the caption."""
        return viz_notebook.explanation_html(self)

    def __repr__(self) -> str:
        blocks = len(self.blocks) if self.kept_blocks else "not kept"
        return (f"Explanation(method={self.method!r}, preset={self.preset!r}, scores={tuple(self.scores.shape)}, "
                f"map={None if self.map is None else tuple(self.map.shape)}, blocks={blocks}, "
                f"target={None if self.target is None else self.target.tolist()}"
                + (f", target_label={self.target_label!r}" if self.target_label is not None else "") + ")")
