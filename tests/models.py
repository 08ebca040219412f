"""Tiny random models of every family the engine supports (built from configs, never downloaded)."""
from __future__ import annotations

import timm
import torch
import transformers

VOCAB = 64


def _timm(name, fused=None, **kw):
    torch.manual_seed(0)
    m = timm.create_model(name, pretrained=False, num_classes=5, **kw)
    if fused is not None:
        for mod in m.modules():
            if hasattr(mod, "fused_attn"):
                mod.fused_attn = fused
    return m.eval()


def timm_vit_tiny(**kw):
    return _timm("vit_tiny_patch16_224", depth=2, img_size=64, **kw)


def timm_vit_base(fused=True):
    return _timm("vit_base_patch16_224", fused=fused, depth=2, img_size=64)


def timm_deit_small():
    return _timm("deit_small_patch16_224", depth=2, img_size=64)


def timm_deit_tiny_distilled():
    return _timm("deit_tiny_distilled_patch16_224", depth=2, img_size=64)


def _hf_vision_cfg(cls, **kw):
    return cls(image_size=32, patch_size=8, num_channels=3, hidden_size=32, num_hidden_layers=2,
               num_attention_heads=4, intermediate_size=64, num_labels=5, **kw)


def hf_vit(attn="sdpa"):
    torch.manual_seed(0)
    cfg = _hf_vision_cfg(transformers.ViTConfig, attn_implementation=attn)
    return transformers.ViTForImageClassification(cfg).eval()


def hf_deit(attn="sdpa"):
    torch.manual_seed(0)
    cfg = _hf_vision_cfg(transformers.DeiTConfig, attn_implementation=attn)
    return transformers.DeiTForImageClassification(cfg).eval()


def _text_cfg(cls, **kw):
    return cls(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
               intermediate_size=64, num_labels=3, max_position_embeddings=64, **kw)


def hf_bert(attn="eager"):
    torch.manual_seed(0)
    cfg = _text_cfg(transformers.BertConfig, attn_implementation=attn)
    return transformers.BertForSequenceClassification(cfg).eval()


def hf_roberta(attn="eager"):
    torch.manual_seed(0)
    cfg = _text_cfg(transformers.RobertaConfig, attn_implementation=attn, pad_token_id=1)
    return transformers.RobertaForSequenceClassification(cfg).eval()


def hf_distilbert(attn="eager"):
    torch.manual_seed(0)
    cfg = transformers.DistilBertConfig(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, hidden_dim=64,
                                        num_labels=3, max_position_embeddings=64, attn_implementation=attn)
    return transformers.DistilBertForSequenceClassification(cfg).eval()


VISION = {
    "timm_vit_tiny": timm_vit_tiny,
    "timm_vit_base_fused": lambda: timm_vit_base(True),
    "timm_vit_base_unfused": lambda: timm_vit_base(False),
    "timm_deit_small": timm_deit_small,
    "timm_deit_tiny_distilled": timm_deit_tiny_distilled,
    "hf_vit": hf_vit,
    "hf_vit_eager": lambda: hf_vit("eager"),
    "hf_deit": hf_deit,
}

TEXT = {
    "hf_bert_eager": lambda: hf_bert("eager"),
    "hf_bert_sdpa": lambda: hf_bert("sdpa"),
    "hf_roberta": hf_roberta,
    "hf_distilbert": hf_distilbert,
    "hf_distilbert_sdpa": lambda: hf_distilbert("sdpa"),
}


def image_batch(model, batch=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    size = 64 if hasattr(model, "patch_embed") else 32
    return torch.randn(batch, 3, size, size, generator=g)


def text_batch(lengths=(7, 5, 9, 3), seed=0, pad_id=0, first_id=2):
    """Padded token ids + attention mask for texts of the given lengths (right padding)."""
    g = torch.Generator().manual_seed(seed)
    n = max(lengths)
    ids = torch.full((len(lengths), n), pad_id, dtype=torch.long)
    mask = torch.zeros((len(lengths), n), dtype=torch.long)
    for i, L in enumerate(lengths):
        ids[i, :L] = torch.randint(first_id, VOCAB, (L,), generator=g)
        mask[i, :L] = 1
    return {"input_ids": ids, "attention_mask": mask}


# ------------------------------------------------------------------ Swin and CLIP
# Swin: a 32x32 image, patch 4 -> an 8x8 grid, windows of 2x2 tokens, two stages (8x8 then 4x4
# after patch merging), two blocks each (the second one with shifted windows).

def timm_swin(**kw):
    return _timm("swin_tiny_patch4_window7_224", img_size=32, window_size=2, depths=(2, 2), num_heads=(2, 4),
                 embed_dim=16, **kw)


def hf_swin(image_size=32, window_size=2):
    """HF Swin; ``image_size=40, window_size=4`` pads the 10x10 grid of stage 1 to 12x12 and the 5x5
    grid of stage 2 to 8x8 (windows of 4x4 tokens)."""
    torch.manual_seed(0)
    cfg = transformers.SwinConfig(image_size=image_size, patch_size=4, num_channels=3, embed_dim=16, depths=[2, 2],
                                  num_heads=[2, 4], window_size=window_size, mlp_ratio=2.0, num_labels=5)
    return transformers.SwinForImageClassification(cfg).eval()


SWIN = {
    "timm_swin": timm_swin,
    "hf_swin": hf_swin,
    "hf_swin_padded": lambda: hf_swin(40, 4),
}


def swin_images(model, batch=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    size = model.config.image_size if hasattr(model, "config") else model.patch_embed.img_size[0]
    return torch.randn(batch, 3, size, size, generator=g)


#: CLIP's special ids in the tiny text tower (EOS is not 2: HF reads id 2 as the legacy argmax pooling)
CLIP_BOS, CLIP_EOS, CLIP_PAD = 1, 3, 0


def hf_clip():
    torch.manual_seed(0)
    text = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=16, bos_token_id=CLIP_BOS, eos_token_id=CLIP_EOS, pad_token_id=CLIP_PAD)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=32,
                  patch_size=8)
    cfg = transformers.CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)
    return transformers.CLIPModel(cfg).eval()


def clip_texts(lengths=(6, 4, 8), seed=0):
    """[BOS, words..., EOS] right-padded with CLIP_PAD, and the attention mask."""
    g = torch.Generator().manual_seed(seed)
    n = max(lengths)
    ids = torch.full((len(lengths), n), CLIP_PAD, dtype=torch.long)
    mask = torch.zeros((len(lengths), n), dtype=torch.long)
    for i, L in enumerate(lengths):
        ids[i, 0], ids[i, L - 1] = CLIP_BOS, CLIP_EOS
        ids[i, 1:L - 1] = torch.randint(4, VOCAB, (L - 2,), generator=g)
        mask[i, :L] = 1
    return {"input_ids": ids, "attention_mask": mask}


def clip_batch(images=2, lengths=(6, 4, 8), seed=0):
    g = torch.Generator().manual_seed(seed + 1)
    return {**clip_texts(lengths, seed), "pixel_values": torch.randn(images, 3, 32, 32, generator=g)}


# ------------------------------------------------------------------ decoders, other input/patch sizes, register tokens
# Decoders: bos/eos/pad ids below 3, so that the ids of decoder_batch (>= 3) are all ordinary tokens.

def zero_biases(model):
    """The same model with every bias set to 0 (the "bias-free tiny config" of the conservation tests)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.zero_()
    return model


def _gpt2_cfg(attn):
    return transformers.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4, n_inner=64,
                                   num_labels=3, pad_token_id=0, bos_token_id=1, eos_token_id=1,
                                   attn_implementation=attn)


def hf_gpt2_cls(attn="sdpa"):
    torch.manual_seed(0)
    return transformers.GPT2ForSequenceClassification(_gpt2_cfg(attn)).eval()


def hf_gpt2_lm(attn="sdpa"):
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(_gpt2_cfg(attn)).eval()


#: how closely two schedules (whole cores, cores in chunks of rows or keys, segments) of one float64 copy of
#: :func:`hf_llama` can agree, relative to the largest value: LLaMA computes its RMSNorm and its eager softmax
#: (and so that softmax's backward) in float32 whatever the model's dtype, and float32 kernels round by the
#: tensor's shape on some CPUs (AVX2: 1e-8 to 3e-7 between 1-row chunks and whole cores, against 4e-17 with
#: ATEN_CPU_CAPABILITY=default); the other tiny models compute in float64 throughout and agree to 1e-9
LLAMA_FLOAT64_AGREEMENT = 1e-6


def hf_llama(attn="sdpa"):
    """LLaMA-style: RMSNorm, rotary embeddings, gated SiLU MLP, grouped-query attention, no biases."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   pad_token_id=0, bos_token_id=1, eos_token_id=2, attn_implementation=attn)
    return transformers.LlamaForCausalLM(cfg).eval()


DECODERS = {
    "hf_gpt2_cls": hf_gpt2_cls,
    "hf_gpt2_cls_eager": lambda: hf_gpt2_cls("eager"),
    "hf_gpt2_lm": hf_gpt2_lm,
    "hf_llama": hf_llama,
    "hf_llama_eager": lambda: hf_llama("eager"),
}


def decoder_batch(lengths=(7, 5, 9, 3), seed=0):
    """Right-padded token ids (pad 0, ordinary ids >= 3) and the attention mask."""
    return text_batch(lengths, seed=seed, pad_id=0, first_id=3)


# Vision models at other input and patch sizes, and with register tokens: nothing may assume 14x14.

def timm_vit_384_patch32():
    """384x384 input, patch 32: a 12x12 grid."""
    return _timm("vit_base_patch32_384", depth=2, embed_dim=48, num_heads=3)


def timm_vit_rectangular():
    """96x64 input, patch 16: a 6x4 grid (not square)."""
    return _timm("vit_tiny_patch16_224", depth=2, img_size=(96, 64), embed_dim=48, num_heads=3)


def timm_dinov2_reg4():
    """Class token + 4 register tokens, patch 14 on 56x56: a 4x4 grid, LayerScale."""
    return _timm("vit_small_patch14_reg4_dinov2", depth=2, img_size=56, embed_dim=48, num_heads=3)


def timm_vit_reg4_gap():
    """4 register tokens and no class token; the head averages the patch tokens (registers excluded)."""
    return _timm("vit_base_patch16_reg4_gap_256", depth=2, img_size=64, embed_dim=48, num_heads=3)


def hf_vit_patch32():
    """HF ViT on 96x96 with patch 32: a 3x3 grid."""
    torch.manual_seed(0)
    cfg = transformers.ViTConfig(image_size=96, patch_size=32, num_channels=3, hidden_size=32, num_hidden_layers=2,
                                 num_attention_heads=4, intermediate_size=64, num_labels=5)
    return transformers.ViTForImageClassification(cfg).eval()


def hf_dinov2_registers():
    """HF DINOv2 with 4 registers; its head reads the class token and the mean of the patch tokens."""
    torch.manual_seed(0)
    cfg = transformers.Dinov2WithRegistersConfig(image_size=28, patch_size=7, hidden_size=32, num_hidden_layers=2,
                                                 num_attention_heads=4, mlp_ratio=2, num_labels=5,
                                                 num_register_tokens=4)
    return transformers.Dinov2WithRegistersForImageClassification(cfg).eval()


SIZES = {
    "timm_vit_384_patch32": timm_vit_384_patch32,
    "timm_vit_rectangular": timm_vit_rectangular,
    "timm_dinov2_reg4": timm_dinov2_reg4,
    "timm_vit_reg4_gap": timm_vit_reg4_gap,
    "hf_vit_patch32": hf_vit_patch32,
    "hf_dinov2_registers": hf_dinov2_registers,
}


def input_size(model):
    """(height, width) of the images a vision model of the zoo was built for."""
    if hasattr(model, "patch_embed"):
        return tuple(model.patch_embed.img_size)
    size = model.config.image_size
    return (size, size) if isinstance(size, int) else tuple(size)


def sized_images(model, batch=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 3, *input_size(model), generator=g)


class Exp(torch.nn.Module):
    """``torch.exp`` as a module: an op no built-in preset has a rule for."""

    def forward(self, x):
        return torch.exp(x)


class UnruledOp(torch.nn.Module):
    """A linear layer, then ``Exp`` (module path ``inner.1``, no rule), then a linear head."""

    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Sequential(torch.nn.Linear(4, 4), Exp())
        self.head = torch.nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.inner(x))
