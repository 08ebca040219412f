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
    return transformers.BertForSequenceClassification(_text_cfg(transformers.BertConfig, attn_implementation=attn)).eval()


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
