"""Evaluate explanations the way the papers do.

=========================  ============================================================================
module                     what it measures
=========================  ============================================================================
``perturbation_protocol``  positive/negative perturbation tests: top-1 accuracy while the most/least
                           relevant pixels, patches or tokens are removed, and its AUC (CVPR 2021 §4, Table 1)
``segmentation``           maps as soft segmentations: pixel accuracy, mIoU, mAP (CVPR 2021 Table 2)
``qa``                     Precision@K for extractive QA, the answer tokens among the top K (AttCAT §5.3)
``text_metrics``           token-F1 and Precision@K against rationales, AOPC, log-odds, Kendall-τ
                           (CVPR 2021 Fig. 4; AttCAT §5.3)
``conservation``           where the relevance went, per block and end to end
``datasets``               a folder of images with masks; a JSONL file of texts with rationales
``runner``                 :func:`evaluate`: every metric, every method, over a dataset (one explain call
                           per batch for all the methods)
``report``                 markdown and CSV tables, a plot of the perturbation curves
``config``                 :class:`EvaluationConfig`: every setting of :func:`evaluate`, validated
``removal``                what removing a pixel, patch or token means in the perturbation tests
``tune``                   :func:`tune`: aggregation options as hyperparameters, ranked on held-out data
``sharded``                :func:`evaluate` batch by batch, resumable, shared among torchrun processes
=========================  ============================================================================

Everything is computed per sample, batched, on the device of the inputs; the only statistics across
samples are the dataset averages.

>>> exp = relprop.explain(model, images, method="transformer_attribution")
>>> relprop.evaluation.perturbation_curve(model, images, exp, mode="positive").auc
"""
from ._util import resolve_normalization
from .config import EvaluationConfig
from .conservation import ConservationReport, ConservationRow, conservation_report
from .datasets import (ImageMaskFolder, RationaleJSONL, load_dataset, model_image_size, model_normalization,
                       rationale_spans)
from .perturbation_protocol import DEFAULT_STEPS, PerturbationResult, perturbation_curve, removal_ranks
from .qa import answer_mask, qa_precision_at_k
from .removal import removal_token
from .report import (plot_perturbation, summary_rows, to_markdown, to_markdown_table, write_csv, write_markdown,
                     write_report)
from .runner import (EvaluationResult, TextScores, evaluate, evaluate_perturbation, evaluate_segmentation,
                     evaluate_text)
from .segmentation import SegmentationResult, segmentation_scores
from .tune import METRICS, TuneResult, grid_settings, tune
from .text_metrics import AOPC_STEPS, FaithfulnessResult, aopc, kendall_tau, log_odds, precision_at_k, token_f1, top_k

__all__ = [
    "AOPC_STEPS", "ConservationReport", "ConservationRow", "DEFAULT_STEPS", "EvaluationConfig", "EvaluationResult",
    "FaithfulnessResult", "METRICS", "TuneResult", "grid_settings", "tune",
    "ImageMaskFolder", "PerturbationResult", "RationaleJSONL", "SegmentationResult",
    "TextScores", "aopc", "conservation_report", "evaluate", "evaluate_perturbation", "evaluate_segmentation",
    "evaluate_text", "kendall_tau", "load_dataset", "log_odds", "model_image_size", "model_normalization",
    "perturbation_curve", "plot_perturbation", "precision_at_k", "rationale_spans", "removal_ranks",
    "removal_token", "resolve_normalization", "segmentation_scores", "summary_rows", "to_markdown",
    "to_markdown_table", "token_f1", "top_k", "write_csv", "write_markdown", "write_report",
    "answer_mask", "qa_precision_at_k",
]
