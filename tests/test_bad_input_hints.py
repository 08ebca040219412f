"""Bad inputs name what to do: a method or preset name in the wrong case is suggested in lower case, a
tokenizer's output made without ``return_tensors`` names ``return_tensors='pt'``, a CLI class name is
suggested once."""
from __future__ import annotations

import pytest

import relprop
from models import hf_bert


def test_method_and_preset_in_capitals_are_suggested():
    with pytest.raises(relprop.RelpropError, match=r"Did you mean 'lrp'\?"):
        relprop.methods.get_method("LRP")
    with pytest.raises(relprop.RelpropError, match=r"Did you mean 'attnlrp'\?"):
        relprop.rules.get_preset("AttnLRP")


def test_token_lists_name_return_tensors():
    model = hf_bert()
    with pytest.raises(relprop.RelpropError, match=r"return_tensors='pt'"):
        relprop.explain(model, {"input_ids": [[5, 6, 7]], "attention_mask": [[1, 1, 1]]}, target=0)


def test_cli_class_suggestion_names_each_class_once():
    from relprop.cli.common import CliError, resolve_class
    with pytest.raises(CliError) as err:
        resolve_class("sport", {0: "sports", 1: "politics"}, 2, "target")
    assert "Did you mean 'sports'?" in str(err.value), str(err.value)


def test_an_empty_text_is_a_warning_not_a_silent_zero_map():
    import warnings

    import torch
    model = hf_bert()
    batch = {"input_ids": torch.tensor([[2, 3, 0, 0], [2, 7, 8, 3]]), "attention_mask": torch.tensor([[1, 1, 0, 0],
                                                                                                 [1, 1, 1, 1]])}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        e = relprop.explain(model, batch, target=0, special_tokens_mask=torch.tensor([[1, 1, 0, 0], [1, 0, 0, 1]]))
    said = [str(w.message) for w in caught if "no token to score" in str(w.message)]
    assert len(said) == 1 and "text(s) [0]" in said[0] and said[0] in e.notes
    assert torch.all(e.scores[0] == 0)
