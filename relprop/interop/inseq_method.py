"""relprop as an inseq attribution method: ``inseq.load_model(model, "relprop", ...)``.

inseq (Sarti et al., ACL 2023 demo) attributes each generated token of a language model to the
prompt and the earlier tokens, one generation step at a time, with captum-style methods. Importing
this module registers :class:`RelpropInseqAttribution` under the name ``"relprop"`` (inseq finds
its methods by subclass): at each step the prefix is explained with :func:`relprop.explain` and the
relevance of the next token's **logit** at the prefix's last position is returned per prefix token
(decoder-only models) or per source token (encoder–decoder models: inseq gives a method that reads
token ids, as this one does, no ``attribute_target=True``).

    import inseq
    import relprop.interop.inseq_method  # registers "relprop"
    model = inseq.load_model(hf_model, "relprop", tokenizer=tokenizer)
    out = model.attribute("a prompt", attributed_fn="logit", relprop_method="lrp", preset="attnlrp")

relprop explains logits (the relevance seed is the logit, as AttnLRP, Achtibat et al., ICML 2024,
§3): an ``attributed_fn`` other than ``"logit"`` is refused with a :class:`relprop.RelpropError`
instead of being silently replaced. relprop's method is ``relprop_method=`` (inseq's own ``method=`` names
the attribution method, ``"relprop"`` here: a relprop method name there would never reach relprop);
``preset=`` and the method's options are keyword arguments of ``attribute``; default AttnLRP
(``relprop_method="lrp", preset="attnlrp"``).
"""
from __future__ import annotations

import functools
from typing import Any, Dict, Optional

from inseq.attr.feat.feature_attribution import FeatureAttribution
from inseq.data import CoarseFeatureAttributionStepOutput

from ..api import explain
from ..errors import OptionError
from ..methods import all_methods

#: the one inseq step function whose score relprop explains
EXPLAINED_FN = "logit_fn"
#: relprop.explain keywords inseq's attribute() passes through to this method (with every method option)
_OURS = ("relprop_method", "preset", "eps", "keep_blocks", "fast_path", "memory", "special_tokens_mask")


def _step_name(step: Any) -> str:
    """The name of inseq's step function (``logit_fn``, ``probability_fn``, ...), through a partial."""
    inner = step.func if isinstance(step, functools.partial) else step
    return getattr(inner, "__name__", type(inner).__name__)


class RelpropInseqAttribution(FeatureAttribution):
    """inseq attribution method ``"relprop"`` (see the module docstring)."""

    method_name = "relprop"

    def __init__(self, attribution_model, **kwargs):
        super().__init__(attribution_model)
        self.attribute_batch_ids = True  # relprop reads the token ids, not inseq's embeddings
        self.forward_batch_embeds = False
        self.use_baselines = False

    def get_attribution_args(self, **kwargs):
        """Split inseq's extra keyword arguments into relprop's (``method``, ``preset``, options) and
        the rest."""
        known = set(_OURS) | {o for info in all_methods().values() for o in info.options}
        ours = {k: kwargs.pop(k) for k in list(kwargs) if k in known}
        return ours, kwargs

    def attribute_step(self, attribute_fn_main_args: Dict[str, Any],
                       attribution_args: Optional[Dict[str, Any]] = None) -> CoarseFeatureAttributionStepOutput:
        """Explain the next token's logit at the prefix's last position with :func:`relprop.explain`: one score
        per token already (inseq's coarse-grained output, which its default aggregation leaves as it is)."""
        args = tuple(attribute_fn_main_args["additional_forward_args"])
        model = self.attribution_model.model
        enc_dec = self.attribution_model.is_encoder_decoder
        if enc_dec:  # inputs: (source ids,); the target embeddings come first among the extra arguments
            _, src, tgt, target_ids, fn, src_mask, tgt_mask = args[:7]
            inputs = {"input_ids": src, "attention_mask": src_mask, "decoder_input_ids": tgt,
                      "decoder_attention_mask": tgt_mask}
        else:
            ids, target_ids, fn, mask = args[:4]
            inputs = {"input_ids": ids, "attention_mask": mask}
        if _step_name(fn) != EXPLAINED_FN:
            raise OptionError(f"relprop explains the target token's logit, not inseq's '{_step_name(fn)}': call "
                              "attribute(..., attributed_fn='logit')")
        options = dict(attribution_args or {})
        method = options.pop("relprop_method", "lrp")
        preset = options.pop("preset", "attnlrp" if method == "lrp" else None)
        exp = explain(model, inputs, target=target_ids.reshape(-1), method=method, preset=preset, **options)
        if not enc_dec:
            return CoarseFeatureAttributionStepOutput(source_attributions=None,
                                                target_attributions=exp.scores.detach().cpu().float(), step_scores={})
        source = (exp.streams or {}).get("input_ids", exp.scores)
        return CoarseFeatureAttributionStepOutput(source_attributions=source.detach().cpu().float(),
                                            target_attributions=None, step_scores={})
