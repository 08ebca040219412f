"""The model zoo of ``tests/test_zoo.py`` and ``benchmarks/zoo_report.py``: architectures people load
from HuggingFace ``transformers`` and ``timm``, each built from a tiny random config (never
downloaded), with its inputs, a default target and how its head reads the token states.

Every entry is an :class:`Entry`. ``reads`` says, in words, which token states of the last
self-attention block the head reads (the query of the rollout-style methods is the uniform mean
over them; ``tests/test_zoo.py`` finds them independently, from gradients of the target).
``FAST`` names the representative subset that runs by default; the rest of the zoo is marked slow.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Optional, Tuple, Union

import timm
import torch
import transformers

import models
import zoo_models as zm

VOCAB = models.VOCAB
#: every ordinary token id of the zoo's texts is >= FIRST_ID; the configs keep their special ids below
FIRST_ID = 4


@dataclasses.dataclass(frozen=True)
class Entry:
    name: str
    tags: Tuple[str, ...]  # family and class tags: "text", "vision", "decoder", "timm", "hf", "hierarchical", ...
    build: Callable[[], torch.nn.Module]
    #: inputs(model, batch, seed) -> what the model's forward takes (a tensor or a dict of tensors)
    inputs: Callable[..., Any]
    #: an int class, "next_token" (language models) or a callable outputs -> [batch] scores
    target: Union[int, str, Callable]
    reads: str  # how the head reads the tokens (class token / mean pool / last token / attention pooling ...)
    wrt: Optional[str] = None  # the explained input, when the model takes several (CLIP)
    #: the patch grid (rows, cols) the image scores must be on (None: not checked, e.g. conv stems)
    grid: Optional[Tuple[int, int]] = None
    #: other inputs that permute the tokens differently (ViTMAE's noise): shuffled(model, inputs, seed)
    shuffled: Optional[Callable[..., Any]] = None
    #: how many token-to-token self-attention blocks (square attention maps) the model has: a rollout
    #: must include every one of them (None: not checked)
    attention_blocks: Optional[int] = 2
    #: modules whose output token states the head's query may be read from, besides the layer of the last
    #: block relprop records; the test takes the first whose token count is exp.matrix's row count. CaiT and
    #: XCiT: the last self-attention block (patch tokens only; its class-attention blocks output the class
    #: token alone) or the final norm ([class token, patches] after the class-attention blocks)
    query_layers: Tuple[str, ...] = ()
    notes: str = ""
    #: where a refusal is the right answer, what it must say: (methods, regex) pairs; a refusal of a method
    #: matching ``methods`` (a regex over the zoo's method names) must match ``regex`` (the true reason), and
    #: a refusal of a method no pair names fails the cell (the model was explained before: a regression)
    refusals: Tuple[Tuple[str, str], ...] = ()
    #: the batch check's tolerance where it is not zoo_checks.BATCH_TOL (measured float32 error, see the entry)
    batch_tol: Optional[float] = None

    @property
    def modality(self) -> str:
        return "text" if "text" in self.tags else "vision"


def _seeded(fn):
    def build():
        torch.manual_seed(0)
        return fn().eval()
    build.__name__ = getattr(fn, "__name__", "build")
    return build


# ------------------------------------------------------------------ inputs

LENGTHS = (6, 4, 5)


def texts(pad_id=0):
    """Right-padded texts of lengths LENGTHS[:batch] (ordinary ids >= FIRST_ID) and the mask."""
    def make(model, batch=2, seed=0):
        return models.text_batch(LENGTHS[:batch], seed=seed, pad_id=pad_id, first_id=FIRST_ID)
    return make


def left_padded_texts(pad_id=0):
    """The texts of :func:`texts`, padded on the left (XLNet's tokenizer's side: its head reads the last
    position)."""
    right = texts(pad_id)

    def make(model, batch=2, seed=0):
        x = right(model, batch, seed)
        ids, mask = x["input_ids"].clone(), x["attention_mask"].clone()
        for b in range(ids.shape[0]):
            n = int(mask[b].sum())
            ids[b] = torch.cat([ids[b, n:], ids[b, :n]])
            mask[b] = torch.cat([mask[b, n:], mask[b, :n]])
        return {**x, "input_ids": ids, "attention_mask": mask}
    return make


def images(size):
    h, w = (size, size) if isinstance(size, int) else size

    def make(model, batch=2, seed=0):
        g = torch.Generator().manual_seed(seed)
        return torch.randn(batch, 3, h, w, generator=g)
    return make


def mae_images(size, patches):
    """ViTMAE: pixels and the shuffle noise; ``noise = arange`` keeps the patch order (identity)."""
    def make(model, batch=2, seed=0):
        g = torch.Generator().manual_seed(seed)
        return {"pixel_values": torch.randn(batch, 3, size, size, generator=g),
                "noise": torch.arange(patches, dtype=torch.float32).repeat(batch, 1)}
    return make


def mae_shuffled(model, inputs, seed):
    """The same pixels with another random shuffle of the patches."""
    noise = inputs["noise"]
    g = torch.Generator().manual_seed(1000 + seed)
    return {**inputs, "noise": torch.rand(noise.shape, generator=g)}


def clip_inputs(tower):
    """CLIP: images and texts in different numbers (the explained tower's batch is the one sliced per
    sample): ``batch`` images and 3 texts for the image tower, 1 image and ``batch`` texts for the text tower."""
    def make(model, batch=2, seed=0):
        if tower == "image":
            return models.clip_batch(images=batch, lengths=(6, 4, 8), seed=seed)
        return models.clip_batch(images=1, lengths=(6, 4, 8)[:batch], seed=seed)
    return make


# ------------------------------------------------------------------ targets of models without a class head

def clip_image_target(o):
    """The image's similarity to text 1."""
    return o.logits_per_image[:, 1]


def clip_text_target(o):
    """The text's similarity to image 0."""
    return o.logits_per_text[:, 0]


def pooled_target(o):
    """A fixed linear read-out of the pooled embedding (the sum of its first 8 features)."""
    return o.pooler_output[:, :8].sum(-1)


def class_token_target(o):
    """A fixed linear read-out of the final class-token state (the sum of its first 8 features)."""
    return o.last_hidden_state[:, 0, :8].sum(-1)


# ------------------------------------------------------------------ HF text encoders

def _text(cfg_cls, model_cls, **kw):
    @_seeded
    def build():
        return model_cls(models._text_cfg(cfg_cls, attn_implementation="eager", **kw))
    return build


def hf_xlnet():
    """XLNet permutes input_ids to [tokens, batch] before its lookup (relprop.graph.id_lookups)."""
    cfg = transformers.XLNetConfig(vocab_size=VOCAB, d_model=32, n_layer=2, n_head=4, d_inner=64, pad_token_id=0,
                                   bos_token_id=1, eos_token_id=2)
    return transformers.XLNetForSequenceClassification(cfg)


def hf_llama4_text(no_rope_layers=(1, 1)):
    """Llama 4's text model: rotary embeddings computed in complex numbers (relprop.graph.complex_values);
    ``no_rope_layers`` 1 where a layer rotates (the default: every layer)."""
    cfg = transformers.Llama4TextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, intermediate_size_mlp=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=2, num_experts_per_tok=1,
        interleave_moe_layer_step=1, moe_layers=[], no_rope_layers=list(no_rope_layers), attention_chunk_size=16,
        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return transformers.Llama4ForCausalLM(cfg)


class TorchEncoder(torch.nn.Module):
    """A text classifier on ``torch.nn.TransformerEncoderLayer`` (``layer=True``) or ``torch.nn.MultiheadAttention``
    (``layer=False``), sequence-major ([tokens, batch, features]: MultiheadAttention's rows t·B + b), biases
    drawn non-zero, mean-pooled over the tokens."""

    def __init__(self, layer: bool = True):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, 32)
        self.layer = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0) if layer else \
            torch.nn.MultiheadAttention(32, 4)
        self.head = torch.nn.Linear(32, 3)
        with torch.no_grad():
            for p in self.parameters():
                if p.dim() == 1:
                    p.normal_(0.0, 0.5)

    def forward(self, input_ids, attention_mask=None):
        h = self.emb(input_ids).transpose(0, 1)
        pad = None if attention_mask is None else attention_mask == 0
        if isinstance(self.layer, torch.nn.MultiheadAttention):
            h = h + self.layer(h, h, h, key_padding_mask=pad, need_weights=False)[0]
        else:
            h = self.layer(h, src_key_padding_mask=pad)
        keep = (1.0 - pad.float()).transpose(0, 1)[..., None] if pad is not None else torch.ones_like(h[..., :1])
        return self.head((h * keep).sum(0) / keep.sum(0))


def hf_albert():
    cfg = transformers.AlbertConfig(vocab_size=VOCAB, embedding_size=16, hidden_size=32, num_hidden_layers=2,
                                    num_attention_heads=4, intermediate_size=64, num_labels=3,
                                    max_position_embeddings=64, pad_token_id=0, bos_token_id=2, eos_token_id=3,
                                    attn_implementation="eager")
    return transformers.AlbertForSequenceClassification(cfg)


def hf_deberta_v2():
    cfg = transformers.DebertaV2Config(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                       intermediate_size=64, num_labels=3, max_position_embeddings=64,
                                       relative_attention=True, pos_att_type=["p2c", "c2p"], max_relative_positions=16,
                                       position_biased_input=False, pad_token_id=0)
    return transformers.DebertaV2ForSequenceClassification(cfg)


def hf_mpnet():
    cfg = transformers.MPNetConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   intermediate_size=64, num_labels=3, max_position_embeddings=64,
                                   pad_token_id=1, bos_token_id=0, eos_token_id=2)
    return transformers.MPNetForSequenceClassification(cfg)


def hf_modernbert():
    cfg = transformers.ModernBertConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, max_position_embeddings=64, local_attention=4,
                                        pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1,
                                        sep_token_id=2, classifier_pooling="mean", num_labels=3,
                                        attn_implementation="eager")
    return transformers.ModernBertForSequenceClassification(cfg)


# ------------------------------------------------------------------ HF causal decoders (special ids < FIRST_ID)

_DEC = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2, attn_implementation="sdpa")


def hf_mistral():
    cfg = transformers.MistralConfig(**_DEC, num_key_value_heads=2, sliding_window=4)
    return transformers.MistralForCausalLM(cfg)


def hf_qwen2():
    cfg = transformers.Qwen2Config(**_DEC, num_key_value_heads=2)
    return transformers.Qwen2ForCausalLM(cfg)


def hf_gpt_neox():
    cfg = transformers.GPTNeoXConfig(**_DEC, use_parallel_residual=True)
    return transformers.GPTNeoXForCausalLM(cfg)


def hf_opt():
    cfg = transformers.OPTConfig(vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                                 num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=32,
                                 pad_token_id=0, bos_token_id=1, eos_token_id=2, attn_implementation="sdpa")
    return transformers.OPTForCausalLM(cfg)


def hf_phi():
    cfg = transformers.PhiConfig(**_DEC)
    return transformers.PhiForCausalLM(cfg)


def hf_falcon():
    cfg = transformers.FalconConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                    new_decoder_architecture=False, multi_query=True, parallel_attn=True, bias=False,
                                    alibi=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                    attn_implementation="sdpa")
    return transformers.FalconForCausalLM(cfg)


# ------------------------------------------------------------------ timm vision transformers

def _timm(name, **kw):
    torch.manual_seed(0)
    return timm.create_model(name, pretrained=False, num_classes=5, **kw).eval()


def timm_vit_gap():
    """ViT without a class token, head on the mean of the patch tokens."""
    return _timm("vit_tiny_patch16_224", img_size=64, depth=2, embed_dim=32, num_heads=4, class_token=False,
                 global_pool="avg")


def timm_vit_relpos():
    return _timm("vit_relpos_base_patch16_224", img_size=64, depth=2, embed_dim=32, num_heads=4)


def timm_beit():
    return _timm("beit_base_patch16_224", img_size=64, depth=2, embed_dim=32, num_heads=4)


def timm_eva02():
    return _timm("eva02_tiny_patch14_224", img_size=56, depth=2, embed_dim=32, num_heads=4)


def timm_cait():
    return _timm("cait_xxs24_224", img_size=64, depth=2, depth_token_only=1, embed_dim=32, num_heads=4)


def timm_xcit():
    return _timm("xcit_nano_12_p16_224", img_size=64, depth=2, embed_dim=32, num_heads=4, cls_attn_layers=1)


def timm_pit():
    return _timm("pit_ti_224", img_size=64, base_dims=[8, 8, 8], depth=[1, 1, 1], heads=[2, 2, 2])


def timm_levit():
    return _timm("levit_128s", img_size=128, embed_dim=(16, 32, 48), key_dim=8, depth=(1, 1, 1), num_heads=(2, 2, 2))


def timm_maxvit():
    from timm.models import maxxvit
    cfg = maxxvit.MaxxVitCfg(embed_dim=(16, 32), depths=(1, 1), block_type=("M", "M"), stem_width=(8, 16),
                             **maxxvit._rw_max_cfg(dim_head=8))
    torch.manual_seed(0)
    return maxxvit.MaxxVit(cfg, img_size=64, num_classes=5).eval()


def timm_mobilevit():
    from timm.models import byobnet, mobilevit
    cfg = byobnet.ByoModelCfg(
        blocks=(mobilevit._inverted_residual_block(d=1, c=8, s=1, br=2.0),
                mobilevit._mobilevit_block(d=1, c=16, s=2, transformer_dim=16, transformer_depth=2, patch_size=2,
                                           br=2.0)),
        stem_chs=8, stem_type="3x3", stem_pool="", downsample="", act_layer="silu", num_features=32)
    torch.manual_seed(0)
    return byobnet.ByobNet(cfg, num_classes=5, img_size=64).eval()


def timm_efficientformer():
    """Its attention biases are fixed to a 7x7 grid at the last stage: 224x224 input (tiny widths)."""
    return _timm("efficientformer_l1", depths=(1, 1, 1, 2), embed_dims=(8, 8, 16, 16), num_vit=1)


def timm_mvitv2():
    """MViTv2: pooled attention (queries and keys pooled by strided convs) whose relative-position term is
    added to the scores by a slice assignment (exported as aten.copy + slice_scatter)."""
    from timm.models import mvitv2
    torch.manual_seed(0)
    cfg = mvitv2.MultiScaleVitCfg(depths=(1, 1, 1, 1), embed_dim=16, num_heads=1)
    return mvitv2.MultiScaleVit(cfg, img_size=(64, 64), num_classes=8).eval()


def timm_davit():
    """DaViT: window attention and channel attention (a softmax over each head's channels) on [B, C, H, W]
    stages, conv downsampling between them."""
    torch.manual_seed(0)
    return timm.create_model("davit_tiny", depths=(1, 1), embed_dims=(16, 32), num_heads=(1, 2), num_classes=8,
                             window_size=4).eval()


def hf_whisper_audio():
    """Whisper's encoder with a classification head: log-mel features [batch, mel, frames] read channels-first
    by a convolution, a stride-2 convolution in front of the blocks."""
    cfg = transformers.WhisperConfig(vocab_size=VOCAB, num_mel_bins=8, d_model=16, encoder_layers=2,
                                     encoder_attention_heads=2, decoder_layers=1, decoder_attention_heads=2,
                                     encoder_ffn_dim=32, decoder_ffn_dim=32, max_source_positions=8, num_labels=3,
                                     pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
    return transformers.WhisperForAudioClassification(cfg)


def hf_detr():
    """DETR: a ResNet backbone's channels-first features flattened into the encoder's tokens, object queries
    in the decoder."""
    backbone = transformers.ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                                         out_features=["stage2"])
    cfg = transformers.DetrConfig(use_timm_backbone=False, use_pretrained_backbone=False, backbone=None,
                                  backbone_config=backbone, d_model=16, encoder_layers=1, decoder_layers=1,
                                  encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                                  decoder_ffn_dim=32, num_queries=4, num_labels=3)
    return transformers.DetrForObjectDetection(cfg)


def detr_query_target(o):
    """Object query 0's logit of class 1."""
    return o.logits[:, 0, 1]


def mel_features(model, batch=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"input_features": torch.randn(batch, 8, 16, generator=g)}


# ------------------------------------------------------------------ HF vision

def hf_beit():
    cfg = models._hf_vision_cfg(transformers.BeitConfig, use_mean_pooling=True, use_relative_position_bias=True,
                                use_absolute_position_embeddings=False)
    return transformers.BeitForImageClassification(cfg)


def hf_dinov2():
    cfg = transformers.Dinov2Config(image_size=28, patch_size=7, hidden_size=32, num_hidden_layers=2,
                                    num_attention_heads=4, mlp_ratio=2, num_labels=5)
    return transformers.Dinov2ForImageClassification(cfg)


def hf_vitmae():
    cfg = transformers.ViTMAEConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2,
                                    num_attention_heads=4, intermediate_size=64, mask_ratio=0.0)
    return transformers.ViTMAEModel(cfg)


def hf_siglip_vision():
    cfg = transformers.SiglipVisionConfig(image_size=32, patch_size=8, hidden_size=32, intermediate_size=64,
                                          num_hidden_layers=2, num_attention_heads=4, vision_use_head=True,
                                          attn_implementation="eager")
    return transformers.SiglipVisionModel(cfg)


# ------------------------------------------------------------------ the zoo

CLS = "class token (row 0)"
MEAN = "mean of the patch tokens (no class token)"

_ROLLOUTS = "transformer_attribution|rollout|gradient_rollout"
#: the rollouts' true reason on models whose attention maps tokens to fewer or other queries
_FEWER_QUERIES = (_ROLLOUTS, r"maps \d+ tokens to \d+ queries")
#: ... whose blocks see different token counts with no merging relprop can follow (token pooling)
_OTHER_COUNTS = (_ROLLOUTS, r"has \d+ tokens while block .* has \d+")
#: ... whose attention runs within groups of tokens folded into the batch axis (windows, unfolded patches)
_GROUPED = (_ROLLOUTS, r"attention within \d+ groups of tokens")

_ENTRIES = [
    # ---- text encoders (eager attention unless said otherwise)
    Entry("bert", ("text", "encoder", "hf"), _seeded(lambda: models.hf_bert("eager")), texts(), 1,
          "[CLS] (position 0) through the pooler"),
    Entry("roberta", ("text", "encoder", "hf"), _seeded(models.hf_roberta), texts(pad_id=1), 1,
          "<s> (position 0) in the classification head"),
    Entry("distilbert", ("text", "encoder", "hf"), _seeded(models.hf_distilbert), texts(), 1,
          "position 0 (pre_classifier on hidden[:, 0])"),
    Entry("albert", ("text", "encoder", "hf"), _seeded(hf_albert), texts(), 1,
          "[CLS] (position 0) through the pooler; one layer's weights shared by both blocks"),
    Entry("xlnet", ("text", "encoder", "hf", "permuted-ids"), _seeded(hf_xlnet), left_padded_texts(), 1,
          "the last position (sequence summary 'last'); ids permuted to [tokens, batch] before the lookup"),
    Entry("torch_encoder_layer", ("text", "encoder", "torch", "sequence-major"), _seeded(TorchEncoder), texts(), 1,
          "mean of the real tokens; torch.nn.TransformerEncoderLayer on [tokens, batch, features]",
          attention_blocks=1),
    Entry("torch_mha", ("text", "encoder", "torch", "sequence-major"), _seeded(lambda: TorchEncoder(False)), texts(), 1,
          "mean of the real tokens; torch.nn.MultiheadAttention on [tokens, batch, features]", attention_blocks=1),
    Entry("electra", ("text", "encoder", "hf"), _text(transformers.ElectraConfig,
                                                      transformers.ElectraForSequenceClassification,
                                                      embedding_size=16), texts(), 1,
          "position 0 in the classification head; embedding projection 16 -> 32"),
    Entry("deberta_v2", ("text", "encoder", "hf", "disentangled"), _seeded(hf_deberta_v2), texts(), 1,
          "position 0 through the ContextPooler; attention stored as [batch*heads, T, T], relative c2p/p2c terms"),
    Entry("mpnet", ("text", "encoder", "hf"), _seeded(hf_mpnet), texts(pad_id=1), 1,
          "position 0 in the classification head; relative position bias"),
    Entry("xlm_roberta", ("text", "encoder", "hf"), _text(transformers.XLMRobertaConfig,
                                                          transformers.XLMRobertaForSequenceClassification,
                                                          pad_token_id=1, bos_token_id=0, eos_token_id=2),
          texts(pad_id=1), 1, "<s> (position 0) in the classification head"),
    Entry("modernbert", ("text", "encoder", "hf", "mean-pool"), _seeded(hf_modernbert), texts(), 1,
          "mean of the real (non-padding) tokens (classifier_pooling='mean'); local/global attention, rotary"),
    # ---- causal decoders
    Entry("gpt2_lm", ("text", "decoder", "hf"), _seeded(models.hf_gpt2_lm), texts(), "next_token",
          "the last real position (next-token logit)"),
    Entry("gpt2_cls", ("text", "decoder", "hf"), _seeded(models.hf_gpt2_cls), texts(), 1,
          "the last non-padding position (GPT2ForSequenceClassification)"),
    Entry("llama", ("text", "decoder", "hf"), _seeded(models.hf_llama), texts(), "next_token",
          "the last real position (next-token logit); RMSNorm, rotary, GQA",
          # with 2 threads (pytest -n 0) transformer_attribution's batch and a sample alone differ by up to 1.6e-5
          # of the largest score; in float64 by 7e-16 (float32 rounding; measured), so 1e-4
          batch_tol=1e-4),
    Entry("llama4_text", ("text", "decoder", "hf", "complex"), _seeded(hf_llama4_text), texts(), "next_token",
          "the last real position; complex rotary embeddings in every layer"),
    Entry("llama4_text_mixed", ("text", "decoder", "hf", "complex"), _seeded(lambda: hf_llama4_text((0, 1))),
          texts(), "next_token", "the last real position; complex rotary embeddings in the second layer only"),
    Entry("mistral", ("text", "decoder", "hf"), _seeded(hf_mistral), texts(), "next_token",
          "the last real position; sliding window of 4"),
    Entry("qwen2", ("text", "decoder", "hf"), _seeded(hf_qwen2), texts(), "next_token",
          "the last real position; q/k/v biases"),
    Entry("gpt_neox", ("text", "decoder", "hf"), _seeded(hf_gpt_neox), texts(), "next_token",
          "the last real position; parallel residual, partial rotary"),
    Entry("opt", ("text", "decoder", "hf"), _seeded(hf_opt), texts(), "next_token",
          "the last real position; learned positions from the mask's cumulative sum"),
    Entry("phi", ("text", "decoder", "hf"), _seeded(hf_phi), texts(), "next_token",
          "the last real position; parallel attention + MLP, partial rotary"),
    Entry("falcon", ("text", "decoder", "hf"), _seeded(hf_falcon), texts(), "next_token",
          "the last real position; multi-query attention, parallel attention + MLP"),
    # ---- timm vision transformers
    Entry("timm_vit", ("vision", "timm", "vit"), lambda: models.timm_vit_tiny(), images(64), 1, CLS, grid=(4, 4)),
    Entry("timm_vit_gap", ("vision", "timm", "vit", "mean-pool"), timm_vit_gap, images(64), 1, MEAN, grid=(4, 4)),
    Entry("timm_vit_relpos", ("vision", "timm", "vit", "mean-pool"), timm_vit_relpos, images(64), 1,
          MEAN + "; relative position MLP bias", grid=(4, 4)),
    Entry("timm_deit_distilled", ("vision", "timm", "vit"), models.timm_deit_tiny_distilled, images(64), 1,
          "class token and distillation token (rows 0 and 1), the two heads averaged", grid=(4, 4)),
    Entry("timm_beit", ("vision", "timm", "vit", "mean-pool"), timm_beit, images(64), 1,
          "mean of the patch tokens (class token excluded); relative position bias", grid=(4, 4)),
    Entry("timm_eva02", ("vision", "timm", "vit", "mean-pool"), timm_eva02, images(56), 1,
          "mean of the patch tokens (class token excluded); rotary position embedding, SwiGLU", grid=(4, 4)),
    Entry("timm_cait", ("vision", "timm", "vit", "class-attention"), timm_cait, images(64), 1,
          "class-attention blocks (a class token added after the talking-heads self-attention blocks) read "
          "every patch token", grid=(4, 4), query_layers=("blocks.1", "norm"), refusals=(_FEWER_QUERIES,)),
    Entry("timm_xcit", ("vision", "timm", "channel-attention", "class-attention"), timm_xcit, images(64), 1,
          "class-attention blocks read every patch token; cross-covariance (channel) attention, conv stem "
          "with BatchNorm", grid=(4, 4), attention_blocks=None, query_layers=("blocks.1", "norm"),
          refusals=(_FEWER_QUERIES,)),
    Entry("timm_vit_reg", ("vision", "timm", "vit", "registers"), models.timm_dinov2_reg4, images(56), 1,
          "class token (row 0); 4 register tokens (rows 1-4)", grid=(4, 4)),
    Entry("timm_swin", ("vision", "timm", "windows", "hierarchical", "mean-pool"), models.timm_swin, images(32), 1,
          "mean of the last stage's tokens (windows, patch merging)", grid=(8, 8), attention_blocks=4),
    Entry("timm_pit", ("vision", "timm", "hierarchical", "token-pooling"), timm_pit, images(64), 1,
          "class token (row 0) of the last stage; conv pooling of the patch tokens between stages",
          attention_blocks=3, refusals=(_OTHER_COUNTS,)),
    Entry("timm_levit", ("vision", "timm", "hierarchical", "hybrid", "mean-pool"), timm_levit, images(128), 1,
          "mean of the last stage's tokens (head and distillation head averaged); BatchNorm, hardswish, "
          "attention subsampling", attention_blocks=3, refusals=(_FEWER_QUERIES,)),
    Entry("timm_maxvit", ("vision", "timm", "hierarchical", "hybrid", "windows", "mean-pool"), timm_maxvit,
          images(64), 1, "mean of the last stage's tokens; MBConv, block and grid attention", attention_blocks=4,
          refusals=(_GROUPED,)),
    Entry("timm_mobilevit", ("vision", "timm", "hybrid", "mean-pool"), timm_mobilevit, images(64), 1,
          "global average of the last conv features; transformers on unfolded 2x2 patches", attention_blocks=2,
          refusals=(_GROUPED,)),
    Entry("timm_efficientformer", ("vision", "timm", "hybrid", "mean-pool"), timm_efficientformer, images(224), 1,
          "mean of the last stage's 7x7 tokens (head and distillation head averaged); BatchNorm, avg_pool2d "
          "token mixers", attention_blocks=1),
    Entry("timm_mvitv2", ("vision", "timm", "hierarchical", "pooled-attention", "in-place"), timm_mvitv2, images(64), 1,
          "mean of the last stage's tokens; pooled keys and queries, scores written in place",
          attention_blocks=None, refusals=(_FEWER_QUERIES,)),
    Entry("timm_davit", ("vision", "timm", "hierarchical", "windows", "channel-attention", "mean-pool"), timm_davit,
          images(64), 1, "mean of the last stage's tokens; window and channel attention on [B, C, H, W] stages",
          attention_blocks=None, refusals=((_ROLLOUTS, r"cannot place on one grid"),)),
    Entry("hf_detr", ("vision", "hf", "detection", "channels-first"), _seeded(hf_detr), images(64), detr_query_target,
          "object query 0 in the decoder; the encoder's tokens are the backbone's flattened feature map",
          attention_blocks=None, refusals=(_FEWER_QUERIES,)),
    # ---- HF vision
    Entry("hf_vit", ("vision", "hf", "vit"), _seeded(models.hf_vit), images(32), 1, CLS, grid=(4, 4)),
    Entry("hf_deit", ("vision", "hf", "vit"), _seeded(models.hf_deit), images(32), 1,
          "class token (row 0); distillation token unused by DeiTForImageClassification", grid=(4, 4)),
    Entry("hf_beit", ("vision", "hf", "vit", "mean-pool"), _seeded(hf_beit), images(32), 1,
          "mean of the patch tokens (class token excluded, use_mean_pooling)", grid=(4, 4)),
    Entry("hf_dinov2", ("vision", "hf", "vit"), _seeded(hf_dinov2), images(28), 1,
          "class token concatenated with the mean of the patch tokens (every row)", grid=(4, 4)),
    Entry("hf_swin", ("vision", "hf", "windows", "hierarchical", "mean-pool"), _seeded(models.hf_swin), images(32), 1,
          "mean of the last stage's tokens", grid=(8, 8), attention_blocks=4),
    Entry("hf_vitmae", ("vision", "hf", "vit", "shuffle"), _seeded(hf_vitmae), mae_images(32, 16), class_token_target,
          "class token (row 0); the patch tokens are shuffled by noise= (mask_ratio 0)", grid=(4, 4),
          shuffled=mae_shuffled),
    # ---- multimodal
    Entry("clip_image", ("vision", "hf", "multimodal", "clip"), _seeded(models.hf_clip), clip_inputs("image"),
          clip_image_target, "class token of the image tower (similarity to text 1)", wrt="pixel_values",
          grid=(4, 4)),
    Entry("clip_text", ("text", "hf", "multimodal", "clip", "decoder"), _seeded(models.hf_clip), clip_inputs("text"),
          clip_text_target, "the EOS position of the text tower (similarity to image 0)", wrt="input_ids",
          # with 2 threads transformer_attribution's batch and a sample alone differ by up to 4.8e-5 of the largest
          # score, the float32 batch is off the float64 one by 5.0e-5; in float64 they agree to 1e-13 (measured)
          batch_tol=1e-4),
    Entry("siglip_vision", ("vision", "hf", "multimodal", "attention-pool"), _seeded(hf_siglip_vision), images(32),
          pooled_target, "attention pooling head (a learned probe attends over every patch token; no class token)",
          grid=(4, 4), refusals=(_FEWER_QUERIES,)),
]

_ENTRIES += [
    # ---- issue 27: latent, pooling, sparse, hierarchical, audio, video, mixture-of-experts, state-space models
    Entry("perceiver_ids", ("text", "encoder", "hf", "latent"), zm.perceiver_text, zm.perceiver_text_inputs, 1,
          "the latents (8 latents cross-attend to the tokens; the decoder reads the latents)", wrt="inputs",
          attention_blocks=None, refusals=(_FEWER_QUERIES,)),
    Entry("perceiver_image", ("vision", "hf", "latent"), zm.perceiver_image, images(16), 1,
          "the latents (8 latents cross-attend to the 256 pixels)", attention_blocks=None,
          refusals=(_FEWER_QUERIES,)),
    Entry("funnel", ("text", "encoder", "hf", "token-pooling"), zm.funnel, texts(), 1,
          "position 0 of the last block; the second block pools its queries (8 -> 4), relative attention with "
          "slice_scatter", attention_blocks=None, refusals=(_FEWER_QUERIES,)),
    Entry("longformer", ("text", "encoder", "hf", "sparse"), zm.longformer, texts(pad_id=1), 1,
          "<s> (global attention) in the classification head; sliding-window attention",
          refusals=((".*", r"could not capture.*data-dependent.*modeling_longformer"),)),
    Entry("bigbird_sparse", ("text", "encoder", "hf", "sparse"), zm.bigbird, zm.bigbird_inputs, 1,
          "[CLS] through the pooler; block-sparse attention (several softmax products per layer)",
          refusals=((_ROLLOUTS, r"separate softmax-times-values products.*block-sparse"),)),
    Entry("segformer", ("vision", "hf", "hierarchical", "mean-pool"), zm.segformer, images(32), 1,
          "mean of the last stage's tokens; spatial-reduction attention (keys downsampled)", attention_blocks=None,
          refusals=(_FEWER_QUERIES,)),
    Entry("pvt_v2", ("vision", "hf", "hierarchical", "mean-pool"), zm.pvt_v2, images(32), 1,
          "mean of the last stage's tokens; spatial-reduction attention (keys downsampled)", attention_blocks=None,
          refusals=(_FEWER_QUERIES,)),
    Entry("wav2vec2", ("audio", "hf", "mean-pool"), zm.wav2vec2, zm.audio_inputs, 1,
          "mean of the frames (mean pooling); the attention mask writes the padded frames (index_put)",
          # transformer_attribution's scores are the blocks' (dA * R_A)+ alone (the identity share left out), ~1e-11
          # on this random model: in float64 a batch and a sample alone agree to 2e-14 of the largest score, in
          # float32 each is off the float64 map by up to 6.0e-4 of it and they differ by up to 4.8e-4 (measured)
          batch_tol=1e-3),
    Entry("whisper_audio", ("audio", "hf", "mean-pool", "channels-first"), _seeded(hf_whisper_audio), mel_features, 1,
          "mean of the encoder positions (projected, then pooled); mel features read channels-first"),
    Entry("videomae", ("video", "hf", "mean-pool"), zm.videomae, zm.video_inputs, 1,
          "mean of the tubelet tokens (use_mean_pooling)"),
    Entry("mixtral", ("text", "decoder", "hf", "moe"), zm.mixtral, texts(), "next_token",
          "the last real position; top-2 routing over 4 experts"),
    Entry("mamba", ("text", "decoder", "hf", "state-space"), zm.mamba, zm.ids_only, "next_token",
          "the last position; selective scan, no attention",
          refusals=((_ROLLOUTS, r"no attention blocks"),)),
]

ZOO: Dict[str, Entry] = {e.name: e for e in _ENTRIES}
assert len(ZOO) == len(_ENTRIES)

#: representative subset run by default (the rest is marked slow)
FAST = ["bert", "deberta_v2", "llama", "timm_vit_gap", "timm_cait", "timm_pit", "hf_vitmae", "clip_image", "wav2vec2",
        "bigbird_sparse"]

METHODS = {
    "transformer_attribution": {"method": "transformer_attribution"},
    "lrp(attnlrp)": {"method": "lrp", "preset": "attnlrp"},
    "rollout": {"method": "rollout"},
    "gradient_rollout": {"method": "gradient_rollout"},
}
