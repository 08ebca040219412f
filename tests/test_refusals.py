"""A refusal lists only methods that run on the model (relprop/api/refusals.py): every method a MethodError
names under "Methods that apply to ..." gives an explanation of the same inputs, and a method that
fails there is not named (ViT-CX on SegFormer: its 16 last-stage tokens cannot hold the 8x8 patch grid;
lrp on Jamba and Mamba: no rule for the selective scan's log1p)."""
from __future__ import annotations

import ast
import re
import warnings

import pytest
import torch
import transformers

import relprop
import zoo_models as zm

#: options that keep the re-running methods cheap here
CHEAP = {"integrated_gradients": {"n_steps": 2}, "smoothgrad": {"n_samples": 2}}


def jamba():
    """Jamba with layers [Mamba, attention, Mamba]: tokens mix outside the attention block on both sides."""
    cfg = transformers.JambaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, attn_layer_period=13,
                                   attn_layer_offset=1, expert_layer_period=13, expert_layer_offset=8,
                                   mamba_d_state=4, mamba_d_conv=3, mamba_expand=2, mamba_dt_rank=4,
                                   max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.JambaForCausalLM(cfg).eval()


CASES = {
    "segformer": (zm.segformer, lambda m: torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0)),
                  None, "rollout", r"maps 16 tokens to 64 queries", "vit_cx"),
    "perceiver_ids": (zm.perceiver_text, lambda m: zm.perceiver_text_inputs(m), None, "transformer_attribution",
                      r"maps 6 tokens to 8 queries", "raw_attention"),
    "jamba": (jamba, lambda m: zm.ids_only(m), "next_token", "gradient_rollout",
              r"mix outside them: a convolution over the tokens in 'model\.layers\.0\.mamba'", "rollout"),
    "bigbird_sparse": (zm.bigbird, lambda m: zm.bigbird_inputs(m), None, "raw_attention",
                       r"4 separate softmax-times-values products", "rollout"),
}


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n == "segformer" else pytest.mark.slow) for n in CASES])
def test_every_method_a_refusal_lists_runs(name):
    make, inputs_of, target, refused, reason, not_listed = CASES[name]
    model = make()
    x = inputs_of(model)
    with pytest.raises(relprop.MethodError) as err:
        relprop.explain(model, x, method=refused, target=target)
    msg = str(err.value)
    assert re.search(reason, msg), msg
    listed = ast.literal_eval(re.search(r"Methods that apply to \w+: (\[.*?\])", msg).group(1))
    assert listed and refused not in listed and not_listed not in listed, listed
    for method in listed:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            exp = relprop.explain(model, x, method=method, target=target, **CHEAP.get(method, {}))
        assert torch.isfinite(exp.scores).all(), method
    with pytest.raises(relprop.RelpropError):
        relprop.explain(model, x, method=not_listed, target=target, **CHEAP.get(not_listed, {}))


#: the methods that read the attention blocks' token-to-token maps
ATTENTION_METHODS = ["transformer_attribution", "ta_without_gradient", "rollout", "gradient_rollout", "raw_attention",
                     "attention_norm", "attgrads", "attcat"]


@pytest.mark.slow
def test_every_attention_method_refuses_block_sparse_attention_with_the_true_reason():
    """BigBird's block-sparse attention is one module computing several softmax x values products over parts
    of the tokens: no attention method may read one part as the layer's map (raw_attention returned row 22 of
    the last part instead of the [CLS] row; attgrads and attcat crashed) - each refuses and says why."""
    model = zm.bigbird()
    x = zm.bigbird_inputs(model)
    for method in ATTENTION_METHODS:
        with pytest.raises(relprop.MethodError, match=r"separate softmax-times-values products"):
            relprop.explain(model, x, method=method)
