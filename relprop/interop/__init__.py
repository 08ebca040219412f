"""relprop inside other tools' workflows: captum, Quantus and inseq.

* :class:`CaptumAttribution` has captum's ``attribute(inputs, target=...,
  additional_forward_args=...)`` and returns attributions shaped like the inputs, so relprop's
  methods run where captum's do (``captum.metrics.infidelity``, ``sensitivity_max``, captum's
  visualization); :class:`LLMRelpropAttribution` answers captum's ``LLMAttribution`` text workflow
  with a ``captum.attr.LLMAttributionResult``.
* :func:`quantus_explain_func` is an ``explain_func`` for Quantus metrics.
* :mod:`relprop.interop.inseq_method` registers relprop as an inseq attribution method
  (``inseq.load_model(model, "relprop", method=...)``); it imports inseq, so it is imported on its own.

None of these modules imports the other library at import time except the inseq one; each works with
relprop's own tensors and only builds the other library's objects when asked to.
"""
from .captum_style import CaptumAttribution, LLMRelpropAttribution
from .quantus_style import quantus_explain_func

__all__ = ["CaptumAttribution", "LLMRelpropAttribution", "quantus_explain_func"]
