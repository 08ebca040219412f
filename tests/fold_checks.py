"""The check shared by the tests of block folding (``keep_blocks=False``, and ``keep_blocks=None`` past the
records budget): a folded explanation equals the one that keeps every block's records."""
import torch

TOL = dict(rtol=1e-5, atol=1e-6)


def assert_folded_like_kept(kept, folded):
    """Scores and map equal to float32 rounding (relative to the largest score); the query, the target's
    scores (one forward pass either way) and the mask bit for bit; the per-head maps, where the method has
    them, to rounding."""
    scale = float(kept.scores.abs().max().clamp_min(1e-12))
    torch.testing.assert_close(folded.scores / scale, kept.scores / scale, **TOL)
    torch.testing.assert_close(folded.query, kept.query, rtol=0, atol=0)
    torch.testing.assert_close(folded.target_scores, kept.target_scores, rtol=0, atol=0)
    if kept.heads is not None:
        torch.testing.assert_close(folded.heads, kept.heads, **TOL)
    if kept.map is not None:
        torch.testing.assert_close(folded.map / scale, kept.map / scale, **TOL)
    assert torch.equal(folded.mask, kept.mask) if kept.mask is not None else folded.mask is None
