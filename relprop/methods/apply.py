"""Running a method on a trace, after checking that the trace has what the method reads."""
from __future__ import annotations

from typing import Any, Dict, Optional

from ..errors import MethodError
from .method_registry import MethodInfo, all_methods
from .windowed import check_applicable


def two_stream_methods():
    """Names of the registered methods defined on models with two token streams (encoder-decoder,
    co-attention: ``@method(..., streams=2)``): the bi-modal rules (gradient_rollout,
    transformer_attribution), the input relevance of every stream (lrp), and the gradient methods
    on the explained input's stream."""
    return sorted(n for n, m in all_methods().items() if m.streams == 2)


def no_relevance(name: str, preset: Optional[str]) -> str:
    """Why method ``name``, which reads R_A, cannot run on the relevance of ``preset``."""
    return (f"method '{name}' reads the relevance of the attention maps (R_A), and preset '{preset}' gives them none "
            f"(CP-LRP holds the attention constant). Use preset 'attnlrp' or 'chefer2021' for it, or method 'lrp' for "
            f"the input relevance.")


def apply(info: MethodInfo, trace, options: Dict[str, Any], preset: Optional[str], model_name: str) -> dict:
    """``info.fn(trace, **options)``, or a :class:`MethodError` saying why the method does not apply
    to this model: it reads attention blocks and the graph has none, it reads the relevance of the
    attention maps and ``preset`` gives none, or the model's attention works on windows (Swin) and
    the method has no definition there."""
    unmapped = getattr(trace, "unmapped_blocks", None)
    if info.needs_blocks and not trace.blocks and not unmapped:
        usable = sorted(n for n, m in all_methods().items() if not m.needs_blocks)
        raise MethodError(f"method '{info.name}' reads the attention blocks, and no attention blocks (a softmax "
                          f"whose output multiplies the values) were found in {model_name}'s graph. "
                          f"Methods that apply without attention: {usable}")
    if info.needs_blocks and unmapped:
        usable = sorted(n for n, m in all_methods().items() if not m.needs_blocks)
        raise MethodError(f"method '{info.name}' reads the attention blocks as token-to-token maps, and {model_name} "
                          f"computes {unmapped}. Methods that apply: {usable}")
    if info.needs_relevance and info.needs_blocks and any(b.relevance is None for b in trace.blocks):
        raise MethodError(no_relevance(info.name, preset))
    if getattr(trace, "merged", False) and info.needs_blocks:
        raise MethodError(f"method '{info.name}' reads the attention blocks of one token space, and with the image "
                          f"explained (wrt='pixel_values') {model_name}'s blocks are those of its vision tower and of "
                          "its language model, whose tokens differ. Explain wrt='input_ids' (the language model's "
                          "tokens, image tokens mapped back to their patches) or use a method that reads the input "
                          "relevance (lrp, input_x_gradient)")
    if len(getattr(trace, "streams", None) or []) > 1 and info.streams < 2 and not getattr(trace, "merged", False):
        raise MethodError(f"method '{info.name}' reads the attention blocks of one token stream, and {model_name} has "
                          f"two ({', '.join(trace.streams)}) connected by cross-attention, which it does not define. "
                          f"Methods that apply: {two_stream_methods()}")
    if getattr(trace, "stages", None) is not None:  # window attention (Swin)
        check_applicable(info, model_name)
    return info.fn(trace, **options)
