"""A model whose dynamic exports fail is exported statically at its next input size, without trying
the dynamic exports again (relprop.graph.capture.CaptureCache._attempts): vision-language models
fail every dynamic export on transformers' image-token count check, so each new prompt length used to
cost three exports."""
import torch

import relprop
from relprop.graph import export
from relprop.graph.capture import CaptureCache


_TRIES = {}


class StaticOnly(torch.nn.Module):
    """Embedding + mean + linear classifier whose forward refuses symbolic sizes (as a model with a
    data-dependent check does), and counts the tries (in a list: torch.export restores the module's
    attributes after tracing)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(20, 8)
        self.head = torch.nn.Linear(8, 3)
        _TRIES[id(self)] = 0

    @property
    def symbolic_calls(self):
        return _TRIES[id(self)]

    def forward(self, input_ids):
        if any(not isinstance(s, int) for s in input_ids.shape):
            _TRIES[id(self)] += 1
            raise RuntimeError("this model takes only concrete sizes")
        return self.head(torch.tanh(self.emb(input_ids)).mean(1))


def test_failed_dynamic_attempts_are_not_repeated():
    cache = CaptureCache(disk=False, first_export="dynamic")
    model = StaticOnly()
    cache.get(model, {"input_ids": torch.randint(0, 20, (1, 5))})
    first = model.symbolic_calls
    assert first == len(export.ATTEMPTS) - 1  # every dynamic attempt was tried once, then the static one
    assert cache._attempts(model, {"input_ids": None}) == export.ATTEMPTS[-1:]
    for n in (6, 7):
        cache.get(model, {"input_ids": torch.randint(0, 20, (1, n))})
    assert model.symbolic_calls == first  # new lengths: static exports only
    assert cache.traces == 3
    cache.clear(model)  # forgetting the model forgets its failures too
    cache.get(model, {"input_ids": torch.randint(0, 20, (1, 8))})
    assert model.symbolic_calls == 2 * first


def test_other_input_names_and_models_try_every_attempt():
    cache = CaptureCache(disk=False, first_export="dynamic")
    a, b = StaticOnly(), StaticOnly()
    cache.get(a, {"input_ids": torch.randint(0, 20, (1, 5))})
    assert cache._attempts(a, {"input_ids": None, "attention_mask": None}) == export.ATTEMPTS
    assert cache._attempts(b, {"input_ids": None}) == export.ATTEMPTS


def test_explanations_after_a_static_export_match_a_fresh_capture():
    """The explanation at the second length equals the one a new model object (same weights, no memory
    of failures) gives: skipping the attempts changes only the work, never the numbers. (The first call of
    a model is exported at its sizes; the second length tries the dynamic exports, which fail.)"""
    model = StaticOnly()
    x5, x7 = torch.randint(0, 20, (2, 5)), torch.randint(0, 20, (2, 7))
    relprop.explain(model, {"input_ids": x5}, target=1, method="lrp", preset="attnlrp", wrt="input_ids")
    skipped = relprop.explain(model, {"input_ids": x7}, target=1, method="lrp", preset="attnlrp", wrt="input_ids")
    fresh_model = StaticOnly()
    fresh = relprop.explain(fresh_model, {"input_ids": x7}, target=1, method="lrp", preset="attnlrp",
                            wrt="input_ids")
    assert model.symbolic_calls == len(export.ATTEMPTS) - 1 and fresh_model.symbolic_calls == 0
    torch.testing.assert_close(skipped.scores, fresh.scores, rtol=0, atol=0)
    assert skipped.scores.abs().sum() > 0


class Sized(torch.nn.Module):
    """A linear map scaled by plain-int inputs (as LLaVA-NeXT's image_sizes, which relprop hands the model as
    ints): torch.export fixes them as constants of the program."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 2)

    def forward(self, x, sizes):
        return self.lin(x) * (sizes[0][0] + 2 * sizes[0][1])


def test_equal_plain_values_reuse_the_program_other_values_do_not():
    """A list of ints is matched by value (it was matched by identity: a fresh list each call meant a new
    export each call); another value is another program, whose constant is its own."""
    cache = CaptureCache(disk=False)
    model = Sized()
    x = torch.randn(1, 4)
    first = cache.get(model, {"x": x, "sizes": [[3, 5]]})
    again = cache.get(model, {"x": x, "sizes": [[3, 5]]})  # equal, not the same list
    assert again is first and cache.traces == 1
    other = cache.get(model, {"x": x, "sizes": [[3, 6]]})
    assert other is not first and cache.traces == 2
    assert cache.get(model, {"x": x, "sizes": ((3, 5),)}) is not first  # a tuple is not the list
    for sizes in ([[3, 5]], [[3, 6]]):  # each value explained with its own constant
        out = relprop.explain(model, {"x": x, "sizes": sizes}, target=0, method="input_x_gradient")
        torch.testing.assert_close(out.logits, model(x, sizes))
