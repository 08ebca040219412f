"""Tiny random configs of the zoo's newer architectures (issue 27): latent, pooling, sparse, hierarchical,
audio, video, mixture-of-experts and state-space models, with their inputs. ``tests/zoo.py`` makes
their entries; nothing here is downloaded."""
from __future__ import annotations

import torch
import transformers

import models

V = models.VOCAB


def _seeded(cls, cfg):
    torch.manual_seed(0)
    return cls(cfg).eval()


def perceiver_text():
    """Perceiver with its text preprocessor: byte/token ids under the name ``inputs``."""
    cfg = transformers.PerceiverConfig(num_latents=8, d_latents=32, d_model=32, num_blocks=1,
                                       num_self_attends_per_block=2, num_self_attention_heads=4,
                                       num_cross_attention_heads=1, vocab_size=V, max_position_embeddings=16,
                                       num_labels=3)
    return _seeded(transformers.PerceiverForSequenceClassification, cfg)


def perceiver_text_inputs(model, batch=2, seed=0):
    x = models.text_batch((6, 4, 5)[:batch], seed=seed, first_id=4)
    return {"inputs": x["input_ids"], "attention_mask": x["attention_mask"]}


def perceiver_image():
    """Perceiver with learned position encodings on 16x16 float pixels (one token per pixel)."""
    cfg = transformers.PerceiverConfig(num_latents=8, d_latents=32, d_model=32, num_blocks=1,
                                       num_self_attends_per_block=2, num_self_attention_heads=4,
                                       num_cross_attention_heads=1, image_size=16, num_labels=3)
    return _seeded(transformers.PerceiverForImageClassificationLearned, cfg)


def funnel():
    cfg = transformers.FunnelConfig(vocab_size=V, block_sizes=[1, 1], d_model=32, n_head=4, d_head=8, d_inner=64,
                                    num_labels=3, num_decoder_layers=1)
    return _seeded(transformers.FunnelForSequenceClassification, cfg)


def longformer():
    cfg = transformers.LongformerConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                        intermediate_size=64, attention_window=[4, 4], max_position_embeddings=64,
                                        num_labels=3, pad_token_id=1, sep_token_id=2, bos_token_id=0, eos_token_id=2)
    return _seeded(transformers.LongformerForSequenceClassification, cfg)


def bigbird():
    """BigBird with block-sparse attention: 24 tokens in blocks of 2 (the block-sparse path needs at least
    (5 + 2 * random blocks) blocks)."""
    cfg = transformers.BigBirdConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, attention_type="block_sparse", block_size=2,
                                     num_random_blocks=1, max_position_embeddings=64, num_labels=3, sep_token_id=3,
                                     pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return _seeded(transformers.BigBirdForSequenceClassification, cfg)


def bigbird_inputs(model, batch=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, V, (batch, 24), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _hierarchical(cls, cfg_cls, **kw):
    cfg = cfg_cls(num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[16, 32],
                  num_attention_heads=[1, 2], mlp_ratios=[2, 2], num_labels=3, patch_sizes=[7, 3], strides=[4, 2],
                  **kw)
    return _seeded(cls, cfg)


def segformer():
    """SegFormer: spatial-reduction attention (keys downsampled by sr_ratio), Mix-FFN's depth-wise conv."""
    return _hierarchical(transformers.SegformerForImageClassification, transformers.SegformerConfig,
                         decoder_hidden_size=32)


def pvt_v2():
    return _hierarchical(transformers.PvtV2ForImageClassification, transformers.PvtV2Config)


def wav2vec2():
    """Wav2Vec2 read by mean pooling over the frames; its attention mask makes it write zeros into the
    padded frames with a boolean mask (index_put)."""
    cfg = transformers.Wav2Vec2Config(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=64, conv_dim=(16, 16), conv_stride=(5, 2),
                                      conv_kernel=(10, 3), num_conv_pos_embeddings=8,
                                      num_conv_pos_embedding_groups=4, num_labels=3, feat_extract_norm="layer",
                                      do_stable_layer_norm=True)
    return _seeded(transformers.Wav2Vec2ForSequenceClassification, cfg)


def audio_inputs(model, batch=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 400, generator=g)
    mask = torch.ones(batch, 400, dtype=torch.long)
    return {"input_values": x, "attention_mask": mask}


def videomae():
    cfg = transformers.VideoMAEConfig(image_size=16, patch_size=8, num_channels=3, num_frames=4, tubelet_size=2,
                                      hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=64, num_labels=3, use_mean_pooling=True)
    return _seeded(transformers.VideoMAEForVideoClassification, cfg)


def video_inputs(model, batch=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 4, 3, 16, 16, generator=g)


def mixtral():
    cfg = transformers.MixtralConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=64)
    return _seeded(transformers.MixtralForCausalLM, cfg)


def mamba():
    cfg = transformers.MambaConfig(vocab_size=V, hidden_size=32, state_size=4, num_hidden_layers=2, expand=2,
                                   conv_kernel=3)
    return _seeded(transformers.MambaForCausalLM, cfg)


def ids_only(model, batch=2, seed=0):
    """Unpadded ids (a state-space model takes no attention mask)."""
    x = models.text_batch((6, 6, 6)[:batch], seed=seed, first_id=4)
    return {"input_ids": x["input_ids"], "attention_mask": x["attention_mask"]}
