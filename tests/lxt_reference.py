"""AttnLRP computed by its authors' library, LXT (``pip install lxt``), on the tiny models of
``tests/llm_models.py``: the reference of ``tests/test_lxt_agreement.py``.

Run as a script in a process of its own (LXT patches transformers' classes for the whole process)::

    python tests/lxt_reference.py llama qwen2 gemma3 gpt2

prints one JSON object {model: {"relevance": [[...], ...], "logits": [...], "tokens": [...]}}: per
sample, the input relevance of the logit of the predicted next token at the last position.

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


def _import_lxt():
    import transformers.models.bert.modeling_bert as modeling_bert
    stand_in = types.ModuleType("lxt.efficient.models.bert")
    stand_in.modeling_bert, stand_in.attnLRP, stand_in.cp_LRP = modeling_bert, {}, {}
    sys.modules.setdefault("lxt.efficient.models.bert", stand_in)
    from lxt.efficient import monkey_patch
    return monkey_patch


def _patch(name: str) -> None:
    monkey_patch = _import_lxt()
    from transformers.modeling_utils import AttentionInterface
    module = importlib.import_module(f"transformers.models.{MODULES[name]}.modeling_{MODULES[name]}")
    monkey_patch(module, verbose=False)
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
    main(sys.argv[1:] or list(MODULES))
