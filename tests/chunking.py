"""The engine's knobs as the tests set them: a :class:`relprop.Tuning` whose segmented runs evaluate the
attention cores whole (``rows=None``) or in chunks of ``rows`` query rows."""
from typing import Optional

import relprop


def rows(n: Optional[int], **chunks) -> relprop.Tuning:
    """``Tuning`` with cores in chunks of ``n`` query rows (``chunks``: more fields of
    :class:`relprop.RowChunks`), or whole for ``n=None``."""
    return relprop.Tuning(chunks=None if n is None else relprop.RowChunks(rows=n, **chunks))
