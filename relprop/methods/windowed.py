"""Which methods apply to models with window attention (Swin), and how they are read there.

Swin (Liu et al., ICCV 2021) has no class token and several stages with fewer tokens each. relprop
maps each block's window attention onto the token grid of its stage
(:mod:`relprop.graph.window_attention`); the methods then read it as follows.

* **Query row.** Where a method reads "the [CLS] row", it reads the row of the pooled output
  instead: Swin's head averages the tokens of the last stage, so the query row of a
  [tokens, tokens] map is the mean of its rows (:func:`relprop.methods.query.query_rows`).
* **Rollout across stages.** ``transformer_attribution``, ``ta_without_gradient``, ``rollout`` and
  ``gradient_rollout`` multiply the block maps of a stage as usual and step from one stage to the
  next with the patch-merging matrix D (D[j, i] = 1/4 for the 2×2 tokens i merged into j):
  C = … (I + M_{b+1}) D (I + M_b) … (:func:`relprop.methods.rollout_utils.chain`).
* **Scores.** Token scores always come back on the first stage's tokens, the patch grid of the
  patch embedding (``exp.scores`` [batch, gh·gw], ``exp.map`` upsampled to the image): scores of a
  later stage are shared equally by the tokens each one merges (s · D).

Methods that read per-token records other than the attention maps — the hidden states, V, the
token features — get them per window and per stage, with no definition on the patch grid; they
raise :class:`relprop.MethodError` for these models: each says why where it is registered,
``@method(..., no_windows="...")`` (:attr:`relprop.methods.method_registry.MethodInfo.no_windows`).
"""
from __future__ import annotations

from ..errors import MethodError
from .method_registry import all_methods


def applicable_methods():
    """Names of the registered methods that apply to models with window attention (those that
    declare no ``no_windows`` reason)."""
    return sorted(n for n, m in all_methods().items() if m.no_windows is None)


def check_applicable(info, model_name: str) -> None:
    """Raise :class:`MethodError` when method ``info`` does not apply to a windowed model."""
    reason = info.no_windows
    if reason is None:
        return
    raise MethodError(f"method '{info.name}' does not apply to {model_name}, whose attention works on "
                      f"windows (Swin): {reason}. Methods that apply: {applicable_methods()}")
