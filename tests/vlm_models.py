"""Tiny random vision-language models (LLaVA, PaliGemma, Gemma-3; tiled: Idefics3, SmolVLM; LLaVA-NeXT,
LLaVA-OneVision), each
built from a config (never downloaded) with a fixed seed, and their inputs built by hand: the prompt's ids with
one image placeholder per image token the projector makes, and the pixels.

Every family: a 32x32 image in 8x8 patches (a 4x4 grid, 16 image tokens), a 2-layer language model of
width 32. The placeholder id is 3; the prompt's other ids are >= FIRST_ID.
"""
from __future__ import annotations

import torch
import transformers

VOCAB = 64
IMAGE_TOKEN = 3
FIRST_ID = 4
GRID = (4, 4)
_SPECIAL = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
_TEXT = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, **_SPECIAL)
_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=32,
               patch_size=8)


def llava():
    """LlavaForConditionalGeneration: CLIP vision tower (its last-but-one layer, the class token
    dropped: 16 patch tokens) -> 2-layer MLP projector -> LLaMA."""
    torch.manual_seed(0)
    cfg = transformers.LlavaConfig(vision_config=transformers.CLIPVisionConfig(**_VISION),
                                   text_config=transformers.LlamaConfig(**_TEXT), image_token_id=IMAGE_TOKEN,
                                   vision_feature_layer=-2, vision_feature_select_strategy="default")
    return transformers.LlavaForConditionalGeneration(cfg).eval()


def paligemma():
    """PaliGemmaForConditionalGeneration: SigLIP vision tower (16 patch tokens) -> linear projector -> Gemma."""
    torch.manual_seed(0)
    text = transformers.GemmaConfig(**_TEXT, head_dim=8)
    cfg = transformers.PaliGemmaConfig(vision_config=transformers.SiglipVisionConfig(**_VISION), text_config=text,
                                       image_token_index=IMAGE_TOKEN, projection_dim=32)
    cfg.vision_config.projection_dim = 32
    return transformers.PaliGemmaForConditionalGeneration(cfg).eval()


def gemma3():
    """Gemma3ForConditionalGeneration (a sliding window of 8 tokens, so the last of 11 reads the image): SigLIP
    vision tower -> average pooling to mm_tokens_per_image
    tokens (here 2x2 patches pooled: 4 image tokens) -> RMSNorm + linear projector -> Gemma-3."""
    torch.manual_seed(0)
    text = transformers.Gemma3TextConfig(**_TEXT, head_dim=8, sliding_window=8)  # the last token sees the image
    cfg = transformers.Gemma3Config(vision_config=transformers.SiglipVisionConfig(**_VISION), text_config=text,
                                    image_token_index=IMAGE_TOKEN, mm_tokens_per_image=4, boi_token_index=60,
                                    eoi_token_index=61)
    model = transformers.Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # transformers initializes the projection to zeros: the image would not reach the output
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0, 0.2)
    return model


#: family -> (builder, image tokens per image)
FAMILIES = {"llava": (llava, 16), "paligemma": (paligemma, 16), "gemma3": (gemma3, 4)}


def model_cache(builders, first_inputs=None):
    """``get(family)``: the model of ``builders[family]()``, built once. With ``first_inputs``, the model
    is called once on ``first_inputs(family)`` (no grad, no cache) when built: transformers installs hooks
    that record the vision tower's hidden states on a model's first call (LLaVA reads its last-but-one
    layer) and keeps them, so snapshots taken afterwards see only what explain() would change."""
    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = model = builders[family]()
            if first_inputs is not None:
                with torch.no_grad():
                    model(**first_inputs(family), use_cache=False)
        return cache[family]

    return get


def batch(family: str, batch: int = 2, before: int = 3, after: int = 3, seed: int = 0):
    """A prompt per sample ([BOS] + ``before`` ids + the image placeholders + ``after`` ids) and one image per
    sample: ``{"input_ids", "attention_mask", "pixel_values"}`` (PaliGemma: ``token_type_ids`` too)."""
    g = torch.Generator().manual_seed(seed)
    n_img = FAMILIES[family][1]
    ids = torch.randint(FIRST_ID, 60, (batch, 1 + before + n_img + after), generator=g)
    ids[:, 0] = 1
    ids[:, 1 + before:1 + before + n_img] = IMAGE_TOKEN
    out = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
           "pixel_values": torch.randn(batch, 3, 32, 32, generator=g)}
    if family == "paligemma":
        out["token_type_ids"] = torch.zeros_like(ids)
    return out


# ------------------------------------------------------------------ Qwen2-VL, Qwen2.5-VL

#: Qwen: a 32x48 image in 8x8 patches (a 4x6 grid: not square, so a transposed map would not fit), each
#: 2x2 block of patches merged into one image token (6 tokens); 2 frames per patch (temporal_patch_size)
QWEN_IMAGE, QWEN_GRID, QWEN_TOKENS = (32, 48), (4, 6), 6
_QWEN_TEXT = dict(_TEXT, rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 1, 1]))
_QWEN_VISION = dict(depth=2, num_heads=4, patch_size=8, spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
_QWEN_IDS = dict(image_token_id=IMAGE_TOKEN, video_token_id=62, vision_start_token_id=60, vision_end_token_id=61)


def qwen2_vl():
    """Qwen2VLForConditionalGeneration: a 2-block vision tower over 8x8x2 patches with 2-D rotary positions,
    the 2x2 patch merger, a Qwen2 language model with 3-D (multimodal) rotary positions."""
    torch.manual_seed(0)
    cfg = transformers.Qwen2VLConfig(text_config=_QWEN_TEXT, vision_config=dict(
        _QWEN_VISION, embed_dim=32, hidden_size=32, mlp_ratio=2), **_QWEN_IDS)
    return transformers.Qwen2VLForConditionalGeneration(cfg).eval()


def qwen2_5_vl():
    """Qwen2_5_VLForConditionalGeneration: the vision tower attends within windows of 2x2 merged blocks
    (16x16 pixels, window_size) in block 0 and over the whole image in block 1 (fullatt_block_indexes)."""
    torch.manual_seed(0)
    cfg = transformers.Qwen2_5_VLConfig(text_config=_QWEN_TEXT, vision_config=dict(
        _QWEN_VISION, hidden_size=32, intermediate_size=64, out_hidden_size=32, window_size=32,
        fullatt_block_indexes=[1]), **_QWEN_IDS)
    return transformers.Qwen2_5_VLForConditionalGeneration(cfg).eval()


QWEN_FAMILIES = {"qwen2_vl": qwen2_vl, "qwen2_5_vl": qwen2_5_vl}


def qwen_processor():
    """The Qwen2-VL image processor (transformers' own cut of an image into merged patches) with this file's
    patch layout; no resizing or normalization, so its rows hold the given pixels."""
    return transformers.Qwen2VLImageProcessor(patch_size=8, merge_size=2, temporal_patch_size=2, do_resize=False,
                                              do_rescale=False, do_normalize=False)


def qwen_inputs(image: torch.Tensor, before: int = 3, after: int = 3, seed: int = 0):
    """The processor's outputs for one prompt ([BOS] + ``before`` ids + vision start + the 6 image
    placeholders + vision end + ``after`` ids) and one image [3, 32, 48]: ``{"input_ids", "attention_mask",
    "mm_token_type_ids", "pixel_values" [24, 384], "image_grid_thw"}``."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(FIRST_ID, 60, (1, 1 + before + QWEN_TOKENS + 2 + after), generator=g)
    ids[:, 0] = 1
    ids[:, 1 + before] = 60
    ids[:, 2 + before:2 + before + QWEN_TOKENS] = IMAGE_TOKEN
    ids[:, 2 + before + QWEN_TOKENS] = 61
    out = dict(qwen_processor()([image], return_tensors="pt"))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "mm_token_type_ids": (ids == IMAGE_TOKEN).int(),
            **out}


def qwen_image(seed: int = 0) -> torch.Tensor:
    """A random image [3, 32, 48]."""
    return torch.randn(3, *QWEN_IMAGE, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------ tiled families (Idefics3, SmolVLM)

#: the tiled image: 64x64 pixels cut into 2x2 tiles of 32x32 (the vision tower's size), then the global image
TILE_ROWS, TILE_COLS, TILE = 2, 2, 32
#: image tokens per tile: a 4x4 patch grid, pixel-shuffled 2x2 -> 4 tokens
TILE_TOKENS = 4


def _tiled(config_cls, vision_cls, model_cls):
    torch.manual_seed(0)
    cfg = config_cls(vision_config=vision_cls(**_VISION), text_config=transformers.LlamaConfig(**_TEXT),
                     image_token_id=IMAGE_TOKEN, scale_factor=2)
    return model_cls(cfg).eval()


def idefics3():
    """Idefics3ForConditionalGeneration: SigLIP-like vision tower per tile (a 4x4 patch grid) -> pixel shuffle
    (scale_factor 2: each 2x2 cell of patches one token, 4 per tile) -> linear projector -> LLaMA."""
    return _tiled(transformers.Idefics3Config, transformers.Idefics3VisionConfig,
                  transformers.Idefics3ForConditionalGeneration)


def smolvlm():
    """SmolVLMForConditionalGeneration: built as Idefics3 (its own classes)."""
    return _tiled(transformers.SmolVLMConfig, transformers.SmolVLMVisionConfig,
                  transformers.SmolVLMForConditionalGeneration)


TILED = {"idefics3": idefics3, "smolvlm": smolvlm}


def tiles_of(image: torch.Tensor) -> torch.Tensor:
    """[batch, 5, 3, 32, 32] from [batch, 3, 64, 64] as Idefics3's processor cuts an image: the 2x2 tiles row
    by row, then the global image (here the image downscaled by averaging 2x2 pixels, so a region that is
    0 in the image is 0 in the global image at the place it covers)."""
    b = image.shape[0]
    t = image.reshape(b, 3, TILE_ROWS, TILE, TILE_COLS, TILE).permute(0, 2, 4, 1, 3, 5)
    tiles = t.reshape(b, TILE_ROWS * TILE_COLS, 3, TILE, TILE)
    glob = torch.nn.functional.avg_pool2d(image, 2)[:, None]
    return torch.cat([tiles, glob], 1)


def tiled_batch(batch: int = 2, before: int = 3, after: int = 3, seed: int = 0, image=None):
    """A prompt per sample with the placeholders of 5 images (4 tiles and the global image, 4 tokens each; the
    processor's <row_i_col_j> and newline tokens between them are other ids here) and the tiles of a
    64x64 image per sample (or of ``image``), with the tile grid (``rows``, ``cols``)."""
    g = torch.Generator().manual_seed(seed)
    n = (TILE_ROWS * TILE_COLS + 1) * TILE_TOKENS
    ids = torch.randint(FIRST_ID, 60, (batch, 1 + before + n + after), generator=g)
    ids[:, 0] = 1
    ids[:, 1 + before:1 + before + n] = IMAGE_TOKEN
    image = torch.randn(batch, 3, 2 * TILE, 2 * TILE, generator=g) if image is None else image
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": tiles_of(image),
            "rows": [[TILE_ROWS]] * batch, "cols": [[TILE_COLS]] * batch}


# ------------------------------------------------------------------ LLaVA-NeXT (any-resolution crops)

#: the pinpoint grids of the tiny LLaVA-NeXT: 1x2, 2x1 and 2x2 tiles of 32x32
PINPOINTS = [[32, 64], [64, 32], [64, 64]]


def llava_next():
    """LlavaNextForConditionalGeneration: CLIP vision tower per tile (its last-but-one layer, the class token
    dropped: 16 patch tokens per tile) -> 2-layer MLP projector -> unpadding + image_newline -> LLaMA."""
    torch.manual_seed(0)
    cfg = transformers.LlavaNextConfig(vision_config=transformers.CLIPVisionConfig(**_VISION),
                                       text_config=transformers.LlamaConfig(**_TEXT), image_token_id=IMAGE_TOKEN,
                                       image_grid_pinpoints=PINPOINTS, vision_feature_layer=-2,
                                       vision_feature_select_strategy="default")
    model = transformers.LlavaNextForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # transformers initializes the newline embedding to zeros; any value will do
        model.model.image_newline.normal_(0, 0.2)
    return model


def anyres_batch(height: int = 32, seed: int = 0, image=None, before: int = 3, after: int = 3, crop_tokens=None):
    """One sample as LLaVA-NeXT's processor makes it from a ``height`` x 64 image (32 or 16; or ``image``
    [1, 3, height, 64]): the best pinpoint is 32x64 (1x2 crops); the image goes to the centre of a 32x64
    canvas padded with zeros (16 rows high: 8 rows above and below, which the model unpads: the first and
    last patch rows), cut into its two 32x32 crops after the base image (the image resized to 32x32), and
    the prompt with the image's placeholders: 16 base tokens + one per kept crop patch + a newline per row
    (``crop_tokens``: the (rows, columns) of crop tokens instead, for LLaVA-OneVision's shrunk grid)."""
    g = torch.Generator().manual_seed(seed)
    image = torch.randn(1, 3, height, 64, generator=g) if image is None else image
    canvas = torch.zeros(1, 3, 32, 64)
    top = (32 - height) // 2
    canvas[:, :, top:top + height] = image
    base = torch.nn.functional.interpolate(image, size=(32, 32), mode="bilinear", align_corners=False)
    pixel_values = torch.stack([base[0], canvas[0, :, :, :32], canvas[0, :, :, 32:]])[None]
    oh, ow = crop_tokens if crop_tokens is not None else (4 if height == 32 else 2, 8)
    n = 16 + oh * (ow + 1)
    ids = torch.randint(FIRST_ID, 60, (1, 1 + before + n + after), generator=g)
    ids[:, 0] = 1
    ids[:, 1 + before:1 + before + n] = IMAGE_TOKEN
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": pixel_values,
            "image_sizes": torch.tensor([[height, 64]])}


def crops_by_loop(pixels: torch.Tensor) -> torch.Tensor:
    """The map [1, 32, 64] of an anyres_batch's two 32x32 crops side by side, pixel by pixel from per-tile
    relevance ``pixels`` [1, 3 tiles (base image, then the crops), 32, 32]: the reference of the composed map."""
    want = torch.zeros(1, 32, 64)
    for y in range(32):
        for x in range(64):
            want[0, y, x] = pixels[0, 1 + x // 32, y, x % 32]
    return want


# ------------------------------------------------------------------ LLaVA-OneVision (any-resolution, shrunk)

#: vision_aspect_ratio of the tiny LLaVA-OneVision models: "anyres_max_9" keeps the 4x8 crop grid of a 32x64
#: image (9 tiles' worth of patches allowed); "anyres_max_1" shrinks it (ratio sqrt(32/16) > 1.1) to 2x5 tokens
#: by bilinear interpolation, and keeps the 2x8 grid of a 16x64 image (ratio 1)
ONEVISION = {"onevision": "anyres_max_9", "onevision_shrunk": "anyres_max_1"}


def llava_onevision(vision_aspect_ratio: str = "anyres_max_9"):
    """LlavaOnevisionForConditionalGeneration: SigLIP vision tower per tile (no class token, "full" features:
    16 patch tokens per tile) -> 2-layer MLP projector -> unpadding, the grid shrunk by bilinear interpolation
    when it is over ``vision_aspect_ratio`` -> image_newline -> Qwen2; the pinpoints of LLaVA-NeXT above."""
    torch.manual_seed(0)
    cfg = transformers.LlavaOnevisionConfig(vision_config=transformers.SiglipVisionConfig(**_VISION),
                                            text_config=transformers.Qwen2Config(**_TEXT),
                                            image_token_index=IMAGE_TOKEN, video_token_index=62,
                                            image_grid_pinpoints=PINPOINTS,
                                            vision_aspect_ratio=vision_aspect_ratio)
    return transformers.LlavaOnevisionForConditionalGeneration(cfg).eval()


ONEVISION_FAMILIES = {k: (lambda r=r: llava_onevision(r)) for k, r in ONEVISION.items()}
