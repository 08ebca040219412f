"""Kernels per warm ``explain()`` call, per method, held to a bound per model (relprop.tools.launch_count):
a regression that adds launches fails here. Counted as on an accelerator (``Tuning(host_reads="end")``)
on the tiny models of tests/test_host_syncs.py, as a ratio to one forward+backward pass of the same model
(weight gradients), so that the bound does not move with the model's size. The bounds are the counts
measured when they were set, plus a tenth; lower them when a change removes kernels
(``python benchmarks/launches.py`` gives the issue-sized models' table)."""
import pytest

import test_host_syncs as cases
from relprop.tools.launch_count import count

#: method@preset -> the most kernels per kernel of forward+backward: (tiny LLaMA, BERT, ViT)
BOUNDS = {
    "transformer_attribution@": (5.6, 7.3, 12.8),
    "ta_without_gradient@": (5.5, 7.2, 12.5),
    "ta_last_block@": (5.4, 7.0, 12.1),
    "ta_second_block@": (5.4, 7.0, 12.1),
    "partial_lrp@": (4.3, 5.2, 9.9),
    "raw_attention@": (1.9, 1.9, 4.3),
    "rollout@": (2.0, 2.2, 4.9),
    "attention_gradcam@": (1.9, 2.0, 4.2),
    "gradient_rollout@": (2.0, 2.1, 4.7),
    "attn_res_ln_norm@": (2.5, 2.7, 5.4),
    "cat@": (1.7, 1.6, 3.3),
    "attcat@": (1.7, 1.7, 3.6),
    "grads@": (1.8, 1.8, 3.9),
    "attgrads@": (1.7, 1.6, 3.4),
    "attention_norm@": (1.9, 2.0, 4.4),
    "gradcam@": (1.7, 1.6, 3.4),
    "input_x_gradient@": (1.6, 1.5, 3.1),
    "value_zeroing@": (4.3, 3.5, 9.2),
    "lrp@lrp": (4.1, 4.9, 9.0),
    "lrp@chefer2021": (5.2, 6.7, 11.2),
    "lrp@attnlrp": (2.1, 2.8, 5.1),
    "lrp@cp_lrp": (1.5, 2.3, 4.5),
    "smoothgrad@": (5.8, 2.7, 5.0),
    "integrated_gradients@": (6.1, 3.0, 6.0),
}
MODELS = ("llama", "bert", "vit")
_FWD_BWD = {}


def _fwd_bwd_kernels(name) -> int:
    if name not in _FWD_BWD:
        model, x, _ = cases._case(name)

        def fwd_bwd():
            out = model(**x) if isinstance(x, dict) else model(x)
            logits = out.logits if hasattr(out, "logits") else out
            (logits[:, -1, 5] if logits.dim() == 3 else logits[:, 1]).sum().backward()
            model.zero_grad(set_to_none=True)
        fwd_bwd()
        _FWD_BWD[name] = count(fwd_bwd).kernels
    return _FWD_BWD[name]


def test_every_method_has_a_bound():
    assert set(BOUNDS) == {f"{m}@{kw.get('preset', '')}" for m, kw in cases.CALLS}


def _within_bound(name, method, kw):
    fn = cases._call(name, method, kw)
    fn()
    fn()  # capture, warm-up
    ratio = count(fn).kernels / _fwd_bwd_kernels(name)
    bound = BOUNDS[f"{method}@{kw.get('preset', '')}"][MODELS.index(name)]
    assert ratio <= bound, f"{name} {method} {kw}: {ratio:.2f}x the kernels of forward+backward, bound {bound}x"


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("method,kw", [("transformer_attribution", {}), ("gradient_rollout", {}),
                                       ("lrp", {"preset": "attnlrp"}), ("lrp", {"preset": "lrp"})],
                         ids=["ta", "gr", "attnlrp", "lrp"])
def test_kernels_of_the_main_methods_stay_within_the_bound(method, kw):
    _within_bound("llama", method, kw)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("method,kw", cases.CALLS, ids=[f"{m}-{kw.get('preset', '')}" for m, kw in cases.CALLS])
def test_kernels_per_call_stay_within_the_bound(name, method, kw):
    _within_bound(name, method, kw)
