"""Which models are causal decoders, for the checks of the spine that depend on it (a left-padded batch
without ``position_ids`` is not the computation its texts are alone: ``relprop.api.validation``)."""
from __future__ import annotations

from typing import Any

#: config.model_type of decoder-only families whose classification heads (``*ForSequenceClassification``)
#: neither generate nor set ``config.is_decoder``, and which number positions 0..n-1 whatever the mask
CAUSAL_TYPES = ("gpt2", "llama", "mistral", "gpt_neox", "gptj", "opt", "qwen2", "phi", "gemma")


def is_causal_decoder(model: Any) -> bool:
    """True for a causal decoder: ``config.is_decoder``, a model that generates (``can_generate()``), or one
    of :data:`CAUSAL_TYPES` (a decoder's classification head)."""
    config = getattr(model, "config", None)
    can = getattr(model, "can_generate", None)
    try:
        if bool(getattr(config, "is_decoder", False)) or (bool(can()) if callable(can) else False):
            return True
    except Exception:  # noqa: BLE001 - a can_generate() that fails: not known to be a decoder
        pass
    return getattr(config, "model_type", None) in CAUSAL_TYPES
