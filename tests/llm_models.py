"""Tiny random language models of the families people explain with AttnLRP: decoders (LLaMA, Qwen2,
Gemma-3, GPT-2), mixture-of-experts decoders (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, Jamba) and a
state-space model (Mamba), each built from a config (never downloaded) with a fixed seed, so that
two processes build the same weights (``tests/lxt_reference.py`` runs LXT on them in a subprocess).
"""
from __future__ import annotations

import torch
import transformers

VOCAB = 64
#: every token id of :func:`batch` is >= FIRST_ID; the configs keep their special ids below
FIRST_ID = 4
_SPECIAL = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
_DEC = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, **_SPECIAL)
_MOE = dict(num_experts_per_tok=2)


def llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**_DEC))


def qwen2():
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**_DEC))


def gemma3():
    return transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**_DEC, head_dim=8, sliding_window=4))


def gpt2():
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4,
                                                                n_positions=64, **_SPECIAL))


def mixtral():
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(**_DEC, **_MOE, num_local_experts=4))


def qwen2_moe():
    return transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
        **_DEC, **_MOE, num_experts=4, moe_intermediate_size=16, shared_expert_intermediate_size=32))


def qwen3_moe():
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **_DEC, **_MOE, num_experts=4, moe_intermediate_size=16, head_dim=8))


def olmoe():
    return transformers.OlmoeForCausalLM(transformers.OlmoeConfig(**_DEC, **_MOE, num_experts=4))


def jamba():
    cfg = transformers.JambaConfig(**_DEC, **_MOE, num_experts=4, expert_layer_period=2, expert_layer_offset=1,
                                   attn_layer_period=2, attn_layer_offset=1, mamba_d_state=4, mamba_d_conv=3,
                                   mamba_expand=2, mamba_dt_rank=2)
    return transformers.JambaForCausalLM(cfg)


def mamba():
    return transformers.MambaForCausalLM(transformers.MambaConfig(
        vocab_size=VOCAB, hidden_size=16, state_size=4, num_hidden_layers=2, expand=2, conv_kernel=3,
        time_step_rank=2, **_SPECIAL))


DECODERS = {"llama": llama, "qwen2": qwen2, "gemma3": gemma3, "gpt2": gpt2}
MOE = {"mixtral": mixtral, "qwen2_moe": qwen2_moe, "qwen3_moe": qwen3_moe, "olmoe": olmoe}
SSM = {"mamba": mamba, "jamba": jamba}
ALL = {**DECODERS, **MOE, **SSM}


def build(name: str) -> torch.nn.Module:
    """The model ``name`` of :data:`ALL` with the weights of seed 0, in eval mode."""
    torch.manual_seed(0)
    return ALL[name]().eval()


def batch(size: int = 2, length: int = 7, seed: int = 0) -> dict:
    """``size`` sequences of ``length`` ordinary token ids (no padding) and their attention mask."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(FIRST_ID, VOCAB, (size, length), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
