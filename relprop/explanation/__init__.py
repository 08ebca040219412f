"""The result of :func:`relprop.explain` (:class:`Explanation`) and how it is built from a trace."""
from .build import build, patch_sums
from .result import Explanation
from .special_tokens import (SPECIAL_ID_FIELDS, mask_from_tokenizer, special_ids, special_positions,
                             split_tokenizer_keys)

__all__ = ["Explanation", "SPECIAL_ID_FIELDS", "build", "mask_from_tokenizer", "patch_sums", "special_ids",
           "special_positions", "split_tokenizer_keys"]
