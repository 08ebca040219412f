"""Wrong things thrown at ``explain()`` ("bad input").

Every case ends either in a correct result (finite scores of the right shape; for a model in train
mode, the eval-mode result) or in a :class:`relprop.RelpropError` whose message names the problem;
never in NaN, never in an exception from deep inside torch, and the model is never changed (its
parameters, buffers, modes and hooks are snapshotted around each call).

Each case is tried once by name (``test_each_case``), then hypothesis draws cases with random
batch sizes, lengths, positions and values (``test_fuzz``). Each case's outcome is recorded on its
test report (``record_property``, which pytest-xdist sends back from its workers); the closing note
of the run counts them (``pytest_terminal_summary`` in ``conftest.py``), so the count does not depend
on which worker ran which case or in what order.
"""

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import models
import relprop
from snapshot import assert_same, snapshot

#: the name under which each case's outcome is recorded on its test report (read by conftest.py)
OUTCOME_PROPERTY = "bad_input_outcome"

_MODELS = {}


def _model(kind):
    if kind not in _MODELS:
        if kind == "vision":
            _MODELS[kind] = models.hf_vit()  # 32x32 pixels, 16 patches: the fastest vision model
        elif kind == "text":
            _MODELS[kind] = models.hf_bert()
        elif kind == "mlp":
            torch.manual_seed(0)
            _MODELS[kind] = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 8), torch.nn.ReLU(),
                                                torch.nn.Linear(8, 3)).eval()
        elif kind == "cnn":
            torch.manual_seed(0)
            _MODELS[kind] = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(),
                                                torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                                                torch.nn.Linear(4, 3)).eval()
    return _MODELS[kind]


class TupleOutput(torch.nn.Module):
    """A model whose forward returns a tuple (logits, something else)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, pixel_values):
        logits = self.inner(pixel_values=pixel_values).logits
        return logits, logits.softmax(-1)


def _pixels(batch, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 3, 32, 32, generator=g)


def _text(batch, length, seed):
    lengths = [max(1, length - (i % 2)) for i in range(batch)]
    return models.text_batch(lengths=lengths, seed=seed, first_id=2)


# Each case: (model kind, inputs, keyword arguments of explain(), expected outcome, text the error
# message must contain). ``p`` holds the drawn parameters: batch, length, seed, position, value.
def case_valid_image(p):
    return "vision", _pixels(p["batch"], p["seed"]), {}, "result", None


def case_valid_text(p):
    return "text", _text(p["batch"], p["length"], p["seed"]), {}, "result", None


def case_length_one_text(p):
    ids = torch.randint(2, models.VOCAB, (p["batch"], 1), generator=torch.Generator().manual_seed(p["seed"]))
    return "text", {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, {}, "result", None


def case_nonfinite_pixels(p):
    x = _pixels(p["batch"], p["seed"])
    x.view(-1)[p["position"] % x.numel()] = p["value"]
    return "vision", x, {}, "InputError", "nan" if p["value"] != p["value"] else "inf"


def case_empty_batch(p):
    kind = "vision" if p["seed"] % 2 else "text"
    inputs = _pixels(1, 0)[:0] if kind == "vision" else {k: v[:0] for k, v in _text(2, 4, 0).items()}
    return kind, inputs, {}, "InputError", "empty batch"


def case_integer_pixels(p):
    x = (_pixels(p["batch"], p["seed"]).clamp(0, 1) * 255).to(torch.uint8)
    return "vision", x, {}, "InputError", "dtype"


def case_half_pixels_float_model(p):
    dtype = torch.float16 if p["seed"] % 2 else torch.float64
    return "vision", _pixels(p["batch"], p["seed"]).to(dtype), {}, "InputError", "parameters are torch.float32"


def case_float_token_ids(p):
    t = _text(p["batch"], p["length"], p["seed"])
    t["input_ids"] = t["input_ids"].float()
    return "text", t, {}, "InputError", "token ids must be integers"


def case_token_ids_without_batch(p):
    t = _text(1, p["length"], p["seed"])
    return "text", {"input_ids": t["input_ids"][0]}, {}, "InputError", "batch dimension"


def case_token_id_out_of_vocab(p):
    t = _text(p["batch"], p["length"], p["seed"])
    t["input_ids"][0, 0] = models.VOCAB + p["position"] % 50
    return "text", t, {}, "InputError", "vocabulary"


def case_mask_shape_mismatch(p):
    t = _text(p["batch"], p["length"], p["seed"])
    t["attention_mask"] = torch.ones(p["batch"], p["length"] + 2, dtype=torch.long)
    return "text", t, {}, "InputError", "attention_mask"


def case_all_padding_row(p):
    t = _text(p["batch"], p["length"], p["seed"])
    row = p["position"] % p["batch"]
    t["attention_mask"][row] = 0
    return "text", t, {}, "InputError", "all zeros"


def case_wrong_image_size(p):
    size = (16, 48)[p["seed"] % 2]
    return "vision", torch.randn(p["batch"], 3, size, size), {}, "InputError", "cannot run on these inputs"


def case_wrong_channels(p):
    return "vision", torch.randn(p["batch"], 1 + 3 * (p["seed"] % 2 + 1) % 5, 32, 32), {}, "InputError", \
        "cannot run on these inputs"


def case_image_without_batch(p):
    return "vision", torch.randn(3, 32, 32), {}, "InputError", "cannot run on these inputs"


def case_target_out_of_range(p):
    t = 5 + p["position"] % 7 if p["seed"] % 2 else -1 - p["position"] % 3
    return "vision", _pixels(p["batch"], p["seed"]), {"target": t}, "TargetError", "out of range"


def case_target_wrong_length(p):
    return "vision", _pixels(p["batch"], p["seed"]), {"target": [0] * (p["batch"] + 1)}, "TargetError", \
        "entries but the batch has"


def case_target_float(p):
    return "text", _text(p["batch"], p["length"], p["seed"]), {"target": [0.5] * p["batch"]}, "TargetError", \
        "integers"


def case_target_callable_wrong_shape(p):
    return "vision", _pixels(p["batch"], p["seed"]), {"target": lambda out: out.logits}, "TargetError", \
        "one score per sample"


def case_train_mode(p):
    return "vision-train", _pixels(p["batch"], p["seed"]), {"target": 1}, "result", None


def case_tuple_output(p):
    return "tuple", _pixels(p["batch"], p["seed"]), {"target": 2}, "result", None


def case_mlp_default_method(p):
    return "mlp", torch.randn(p["batch"], 3, 2, 2), {}, "MethodError", "no attention blocks"


def case_mlp_lrp(p):
    return "mlp", torch.randn(p["batch"], 3, 2, 2), {"method": "lrp"}, "result", None


def case_cnn_input_x_gradient(p):
    return "cnn", torch.randn(p["batch"], 3, 8, 8), {"method": "input_x_gradient"}, "result", None


def case_not_a_module(p):
    return "function", _pixels(p["batch"], p["seed"]), {}, "InputError", "nn.Module"


def case_inputs_on_other_device(p):
    return "vision", torch.empty(p["batch"], 3, 32, 32, device="meta"), {}, "InputError", "is on meta"


CASES = {name[5:]: fn for name, fn in sorted(globals().items()) if name.startswith("case_")}


def _resolve_model(kind):
    if kind == "vision-train":
        return _model("vision"), True
    if kind == "tuple":
        return TupleOutput(_model("vision")).eval(), False
    if kind == "function":
        return (lambda x: x), False
    return _model(kind), False


def try_case(name, p, record=None):
    """Run one case and check how it ended; returns the outcome label ("result" or the error class
    name), also passed to ``record(OUTCOME_PROPERTY, "case:outcome")`` when given (pytest's
    ``record_property``)."""
    kind, inputs, kwargs, expected, needle = CASES[name](p)
    model, train = _resolve_model(kind)
    if train:
        model.train()
    is_module = isinstance(model, torch.nn.Module)
    before = snapshot(model) if is_module else None
    try:
        exp = relprop.explain(model, inputs, **kwargs)
    except relprop.RelpropError as e:
        outcome = type(e).__name__
        assert expected != "result", f"{name}: expected a result, got {outcome}: {e}"
        assert isinstance(e, getattr(relprop, expected)), f"{name}: expected {expected}, got {outcome}: {e}"
        assert needle.lower() in str(e).lower(), f"{name}: the message does not name the problem: {e}"
    else:
        outcome = "result"
        assert expected == "result", f"{name}: expected {expected}, got a result"
        batch = inputs["input_ids"].shape[0] if isinstance(inputs, dict) else inputs.shape[0]
        assert exp.scores.shape[0] == batch
        assert torch.isfinite(exp.scores).all(), f"{name}: non-finite scores"
        if exp.map is not None:
            assert torch.isfinite(exp.map).all()
        if train:  # explained as the eval-mode model is (dropout not applied)
            ref = relprop.explain(_model("vision").eval(), inputs, **kwargs)
            model.train()
            assert torch.equal(exp.scores, ref.scores)
    finally:
        if is_module:
            assert_same(before, snapshot(model))
            if train:
                assert model.training
                model.eval()
    if record is not None:
        record(OUTCOME_PROPERTY, f"{name}:{outcome}")
    return outcome


DEFAULTS = {"batch": 2, "length": 5, "seed": 1, "position": 3, "value": float("nan")}


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_case(name, record_property):
    try_case(name, DEFAULTS, record_property)


@pytest.mark.slow  # fuzzing: 40 drawn cases (each named case also runs in the fast suite, test_each_case)
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(name=st.sampled_from(sorted(CASES)), batch=st.integers(1, 3), length=st.sampled_from([3, 6]),
       seed=st.integers(0, 1000), position=st.integers(0, 10_000),
       value=st.sampled_from([float("nan"), float("inf"), float("-inf")]))
def test_fuzz(record_property, name, batch, length, seed, position, value):
    try_case(name, {"batch": batch, "length": length, "seed": seed, "position": position, "value": value},
             record_property)

