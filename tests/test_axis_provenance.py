"""Where each axis comes from decides what relprop reads (:mod:`relprop.graph.axis_provenance`): a softmax
over a weight's axes (channel attention) is not a token-to-token block whatever its sizes, and the
ledger books the shares of sequence-major rows (t·B + b) to their own samples."""
from __future__ import annotations

import warnings

import pytest
import timm
import torch

import relprop
from relprop.graph.axis_provenance import batch_layout
from relprop.graph.capture import capture


def _explain(model, x, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return relprop.explain(model, x, target=1, **kw)


class SequenceMajor(torch.nn.Module):
    """``torch.nn.MultiheadAttention`` (or an encoder layer) on [tokens, batch, features], biases non-zero."""

    def __init__(self, layer):
        super().__init__()
        torch.manual_seed(0)
        self.layer, self.head = layer, torch.nn.Linear(16, 3)
        with torch.no_grad():
            for p in self.parameters():
                if p.dim() == 1:
                    p.normal_()

    def forward(self, x):
        h = x.transpose(0, 1)
        out = self.layer(h, h, h)[0] if isinstance(self.layer, torch.nn.MultiheadAttention) else self.layer(h)
        return self.head(out.mean(0))


LAYERS = {"mha": lambda: torch.nn.MultiheadAttention(16, 2),
          "encoder_layer": lambda: torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0)}


@pytest.mark.parametrize("name", list(LAYERS))
@pytest.mark.parametrize("preset", ["attnlrp", "cp_lrp"])
@pytest.mark.parametrize("batch,tokens", [(3, 5), (4, 4)])
def test_sequence_major_rows_are_booked_to_their_samples(name, preset, batch, tokens):
    # (4, 4): [tokens, batch, features] with as many tokens as samples, where sizes cannot tell the axes apart
    model = SequenceMajor(LAYERS[name]()).eval().double()
    x = torch.randn(batch, tokens, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    e = _explain(model, x, method="lrp", preset=preset, fast_path=False)
    assert float(e.conservation.error.max()) < 1e-12
    assert any(float(v.abs().max()) > 1e-3 for k, v in e.conservation.absorbed_by.items() if "bias" in k)
    for i in range(batch):
        one = _explain(model, x[i:i + 1], method="lrp", preset=preset, fast_path=False)
        torch.testing.assert_close(one.scores[0], e.scores[i])
        for label, v in one.conservation.absorbed_by.items():  # each sample's books, alone and in the batch
            torch.testing.assert_close(v[0], e.conservation.absorbed_by[label][i], atol=1e-12, rtol=1e-9)


def test_batch_axis_of_a_static_capture_is_read_from_provenance_not_sizes():
    # a graph captured for 4 samples of 4 tokens: the transposed [tokens, batch, features] has its samples on
    # axis 1 although axis 0 has the batch's size, and MHA's [tokens·batch, features] rows are no batch-major fold
    model = SequenceMajor(LAYERS["mha"]()).eval()
    c = capture(model, {"x": torch.randn(4, 4, 16)}, "x")
    a = c.analysis
    transposed = [n for n in c.graph.nodes if n.target in (torch.ops.aten.transpose.int, torch.ops.aten.permute.default)
                  and n.args[0].op == "placeholder" and n in a.live]
    assert transposed and all(a.batch_dim[n] == 1 for n in transposed)
    rows = [n for n in c.graph.nodes if n.target is torch.ops.aten.linear.default and n in a.live
            and batch_layout(a.axes[n.args[0]]) == (0, 4, 1)]
    assert rows and all(n.args[0] in a.interleaved for n in rows)


def test_values_of_a_second_stream_carry_the_samples_of_their_own_input():
    # an encoder-decoder captured for 2 samples: the decoder's values are computed from decoder_input_ids, not
    # from the explained ids; their samples are that input's batch (a live value with no batch factor would be
    # booked to no sample, and the per-sample ledger refuses it)
    import two_stream_models as M
    c = capture(M.bart(), {**M.inputs_for("bart"), "use_cache": False}, "input_ids")
    a = c.analysis
    decoder = [n for n in a.live if n in a.relevant and n not in a.streams.get("input_ids", [])
               and isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].dim() == 3]
    assert len(a.streams) == 2 and decoder
    assert all(batch_layout(a.axes[n]) is not None for n in decoder)
    assert all(a.batch_dim[n] == 0 for n in decoder)


def test_a_batch_of_one_in_a_broadcast_mask_does_not_become_a_second_samples_axis():
    # one sample of one token: the attention mask [1, 1] carries the samples (its axis 0) and broadcasts against
    # [1, 1, features] values aligned from the right, where its axis 0 lines up with the tokens' axis
    import models
    ids = torch.tensor([[5]])
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    model = models.hf_bert()
    a = capture(model, inputs, "input_ids").analysis
    assert all(sum(k == "batch" for ax in a.axes[n] for k, _ in ax) == 1 for n in a.live if n in a.axes)
    exp = relprop.explain(model, inputs, target=0, method="transformer_attribution")
    assert exp.scores.shape == (1, 1) and torch.isfinite(exp.scores).all()


def test_provenance_reads_interleaved_rows():
    model = SequenceMajor(LAYERS["mha"]()).eval()
    c = capture(model, {"x": torch.randn(2, 5, 16)}, "x")
    a = c.analysis
    linears = [n for n in c.graph.nodes if n.target is torch.ops.aten.linear.default and n in a.live]
    rows = [batch_layout(a.axes[n.args[0]]) for n in linears]
    # the projections of MHA read [T·B, E] rows (t·B + b): 5 tokens before each sample's row
    assert (0, 5, 1) in rows


class ChannelMixer(torch.nn.Module):
    """Softmax over the channels of a head whose size equals the token count (8 and 8): channel attention
    that sizes alone cannot tell from token attention."""

    def __init__(self, tokens=8, d=8):
        super().__init__()
        torch.manual_seed(0)
        self.qkv, self.proj, self.head = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d), torch.nn.Linear(d, 3)

    def forward(self, x):  # [B, N, d]
        q, k, v = self.qkv(x).chunk(3, -1)
        attn = (q.transpose(-1, -2) @ k).softmax(-1)  # [B, d, d]: channels to channels
        y = (attn @ v.transpose(-1, -2)).transpose(-1, -2)  # [B, N, d]
        return self.head((x + self.proj(y)).mean(1))


def test_channel_attention_is_not_a_token_block_whatever_its_size():
    model = ChannelMixer().eval()
    x = torch.randn(2, 8, 8, generator=torch.Generator().manual_seed(1))
    c = capture(model, {"x": x}, "x")
    assert c.analysis.blocks == []
    assert any("channels" in why for why in c.analysis.left_out)
    with pytest.raises(relprop.RelpropError, match="no attention blocks"):
        _explain(model, x, method="rollout")
    e = _explain(model, x, method="input_x_gradient")
    xx = x.clone().requires_grad_(True)
    model(xx)[:, 1].sum().backward()
    torch.testing.assert_close(e.scores, (xx.grad * xx).sum(-1))


@pytest.fixture(scope="module")
def davit():
    torch.manual_seed(0)
    return timm.create_model("davit_tiny", depths=(1, 1), embed_dims=(16, 32), num_heads=(1, 2), num_classes=5,
                             window_size=4).eval()


def test_davit_channel_blocks_left_out_and_gradients_explained(davit):
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(2))
    report = relprop.coverage(davit, x)
    assert [b.name for b in report.blocks] == ["stages.0.blocks.0.0.attn", "stages.1.blocks.0.0.attn"]
    e = _explain(davit, x, method="input_x_gradient")
    xx = x.clone().requires_grad_(True)
    davit(xx)[:, 1].sum().backward()
    per_patch = (xx.grad * xx).sum(1).reshape(2, 16, 4, 16, 4).sum((2, 4)).reshape(2, 256)
    torch.testing.assert_close(e.scores, per_patch, rtol=1e-4, atol=1e-6)
    with pytest.raises(relprop.RelpropError, match="cannot place on one grid"):
        _explain(davit, x, method="rollout")


def _whisper():
    import transformers
    torch.manual_seed(0)
    cfg = transformers.WhisperConfig(vocab_size=64, num_mel_bins=8, d_model=16, encoder_layers=2,
                                     encoder_attention_heads=2, decoder_layers=1, decoder_attention_heads=2,
                                     encoder_ffn_dim=32, decoder_ffn_dim=32, max_source_positions=8, num_labels=3,
                                     pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
    return transformers.WhisperForAudioClassification(cfg).eval()


def test_channels_first_features_score_their_frames():
    """Whisper reads log-mel features [batch, mel, frames] channels-first (its first convolution contracts the
    mel bins): the input methods score the 16 frames, and the rollouts' 8 encoder positions say what they are."""
    model = _whisper()
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(3))
    e = _explain(model, {"input_features": x}, method="input_x_gradient")
    xx = x.clone().requires_grad_(True)
    model(input_features=xx).logits[:, 1].sum().backward()
    torch.testing.assert_close(e.scores, (xx.grad * xx).sum(1))
    lrp = _explain(model, {"input_features": x}, method="lrp", preset="attnlrp")
    assert tuple(lrp.scores.shape) == (2, 16)
    r = _explain(model, {"input_features": x}, method="rollout")
    assert tuple(r.scores.shape) == (2, 8)
    assert any("16 positions along axis 2" in n for n in r.notes), r.notes


def test_channels_first_feature_map_is_one_sequence_not_windows():
    """DETR flattens its backbone's [batch, C, H, W] features into the encoder's tokens: one sequence per
    sample (no positions folded into the batch), not window attention; the rollouts refuse for the true
    reason (the decoder's object queries), the input methods run."""
    import zoo
    model = zoo.hf_detr().eval()
    x = {"pixel_values": torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(4))}
    c = capture(model, x, "pixel_values")
    assert c.analysis.windows == {}
    with pytest.raises(relprop.RelpropError, match=r"maps 64 tokens to 4 queries"):
        relprop.explain(model, x, method="rollout", target=zoo.detr_query_target)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        e = relprop.explain(model, x, method="input_x_gradient", target=zoo.detr_query_target)
    xx = x["pixel_values"].clone().requires_grad_(True)
    zoo.detr_query_target(model(pixel_values=xx)).sum().backward()
    torch.testing.assert_close(e.map[0], (xx.grad * xx).sum(1)[0], rtol=1e-4, atol=1e-7)


def _zoo_pair(name):
    import zoo
    entry = zoo.ZOO[name]
    torch.manual_seed(0)
    model = entry.build().eval()
    return entry, model, entry.inputs(model, 2, 0)


def test_token_ids_carry_their_axes_through_views_to_the_lookup():
    """OPT views input_ids ([B, T] → [-1, T]) before its lookup: the ids are integers (not live), yet the
    embedding's axes are the ids' (batch, positions) and a feature axis, never a parameter's."""
    from relprop.graph.capture import CaptureCache
    from relprop.graph.inputs import bind_inputs
    entry, model, inputs = _zoo_pair("opt")
    captured = CaptureCache(disk=False, first_export="static").get(model, bind_inputs(model, inputs))
    a = captured.analysis
    lookup = next(n for n in captured.graph.nodes if n.target is torch.ops.aten.embedding.default)  # the tokens'
    assert lookup.args[1].args[0].name == "input_ids"  # through a view of the ids
    assert a.axes[lookup] == [[("batch", 2)], [("input", inputs["input_ids"].shape[1])], [("feature", 32)]]
    assert a.batch_dim[lookup] == 0


@pytest.mark.parametrize("name", ["opt", "mixtral"])
def test_a_static_first_capture_explains_as_the_dynamic_one(name):
    """A program exported at the call's sizes (CaptureCache(first_export="static")) reads the samples from
    the axes' provenance where the sizes do not show them (OPT's [B·T, H] MLP rows; Mixtral's router rows
    through topk): the scores equal the dynamic capture's bit for bit and the per-sample ledger closes."""
    from relprop.graph import capture as capture_module
    entry, model, inputs = _zoo_pair(name)
    out = {}
    cache = capture_module.CACHE
    for mode in ("dynamic", "static"):
        old, cache.first_export = cache.first_export, mode
        cache.clear(model)  # captured again, this time in this mode
        try:
            out[mode] = [_explain(model, inputs, method="transformer_attribution"),
                         _explain(model, inputs, method="lrp", fast_path=False)]
            assert [p.exported_as for p in cache.programs(model)][0] != "dynamic sizes" or mode == "dynamic"
        finally:
            cache.first_export = old
            cache.clear(model)
    for d, s in zip(out["dynamic"], out["static"]):
        assert torch.equal(d.scores, s.scores)
    assert float(out["static"][1].conservation.error.max()) < 1e-5
