"""AttnLRP computed by its authors' library, LXT (``pip install lxt``), on the tiny models of
``tests/llm_models.py``: the reference of ``tests/test_lxt_agreement.py``.

Run as a script in a process of its own (LXT patches transformers' classes for the whole process)::

    python tests/lxt_reference.py llama qwen2 gemma3 gpt2

prints one JSON object {model: {"relevance": [[...], ...], "logits": [...], "tokens": [...]}}: per
sample, the input relevance of the logit of the predicted next token at the last position. The
mixture-of-experts models (``mixtral qwen2_moe qwen3_moe olmoe``), for which LXT 2.1 has no patch
map, get one made of LXT's functions as its repository patches Qwen3-MoE (:func:`_moe_patch_map`).

LXT is applied as its README applies it: ``monkey_patch(<the model's modeling module>)`` with
LXT's default AttnLRP patch map for the family, the word embeddings fed as ``inputs_embeds`` with
``requires_grad``, one ``.backward()`` of the explained logit, relevance = (embeddings × gradient)
summed over the hidden size. Two things LXT 2.1 needs under transformers 5, and nothing else:
its package imports its copy of BERT, written against transformers 4 (it fails to import), so a
stand-in module with an empty patch map is put in its place (BERT is not explained here); and its
``patch_attention`` replaces transformers' attention-function registry with a plain dict, which
transformers 5 looks up with ``get_interface``, so the patched functions are put back into the
registry's class.
"""
from __future__ import annotations

import importlib
import json
import os
import sys
import types

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llm_models  # noqa: E402

#: the modeling module LXT patches for each model of llm_models.DECODERS
MODULES = {"llama": "llama", "qwen2": "qwen2", "gemma3": "gemma3", "gpt2": "gpt2"}
#: mixture-of-experts models: (modeling module, class-name prefix); LXT 2.1 has no patch map for them
MOE = {"mixtral": ("mixtral", "Mixtral"), "qwen2_moe": ("qwen2_moe", "Qwen2Moe"),
       "qwen3_moe": ("qwen3_moe", "Qwen3Moe"), "olmoe": ("olmoe", "Olmoe")}


def _import_lxt():
    import transformers.models.bert.modeling_bert as modeling_bert
    stand_in = types.ModuleType("lxt.efficient.models.bert")
    stand_in.modeling_bert, stand_in.attnLRP, stand_in.cp_LRP = modeling_bert, {}, {}
    sys.modules.setdefault("lxt.efficient.models.bert", stand_in)
    from lxt.efficient import monkey_patch
    return monkey_patch


def _moe_patch_map(name: str, module) -> dict:
    """LXT's AttnLRP patches for a MoE family, built from LXT 2.1's own functions the way LXT's
    repository patches Qwen3-MoE (``lxt/efficient/models/qwen3_moe.py``, after 2.1): RMSNorm and
    gated MLPs as for LLaMA, the attention functions wrapped, and each expert's gated product and
    its product with the gate weight given the uniform rule (``divide_gradient``), the activation
    the identity rule; the router is left as it is (its gradient: the softmax rule, and the ε-rule
    of the top-k renormalization). Qwen2-MoE's sigmoid-gated shared expert: the same as a gated MLP."""
    from functools import partial

    from lxt.efficient.patches import (dropout_forward, gated_mlp_forward, patch_attention, patch_method,
                                       rms_norm_forward)
    from lxt.efficient.rules import divide_gradient, identity_rule_implicit
    prefix = MOE[name][1]

    def experts_forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for e in range(self.num_experts):
            token, slot = torch.where(top_k_index == e)
            if token.numel() == 0:
                continue
            gate, up = torch.nn.functional.linear(hidden_states[token], self.gate_up_proj[e]).chunk(2, dim=-1)
            h = divide_gradient(identity_rule_implicit(self.act_fn, gate) * up, 2)
            y = torch.nn.functional.linear(h, self.down_proj[e])
            out.index_add_(0, token, divide_gradient(y * top_k_weights[token, slot, None], 2))
        return out

    def shared_gate_forward(self, hidden_states):
        b, n, d = hidden_states.shape
        x = hidden_states.view(-1, d)
        _, weights, selected = self.gate(x)
        routed = self.experts(x, selected, weights)
        gate = identity_rule_implicit(torch.sigmoid, self.shared_expert_gate(x))
        shared = divide_gradient(gate * self.shared_expert(x), 2)
        return (routed + shared).reshape(b, n, d)

    patches = {getattr(module, f"{prefix}RMSNorm"): partial(patch_method, rms_norm_forward),
               getattr(module, f"{prefix}Experts"): partial(patch_method, experts_forward),
               torch.nn.Dropout: partial(patch_method, dropout_forward), module: patch_attention}
    if hasattr(module, f"{prefix}MLP"):
        patches[getattr(module, f"{prefix}MLP")] = partial(patch_method, gated_mlp_forward)
    if name == "qwen2_moe":
        patches[module.Qwen2MoeSparseMoeBlock] = partial(patch_method, shared_gate_forward)
    return patches


def _patch(name: str) -> None:
    monkey_patch = _import_lxt()
    from transformers.modeling_utils import AttentionInterface
    family = MOE[name][0] if name in MOE else MODULES[name]
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    monkey_patch(module, _moe_patch_map(name, module) if name in MOE else None, verbose=False)
    if not hasattr(module.ALL_ATTENTION_FUNCTIONS, "get_interface"):  # LXT 2.1 leaves a plain dict
        registry = AttentionInterface()
        for key, fn in module.ALL_ATTENTION_FUNCTIONS.items():
            registry[key] = fn
        module.ALL_ATTENTION_FUNCTIONS = registry


def explain(name: str) -> dict:
    """LXT's input relevance of the predicted next token's logit, per sample of llm_models.batch()."""
    _patch(name)
    model = llm_models.build(name)
    for p in model.parameters():
        p.requires_grad_(False)
    x = llm_models.batch()
    emb = model.get_input_embeddings()(x["input_ids"]).detach().requires_grad_(True)
    logits = model(inputs_embeds=emb, attention_mask=x["attention_mask"], use_cache=False).logits[:, -1]
    tokens = logits.argmax(-1)
    explained = logits.gather(1, tokens[:, None]).squeeze(1)
    explained.sum().backward()
    relevance = (emb * emb.grad).sum(-1)
    return {"relevance": relevance.tolist(), "logits": explained.tolist(), "tokens": tokens.tolist()}


def main(names) -> None:
    torch.set_num_threads(1)
    print(json.dumps({name: explain(name) for name in names}))


if __name__ == "__main__":
    main(sys.argv[1:] or list(MODULES) + list(MOE))
