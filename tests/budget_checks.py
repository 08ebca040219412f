"""Comparisons shared by the tests of the memory-bounded paths (tests/test_fast_memory.py,
tests/test_fast_low.py, tests/test_walk_without_records.py)."""
import torch


def budget_notes(exp):
    """The notes of ``exp`` about ``records_budget`` (an automatic choice of the segmented path)."""
    return [n for n in exp.notes if "records_budget" in n]


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a − b| over max |b|: the difference as a share of the reference's scale."""
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
