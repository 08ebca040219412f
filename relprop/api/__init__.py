"""The api layer: what a user calls, every argument checked before any work.

==================  =====================================================================================
module              job
==================  =====================================================================================
``front_door``      :func:`explain` and :func:`explain_settings`: the arguments checked, then run
``prologue``        what ``explain`` and ``coverage`` share first (:func:`prepare`: check, bind the inputs,
                    capture the graph)
``checked_call``    one call of ``explain`` checked into a frozen ``Call``; every other error a RelpropError
``method_runs``     the engine run per preset, the methods applied, the Explanations built
``graph_coverage``  :func:`coverage`: every op of the captured graph and how a preset handles it
``options``         every argument of ``explain`` and ``coverage`` checked, each bad value a named error
``validation``      the model, its inputs and the result checked (no NaN or ±inf leaves relprop)
``raw_inputs``      inputs users have (pipelines, raw text, images, files) turned into tensors
``zero_shot``       zero-shot pipelines (text and image) as the model
``refusals``        a method's refusal lists only the methods that run on the model
``generated_text``  :func:`explain_generation`: attribution of every token a model generates
==================  =====================================================================================
"""
from .front_door import explain, explain_settings
from .options import DEFAULT_PRESET
from .prologue import Prepared, prepare
from .graph_coverage import coverage
from .generated_text import GenerationExplanation, explain_generation
from ..models.generated_image_text import ImageGenerationExplanation

__all__ = ["DEFAULT_PRESET", "GenerationExplanation", "ImageGenerationExplanation", "Prepared", "coverage", "explain",
           "explain_generation", "explain_settings", "prepare"]
