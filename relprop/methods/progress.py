"""Progress bars for the methods that re-run the model many times (tqdm when it is installed)."""
from __future__ import annotations


class _Silent:
    """A progress bar that shows nothing (tqdm is not installed)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def update(self, n: int = 1) -> None:
        pass


def progress_bar(total: int, desc: str):
    """A context-managed progress bar over ``total`` steps: tqdm's (shown only on a terminal,
    removed when done), or a silent one when tqdm is not installed (it is an optional dependency)."""
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return _Silent()
    return tqdm(total=total, desc=desc, disable=None, leave=False)
