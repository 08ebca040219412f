"""The fast path segment by segment (``memory="low"``, relprop.engine.fast_low): the input relevance of
``lrp`` under "attnlrp" and "cp_lrp" equals that of the one-backward fast path (the reference,
``memory="default"``) to 1e-5 of its scale, for cores in chunks of 1 and 3 rows and whole
cores (chunks None: then bit for bit), on LLaMA, GPT-2, BERT (padded batches) and a timm ViT; at
512 tokens in chunks of 64 rows; and no tensor of heads x tokens^2 (nor half of one) is formed."""
import pytest
import torch
import transformers
from torch.utils._python_dispatch import TorchDispatchMode

import models
import relprop
from chunking import rows
from budget_checks import relative
from snapshot import assert_same, snapshot

CASES = {
    "hf_llama_eager": lambda: (models.hf_llama("eager"), models.decoder_batch(lengths=(7, 5, 9)), "next_token"),
    "hf_llama_sdpa": lambda: (models.hf_llama("sdpa"), models.decoder_batch(lengths=(9, 6)), "next_token"),
    "hf_gpt2_lm": lambda: (models.hf_gpt2_lm("sdpa"), models.decoder_batch(lengths=(7, 5, 9)), "next_token"),
    "hf_bert_eager": lambda: (models.hf_bert("eager"), models.text_batch(lengths=(7, 5, 9)), None),
    "timm_vit_tiny": lambda: (models.timm_vit_tiny(), models.image_batch(models.timm_vit_tiny()), None),
}


def _relevance(model, batch, target, preset, n, memory="low"):
    exp = relprop.explain(model, batch, target=target, method="lrp", preset=preset, memory=memory, tuning=rows(n))
    assert exp.conservation is None  # the fast path's trace (no itemized ledger)
    return exp.input_relevance


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("preset", ["attnlrp", "cp_lrp"])
def test_segmented_fast_path_equals_the_fast_path(name, preset):
    model, batch, target = CASES[name]()
    ref = _relevance(model, batch, target, preset, 256, memory="default")
    before = snapshot(model)
    assert relative(_relevance(model, batch, target, preset, None), ref) == 0.0  # whole cores
    for n in (1, 3):
        got = _relevance(model, batch, target, preset, n)
        assert got.shape == ref.shape
        assert relative(got, ref) <= 1e-5, (name, preset, n)
    assert_same(before, snapshot(model))


class _Largest(TorchDispatchMode):
    """The largest number of elements of any tensor an op makes."""

    def __init__(self):
        super().__init__()
        self.most = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if torch.is_tensor(t):
                self.most = max(self.most, t.numel())
        return out


def test_512_tokens_in_chunks_of_64_rows():
    """A LLaMA-style decoder at 512 tokens: equal to the fast path with whole cores, and no op makes a
    tensor of half a heads x tokens^2 map or more (the whole-core fast path makes several)."""
    torch.manual_seed(0)
    n, heads = 512, 4
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=heads, num_key_value_heads=2, max_position_embeddings=n,
                                   pad_token_id=0, bos_token_id=1, eos_token_id=2, attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(3, 64, (1, n))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    ref = _relevance(model, batch, 7, "attnlrp", None, memory="default")
    largest = {}
    for memory, chunk in (("default", None), ("low", 64)):
        with _Largest() as seen:
            got = _relevance(model, batch, 7, "attnlrp", chunk, memory=memory)
        largest[memory] = seen.most
        assert relative(got, ref) <= 1e-5, memory
    assert largest["default"] >= heads * n * n
    assert largest["low"] < heads * n * n // 2, largest
