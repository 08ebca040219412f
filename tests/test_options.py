"""Every bad argument of explain(), coverage() and the evaluation functions is a RelpropError that names
the choices, raised before any work is done; none is accepted silently."""
import pytest
import torch

import models
import relprop
import relprop.evaluation as E


@pytest.fixture(scope="module")
def vit():
    model = models.timm_vit_tiny()
    return model, models.image_batch(model)


@pytest.mark.parametrize("method", ["rollout", "lrp", "transformer_attribution", ["rollout", "lrp"]])
def test_unsupported_takes_two_values(vit, method):
    model, x = vit
    with pytest.raises(relprop.OptionError) as err:
        relprop.explain(model, x, target=0, method=method, unsupported="foo")
    assert "'error'" in str(err.value) and "'z_rule'" in str(err.value)


@pytest.mark.parametrize("eps", [-1, -1e-12, float("nan"), float("inf"), "1e-9", None, True])
def test_eps_is_a_finite_number_at_least_zero(vit, eps):
    model, x = vit
    with pytest.raises(relprop.OptionError, match="eps=.*finite number >= 0"):
        relprop.explain(model, x, target=0, eps=eps)


def test_eps_zero_is_allowed(vit):
    model, x = vit
    assert torch.isfinite(relprop.explain(model, x, target=0, eps=0).scores).all()


@pytest.mark.parametrize("value", ["yes", 1, 0, "auto"])
def test_fast_path_is_none_true_or_false(vit, value):
    model, x = vit
    with pytest.raises(relprop.OptionError, match=r"fast_path=.*Choices: \[None, True, False\]"):
        relprop.explain(model, x, target=0, method="lrp", preset="attnlrp", fast_path=value)


def test_memory_is_checked_once_with_one_error_class(vit):
    model, x = vit
    for value in ("lowest", None, 3):
        with pytest.raises(relprop.OptionError, match="memory=.*Choices: \\['default', 'low', 'high'\\]"):
            relprop.explain(model, x, target=0, memory=value)


def test_an_option_no_method_of_a_list_takes_is_an_error(vit):
    model, x = vit
    with pytest.raises(relprop.MethodError) as err:
        relprop.explain(model, x, target=0, method=["rollout", "lrp"], strat_block=1)
    msg = str(err.value)
    assert "'strat_block'" in msg and "lrp: none" in msg
    assert ("rollout: ['discard_ratio', 'end_block', 'head_fusion', 'identity', 'last_k', 'layers', "
            "'normalize_rows', 'positive', 'query', 'start_block']") in msg
    # an option that some of the methods take goes to those
    a, b = relprop.explain(model, x, target=0, method=["rollout", "lrp"], start_block=1)
    assert torch.equal(a.scores, relprop.explain(model, x, target=0, method="rollout", start_block=1).scores)
    with pytest.raises(relprop.MethodError, match="'strat_block' is not an option of method 'rollout'"):
        relprop.explain(model, x, target=0, method="rollout", strat_block=1)


def test_method_and_preset_values(vit):
    model, x = vit
    with pytest.raises(relprop.MethodError, match="names a method twice"):
        relprop.explain(model, x, method=["rollout", "rollout"])
    with pytest.raises(relprop.MethodError, match="names no method"):
        relprop.explain(model, x, method=[])
    with pytest.raises(relprop.OptionError, match="preset must be.*Choices"):
        relprop.explain(model, x, preset=3)
    with pytest.raises(relprop.PresetError, match="'chefer' is not a preset.*Choices"):
        relprop.explain(model, x, preset="chefer")
    with pytest.raises(relprop.OptionError, match="special_tokens_mask must be"):
        relprop.explain(model, x, special_tokens_mask="cls")


@pytest.mark.parametrize("how", [{}, {"memory": "low"}, {"method": "lrp", "preset": "attnlrp"}])
def test_a_target_that_does_not_depend_on_the_input_is_a_target_error(vit, how):
    """One error, from one place, on the default path, the low-memory path and the fast path."""
    model, x = vit
    with pytest.raises(relprop.TargetError, match="does not depend on the explained input"):
        relprop.explain(model, x, target=lambda out: torch.zeros(out.shape[0]), **how)


def test_coverage_checks_its_arguments(vit):
    model, x = vit
    with pytest.raises(relprop.PresetError, match="is not a preset"):
        relprop.coverage(model, x, preset="nope")
    with pytest.raises(relprop.InputError, match="wrt='text'.*choices"):
        relprop.coverage(model, x, wrt="text")
    assert relprop.coverage(model, x, preset=relprop.get_preset("lrp")).preset == "lrp"


# ------------------------------------------------------------------------------------- evaluation

@pytest.mark.parametrize("settings, expected", [
    ({"target": "truth"}, r"target 'truth' is not a choice. Choices: \['predicted', 'label'\]"),
    ({"unit": "voxel"}, r"unit 'voxel' is not a choice. Choices: \['pixel', 'patch'\]"),
    ({"modes": ["sideways"]}, r"mode 'sideways' is not a choice. Choices: \['positive', 'negative'\]"),
    ({"batch_size": 0}, "batch_size must be a positive int"),
    ({"perturbation_batch_size": -2}, "perturbation_batch_size must be a positive int"),
    ({"rationale_k": [0]}, "rationale_k must be a positive int"),
    ({"kendall": "yes"}, r"kendall='yes' is not a choice here. Choices: \[True, False\]"),
    ({"bacth_size": 4}, r"\['bacth_size'\] is not a setting of relprop.evaluation.evaluate. Settings: \["),
    ({"explain_options": 3}, "explain_options must be a dict"),
])
def test_evaluation_settings_are_checked(vit, settings, expected):
    model, x = vit
    with pytest.raises(relprop.OptionError, match=expected):
        E.evaluate(model, {"inputs": x}, ["rollout"], progress=False, **settings)
    with pytest.raises(relprop.OptionError, match=expected):
        E.EvaluationConfig.of(**settings)


def test_evaluation_config_object_and_keywords_agree(vit):
    model, x = vit
    cfg = E.EvaluationConfig(steps=(0.3, 0.6), modes=("positive",), segmentation=False, progress=False)
    a = E.evaluate(model, {"inputs": x}, ["rollout"], cfg)
    b = E.evaluate(model, {"inputs": x}, ["rollout"], steps=[0.3, 0.6], modes=["positive"], segmentation=False,
                   progress=False)
    assert a.table() == b.table() and a.table()[0]["positive_auc"] >= 0
    assert E.EvaluationConfig.of(cfg, batch_size=3).batch_size == 3 and cfg.batch_size == 8
    with pytest.raises(relprop.OptionError, match="config must be an EvaluationConfig"):
        E.evaluate(model, {"inputs": x}, ["rollout"], {"steps": [0.5]})
