"""Which text positions an explanation leaves out, and why: padding and special tokens ([CLS],
[SEP], <s>, ...).

The special tokens of a batch are known, in order of preference, from:

1. ``special_tokens_mask`` given to :func:`relprop.explain`, or carried by the batch itself (a
   tokenizer called with ``return_special_tokens_mask=True``);
2. the tokenizer given with ``explain(..., tokenizer=...)`` (its ``all_special_ids``, the unknown
   token excepted: an [UNK] stands for a word);
3. the ids the model's config names (``cls_token_id``, ``sep_token_id``, ``bos_token_id``,
   ``eos_token_id``, ``pad_token_id``), and, when the model was loaded from a local folder that
   holds its tokenizer, that tokenizer's special ids.

When none of these names a token other than padding (a BERT loaded from the hub with transformers 5,
whose config names no cls/sep id), [CLS] and [SEP] would be scored like words: the explanation says
so in its notes and a :class:`relprop.RelpropWarning` asks for the tokenizer.
"""
from __future__ import annotations

import os
from typing import Any, Dict, Optional, Tuple

import torch

from ..errors import OptionError, RelpropError, warn

SPECIAL_ID_FIELDS = ("cls_token_id", "sep_token_id", "bos_token_id", "eos_token_id", "pad_token_id")
#: keys a tokenizer adds to a batch that are not inputs of the model
TOKENIZER_ONLY_KEYS = ("special_tokens_mask", "offset_mapping", "length", "overflow_to_sample_mapping",
                       "num_truncated_tokens", "overflowing_tokens")

_SPECIAL_IDS: Dict[str, set] = {}


def split_tokenizer_keys(inputs: Any) -> Tuple[Any, Optional[torch.Tensor]]:
    """``inputs`` without the keys a tokenizer adds that are not model inputs, and the batch's
    ``special_tokens_mask`` (None if it carries none)."""
    if not hasattr(inputs, "keys") or not any(k in inputs for k in TOKENIZER_ONLY_KEYS):
        return inputs, None
    mask = inputs.get("special_tokens_mask")
    return {k: v for k, v in inputs.items() if k not in TOKENIZER_ONLY_KEYS}, mask


def mask_from_tokenizer(tokenizer, ids: torch.Tensor) -> torch.Tensor:
    """[batch, positions] bool: the positions of ``ids`` whose id is one of ``tokenizer``'s special
    ids (the unknown token excepted)."""
    special = getattr(tokenizer, "all_special_ids", None)
    if special is None:
        raise OptionError(f"tokenizer must be a HuggingFace tokenizer (with all_special_ids), not "
                          f"{type(tokenizer).__name__}")
    unk = getattr(tokenizer, "unk_token_id", None)
    out = torch.zeros(ids.shape, dtype=torch.bool, device=ids.device)
    for tid in set(special) - {unk}:
        out |= ids == tid
    return out


def special_positions(model, kwargs: Dict[str, Any], primary: str, shape, device,
                      special_tokens_mask: Optional[torch.Tensor] = None, source: str = "") -> Tuple[torch.Tensor, str]:
    """([batch, positions] bool, why): padding (attention mask 0), and either ``special_tokens_mask``
    (which came from ``source``) or the tokens whose id is special for ``model`` (:func:`special_ids`);
    ``why`` says in words which positions were left out and where that came from."""
    special = torch.zeros(shape, dtype=torch.bool, device=device)
    am = kwargs.get("attention_mask")
    padded = torch.is_tensor(am) and tuple(am.shape) == tuple(shape)
    if padded:
        special |= am.to(device) == 0
    ids = kwargs.get(primary)
    cfg = getattr(model, "config", None)
    if special_tokens_mask is not None:
        m = torch.as_tensor(special_tokens_mask, device=device).bool()
        if tuple(m.shape) != tuple(shape):
            raise RelpropError(f"special_tokens_mask has shape {tuple(m.shape)}, expected {tuple(shape)}")
        special |= m
        why = f"special tokens from {source or 'special_tokens_mask'}"
    elif torch.is_tensor(ids) and not ids.is_floating_point() and cfg is not None:
        known, where = special_ids(cfg)
        for tid in known:
            special |= ids.to(device) == tid
        why = f"the special token ids {sorted(known)} ({where})"
        if not (known - {getattr(cfg, "pad_token_id", None)}):
            why = ("no special token: the model's config names no id of [CLS]/[SEP]/<s>/</s> and no tokenizer was "
                   "given, so such tokens are scored like words; pass tokenizer= or special_tokens_mask=")
            warn(f"{type(model).__name__}: {why}")
    else:
        why = "no special token (the model has no config naming special ids)"
    return special, "left out of the scores: " + ("padding (attention_mask 0) and " if padded else "") + why


def special_ids(cfg) -> Tuple[set, str]:
    """Special token ids of a model, and where they came from: those its config names, plus, when
    the model was loaded from a local folder that holds its tokenizer, the tokenizer's special ids
    (read offline)."""
    ids = {getattr(cfg, f) for f in SPECIAL_ID_FIELDS if isinstance(getattr(cfg, f, None), int)}
    where = "named by the model's config"
    path = getattr(cfg, "_name_or_path", "") or ""
    if path and os.path.isdir(path):
        if path not in _SPECIAL_IDS:
            _SPECIAL_IDS[path] = _tokenizer_special_ids(path)
        if _SPECIAL_IDS[path]:
            ids |= _SPECIAL_IDS[path]
            where += f" and the tokenizer saved in {path}"
    return ids, where


def _tokenizer_special_ids(path: str) -> set:
    """The special ids (the unknown token excepted) of the tokenizer saved in folder ``path``
    (empty if there is none)."""
    try:
        from transformers import AutoTokenizer  # optional dependency (relprop[hf])
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception:  # noqa: BLE001 - no tokenizer there (or no transformers): config ids only
        return set()
    return set(tok.all_special_ids) - {tok.unk_token_id}
