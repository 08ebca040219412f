"""Targets: what :func:`relprop.explain` explains, turned into one differentiable score per sample.

At the engine's level (the engine resolves a target into its relevance seed); nothing here imports a
layer above the errors.

=================  ========================================================================================
module             job
=================  ========================================================================================
``target_scores``  :class:`Target` and :func:`resolve`: None, class indices or a callable as per-sample
                   scores; :func:`next_token`, :func:`predicted_next_token` (language models) and
                   :func:`contrast` (``score(a) − score(b)``)
``target_heads``   targets for question answering (:func:`question_answering`, :func:`best_span`) and
                   token classification (:func:`token_classification`)
``target_forms``   every form of ``explain(target=...)`` (a label name, ``"next_token"``, ``"span"``, ...)
                   resolved by the kind of head the model has (:func:`specify`, :func:`head_kind`)
=================  ========================================================================================

``relprop.targets`` is the public path of all of them (``relprop.targets.next_token(mask)``).
"""
from .target_scores import (Contrast, NextToken, PositionTarget, PredictedNextToken, Target, check_mask_argument,
                            contrast, explained_tokens, find_logits, fixed, last_positions, logits_of, next_token,
                            predicted_next_token, require_input_dependence, resolve)
from .target_heads import QA_PARTS, QuestionAnswering, TokenClassification, best_span, question_answering, \
    token_classification
from .target_forms import HEADS, head_kind, specify

__all__ = ["Contrast", "HEADS", "NextToken", "PositionTarget", "PredictedNextToken", "QA_PARTS", "QuestionAnswering",
           "Target", "TokenClassification", "best_span", "check_mask_argument", "contrast", "explained_tokens",
           "find_logits", "fixed", "head_kind", "last_positions", "logits_of", "next_token", "predicted_next_token",
           "question_answering", "require_input_dependence", "resolve", "specify", "token_classification"]
