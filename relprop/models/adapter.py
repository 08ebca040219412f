"""The protocol of a model family's adapter: what ``relprop.explain`` asks of a family before and after the
generic spine (capture, engine run, methods), and the no-op adapter a plain model takes.

The spine (``relprop.api``) knows no family: it asks the registry (:mod:`relprop.models.registry`) for the
adapter of the model and makes one call per step where a family may differ:

1. :meth:`ModelAdapter.split_batch`: a batch the family's captured call cannot take at once (a processor's
   output for several prompts with images whose vision tower packs them together) is cut into samples
   that ``explain`` runs one by one, and :meth:`ModelAdapter.join` joins their Explanations into the
   batch's (one row per sample, as if explained together);
2. :meth:`ModelAdapter.prepare`: the inputs as relprop captures them (keys that are layout, not tensors the
   forward reads, taken out and checked; a module that takes the family's image as pixels), the input the
   explanation is onto (``wrt``), and a ``layout`` handed back at step 3;
3. :meth:`ModelAdapter.compose`: each Explanation placed on what the user gave (a tiled image's tiles put
   back together, the prompt's tokens remembered beside the image);
4. :attr:`ModelAdapter.generation` and :meth:`ModelAdapter.explain_generation`: how
   ``relprop.explain_generation`` explains the family's prompts, ``"batched"`` (teacher-forced copies, a
   chunk per call) or ``"steps"`` (one call per generated token); None: the spine's own text generation.

Every method of :class:`ModelAdapter` is the plain model's: nothing changes. A family subclasses it,
overrides what differs, and is one row of :data:`relprop.models.registry.ADAPTERS` (or
``relprop.models.register(adapter)`` from outside the package; ``docs/extending.md``).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, List, Optional, Sequence, Tuple

from ..errors import MethodError


@dataclasses.dataclass(frozen=True)
class Adapted:
    """What :meth:`ModelAdapter.prepare` gives the spine: the ``model`` and ``inputs`` relprop captures,
    the input explained onto (``wrt``, None: the spine chooses), and ``layout``, anything the family's
    :meth:`ModelAdapter.compose` needs back (a tile grid), None for most."""

    model: Any
    inputs: Any
    wrt: Optional[str]
    layout: Any = None


class ModelAdapter:
    """A family's adapter; this base is the plain model's, every step a no-op (module docstring)."""

    #: the family's name, as notes and errors say it
    name: str = "plain model"
    #: how explain_generation explains the family's prompts with an image: "batched", "steps" or None
    generation: Optional[str] = None

    def matches(self, model: Any) -> bool:
        """True when ``model`` is of this family (the registry asks the adapters in order)."""
        return True

    def splits(self, model: Any, inputs: Any) -> bool:
        """True when ``inputs`` is a batch the family explains sample by sample (:meth:`split_batch`)."""
        return False

    def split_batch(self, model: Any, inputs: Any, target: Any, special_tokens_mask: Any) -> Tuple[List[Any], Any]:
        """``(samples, length)``: each sample with ``.inputs``, ``.target``, ``.special_tokens_mask`` as
        ``explain`` takes them, and what :meth:`join` needs of the batch (its padded length)."""
        raise MethodError(f"{self.name}: this family explains its batches as they are (split_batch is not defined)")

    def join(self, runs: Sequence[Any], samples: Sequence[Any], length: Any, many: bool, model: Any) -> Any:
        """The batch's Explanation (or list, one per method when ``many``) from one run per sample."""
        raise MethodError(f"{self.name}: this family explains its batches as they are (join is not defined)")

    def prepare(self, model: Any, inputs: Any, methods: Sequence[Any], wrt: Optional[str]) -> Adapted:
        """The call as relprop captures it (:class:`Adapted`); ``methods``: the MethodInfos asked for."""
        return Adapted(model, inputs, wrt)

    def capture_call(self, model: Any, inputs: Any) -> Tuple[Any, Any]:
        """``(model, inputs)`` as the family is captured, for ``relprop.coverage``: :meth:`prepare` without
        the checks that read the methods."""
        return model, inputs

    def compose(self, results: List[Any], model: Any, inputs: dict, primary: str, layout: Any,
                tokenizer: Any = None) -> None:
        """Place each Explanation of ``results`` on what the user gave (in place)."""

    def explain_generation(self, explain: Callable, model: Any, tokenizer: Any, prompt: Any, max_new_tokens: int,
                           method: Any, preset: Any, target: Any, contrast: Any, batch_size: Optional[int],
                           options: dict, tokens_per_call: int, as_tokens: Callable) -> Any:
        """``relprop.explain_generation`` of one prompt with its image, each step through ``explain``; None when
        the prompt is not one the family explains (the spine's text generation runs)."""
        return None


#: the adapter of a model that no family claims
PLAIN = ModelAdapter()
