"""The names the command line checks before torch is imported: the registered methods with the
options each takes, and the presets. A copy of what :mod:`relprop.methods` and :mod:`relprop.rules`
register, so that ``relprop explain --method nope`` or ``--option strat_block=4`` is answered at once;
``tests/test_cli_startup.py`` checks that it equals the registries (update it when a method or a
preset is added). It imports nothing."""
from __future__ import annotations

from typing import Dict, Tuple

_OPTIONS = {
    "attcat": "attention",
    "attention_gradcam": "",
    "attention_norm": "block discard_ratio end_block head_fusion identity last_k layer layers normalize_rows positive "
                      "query start_block",
    "attgrads": "token_scores",
    "attn_res_ln_norm": "discard_ratio end_block head_fusion last_k layers normalize_rows positive query start_block",
    "cat": "",
    "gradcam": "block layer",
    "gradient_rollout": "discard_ratio end_block head_fusion identity last_k layers normalize_rows normalize_self "
                        "positive query start_block",
    "grads": "block layer",
    "input_x_gradient": "",
    "integrated_gradients": "baseline batch_size n_steps",
    "lrp": "",
    "partial_lrp": "",
    "raw_attention": "discard_ratio end_block head_fusion identity last_k layers normalize_rows positive query "
                     "start_block",
    "rollout": "discard_ratio end_block head_fusion identity last_k layers normalize_rows positive query start_block",
    "smoothgrad": "batch_size multiply_by_input n_samples noise_level seed",
    "ta_last_block": "",
    "ta_second_block": "",
    "ta_without_gradient": "identity normalize_rows query start_block",
    "transformer_attribution": "discard_ratio end_block head_fusion identity last_k layers normalize_rows "
                               "normalize_self positive query start_block",
    "value_zeroing": "batch_size discard_ratio end_block head_fusion last_k layers positive query start_block",
    "vit_cx": "baseline batch_size distance_threshold relative",
}
#: every registered method (relprop.methods()) -> the options it takes (MethodInfo.options), sorted
METHOD_OPTIONS: Dict[str, Tuple[str, ...]] = {name: tuple(text.split()) for name, text in _OPTIONS.items()}

#: the settings of relprop.explain() that --option also takes (they apply to the whole call, every method)
EXPLAIN_SETTINGS: Tuple[str, ...] = ("compile", "eps", "fast_path", "keep_blocks", "memory", "precision",
                                     "records_budget", "unsupported")

#: every registered preset (relprop.presets())
PRESETS: Tuple[str, ...] = ('base', 'chefer2021', 'lrp', 'attnlrp', 'cp_lrp', 'pa_lrp')

#: the method of ``relprop explain`` without --method: a model's (relprop.cli.loading.Loaded), the demo's
EXPLAIN_DEFAULT_METHOD = "transformer_attribution"
DEMO_DEFAULT_METHOD = "lrp"

#: the metrics ``relprop evaluate --grid`` ranks by (relprop.evaluation.tune.METRICS)
TUNE_METRICS: Tuple[str, ...] = ("positive_auc", "negative_auc", "aopc", "log_odds", "token_f1", "miou")

#: the units of ``relprop visualize --unit`` -> how many numbers follow the kind, at least and at most
#: (relprop.tools.activation_maximization.Unit.parse)
UNIT_ARITY: Dict[str, Tuple[int, int]] = {"class": (1, 1), "neuron": (2, 3), "channel": (2, 2), "head": (2, 2),
                                          "norm": (2, 2), "layer": (1, 1)}
