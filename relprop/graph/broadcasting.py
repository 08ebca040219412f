"""The shape two or more shapes broadcast to, in plain Python (``torch.broadcast_shapes`` goes through
symbolic-shape machinery: tens of microseconds a call, which the rules pay at every node)."""
from __future__ import annotations

from typing import Sequence, Tuple


def broadcast_shape(*shapes: Sequence[int]) -> Tuple[int, ...]:
    """The broadcast of ``shapes`` (NumPy's rules: aligned from the last axis, 1 stretches); raises
    ``RuntimeError`` where two sizes differ and neither is 1, as ``torch.broadcast_shapes`` does."""
    out = []
    for dims in zip(*(tuple(reversed(tuple(s))) + (1,) * (max(map(len, shapes)) - len(s)) for s in shapes)):
        size = 1
        for d in dims:
            if d != 1:
                if size != 1 and d != size:
                    raise RuntimeError(f"shapes {[tuple(s) for s in shapes]} do not broadcast")
                size = d
        out.append(size)
    return tuple(reversed(out))
