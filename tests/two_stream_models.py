"""Tiny randomly initialised two-stream models (encoder–decoder, co-attention) and their inputs."""
import torch
import transformers as tf


def _seed(seed=0):
    torch.manual_seed(seed)


def bart():
    _seed()
    cfg = tf.BartConfig(vocab_size=64, d_model=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32,
                        attn_implementation="eager")
    return tf.BartForConditionalGeneration(cfg).eval()


def t5():
    _seed()
    cfg = tf.T5Config(vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_decoder_layers=2, num_heads=2,
                      relative_attention_num_buckets=8, decoder_start_token_id=0, attn_implementation="eager")
    return tf.T5ForConditionalGeneration(cfg).eval()


def marian():
    _seed()
    cfg = tf.MarianConfig(vocab_size=64, d_model=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                          decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
                          max_position_embeddings=32, pad_token_id=1, decoder_start_token_id=1,
                          attn_implementation="eager")
    return tf.MarianMTModel(cfg).eval()


def vision_encoder_decoder():
    _seed()
    enc = tf.ViTConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32, image_size=16,
                       patch_size=4, num_channels=3)
    dec = tf.GPT2Config(vocab_size=64, n_embd=16, n_layer=2, n_head=2, n_positions=32, add_cross_attention=True)
    cfg = tf.VisionEncoderDecoderConfig.from_encoder_decoder_configs(enc, dec)
    cfg.decoder_start_token_id, cfg.pad_token_id = 0, 0
    model = tf.VisionEncoderDecoderModel(cfg)
    model.config._attn_implementation = "eager"
    for m in (model.encoder, model.decoder):
        m.config._attn_implementation = "eager"
    return model.eval()


def whisper():
    _seed()
    cfg = tf.WhisperConfig(vocab_size=64, num_mel_bins=8, d_model=16, encoder_layers=2, decoder_layers=2,
                           encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                           decoder_ffn_dim=32, max_source_positions=6, max_target_positions=16, pad_token_id=0,
                           decoder_start_token_id=1, eos_token_id=2, bos_token_id=1, attn_implementation="eager")
    return tf.WhisperForConditionalGeneration(cfg).eval()


def lxmert():
    _seed()
    cfg = tf.LxmertConfig(vocab_size=64, hidden_size=16, num_attention_heads=2, intermediate_size=32, l_layers=1,
                          x_layers=2, r_layers=1, visual_feat_dim=8, visual_pos_dim=4, num_qa_labels=5,
                          num_object_labels=6, num_attr_labels=4, max_position_embeddings=32)
    return tf.LxmertForQuestionAnswering(cfg).eval()


def text_inputs(batch=2, src=7, tgt=5, seed=1):
    g = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(4, 64, (batch, src), generator=g),
            "decoder_input_ids": torch.randint(4, 64, (batch, tgt), generator=g)}


def inputs_for(name, batch=2, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 64, (batch, 5), generator=g)
    if name == "vision_encoder_decoder":
        return {"pixel_values": torch.randn(batch, 3, 16, 16, generator=g), "decoder_input_ids": ids}
    if name == "whisper":
        return {"input_features": torch.randn(batch, 8, 12, generator=g), "decoder_input_ids": ids}
    if name == "lxmert":
        return {"input_ids": torch.randint(4, 64, (batch, 6), generator=g),
                "visual_feats": torch.randn(batch, 4, 8, generator=g),
                "visual_pos": torch.rand(batch, 4, 4, generator=g)}
    return text_inputs(batch, seed=seed)


BUILDERS = {"bart": bart, "t5": t5, "marian": marian, "vision_encoder_decoder": vision_encoder_decoder,
            "whisper": whisper, "lxmert": lxmert}


def last_token_target(outputs):
    """The largest logit at the last position (encoder–decoder) or of the QA head (LXMERT)."""
    logits = outputs.logits if hasattr(outputs, "logits") else outputs.question_answering_score
    if logits.dim() == 3:
        logits = logits[:, -1]
    return logits.max(-1).values
