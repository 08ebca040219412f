"""Which text positions an explanation leaves out: padding and special tokens ([CLS], [SEP], ...)."""
from __future__ import annotations

import os
from typing import Any, Dict, Optional

import torch

from ..errors import RelpropError

SPECIAL_ID_FIELDS = ("cls_token_id", "sep_token_id", "bos_token_id", "eos_token_id", "pad_token_id")

_SPECIAL_IDS: Dict[str, set] = {}


def special_positions(model, kwargs: Dict[str, Any], primary: str, shape, device,
                      special_tokens_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[batch, positions] bool: padding (attention mask 0), and either ``special_tokens_mask`` or the
    tokens whose id is special for ``model`` (:func:`special_ids`)."""
    special = torch.zeros(shape, dtype=torch.bool, device=device)
    am = kwargs.get("attention_mask")
    if torch.is_tensor(am) and tuple(am.shape) == tuple(shape):
        special |= am.to(device) == 0
    ids = kwargs.get(primary)
    cfg = getattr(model, "config", None)
    if special_tokens_mask is not None:
        m = torch.as_tensor(special_tokens_mask, device=device).bool()
        if tuple(m.shape) != tuple(shape):
            raise RelpropError(f"special_tokens_mask has shape {tuple(m.shape)}, expected {tuple(shape)}")
        special |= m
    elif torch.is_tensor(ids) and not ids.is_floating_point() and cfg is not None:
        for tid in special_ids(cfg):
            special |= ids.to(device) == tid
    return special


def special_ids(cfg) -> set:
    """Special token ids of a model: those its config names, plus, when the model was loaded from a
    local folder that holds its tokenizer, the tokenizer's ``all_special_ids`` (read offline)."""
    ids = {getattr(cfg, f) for f in SPECIAL_ID_FIELDS if isinstance(getattr(cfg, f, None), int)}
    path = getattr(cfg, "_name_or_path", "") or ""
    if path and os.path.isdir(path):
        if path not in _SPECIAL_IDS:
            _SPECIAL_IDS[path] = _tokenizer_special_ids(path)
        ids |= _SPECIAL_IDS[path]
    return ids


def _tokenizer_special_ids(path: str) -> set:
    """``all_special_ids`` of the tokenizer saved in folder ``path`` (empty if there is none)."""
    try:
        from transformers import AutoTokenizer  # optional dependency (relprop[hf])
        return set(AutoTokenizer.from_pretrained(path, local_files_only=True).all_special_ids)
    except Exception:  # noqa: BLE001 - no tokenizer there (or no transformers): config ids only
        return set()
