"""Evaluate explanations the way the papers do (issue #4; DESIGN §5).

=====================  ================================================================================
module                 what it measures
=====================  ================================================================================
``perturbation``       positive/negative perturbation tests: top-1 accuracy while the most/least relevant
                       pixels, patches or tokens are removed, and its AUC (CVPR 2021 §4, Table 1)
``segmentation``       maps as soft segmentations: pixel accuracy, mIoU, mAP (CVPR 2021 Table 2)
``text``               token-F1 and Precision@K against rationales, AOPC, log-odds, Kendall-τ
                       (CVPR 2021 Fig. 4; AttCAT §5.3)
``conservation``       where the relevance went, per block and end to end
``datasets``           a folder of images with masks; a JSONL file of texts with rationales
``runner``             :func:`evaluate`: every metric, every method, over a dataset (one explain call
                       per batch for all the methods)
``report``             markdown and CSV tables, a plot of the perturbation curves
``command``            ``relprop evaluate`` (``add_parser`` / ``run``)
=====================  ================================================================================

Everything is computed per sample, batched, on the device of the inputs; the only statistics across
samples are the dataset averages.

>>> exp = relprop.explain(model, images, method="transformer_attribution")
>>> relprop.evaluation.perturbation_curve(model, images, exp, mode="positive").auc
"""
from ._util import resolve_normalization  # noqa: F401
from .perturbation import (DEFAULT_STEPS, PerturbationResult, perturbation_curve,  # noqa: F401
                           removal_ranks, removal_token)
from .segmentation import SegmentationResult, segmentation_scores  # noqa: F401
from .text import (AOPC_STEPS, FaithfulnessResult, aopc, kendall_tau, log_odds,  # noqa: F401
                   precision_at_k, token_f1, top_k)
from .conservation import ConservationReport, ConservationRow, conservation_report  # noqa: F401
from .datasets import (ImageMaskFolder, RationaleJSONL, load_dataset, model_image_size,  # noqa: F401
                       model_normalization, rationale_spans)
from .runner import (EvaluationResult, TextScores, evaluate, evaluate_perturbation,  # noqa: F401
                     evaluate_segmentation, evaluate_text)
from .report import (plot_perturbation, summary_rows, to_markdown, to_markdown_table,  # noqa: F401
                     write_csv, write_markdown, write_report)
