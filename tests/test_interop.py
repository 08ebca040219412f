"""relprop inside captum, Quantus and inseq workflows (:mod:`relprop.interop`).

Each test runs the other library on relprop's adapter and checks the numbers against
:func:`relprop.explain` (or relprop's own perturbation test) on the same model and inputs; the
library's tests are skipped, with the reason, when it is not installed.
"""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import transformers

import relprop
from relprop import demo
from relprop.evaluation import perturbation_curve
from relprop.interop import CaptumAttribution, LLMRelpropAttribution, quantus_explain_func

import models


@pytest.fixture(scope="module")
def vit():
    return models.timm_vit_tiny()


@pytest.fixture(scope="module")
def pixels(vit):
    return models.image_batch(vit, batch=2)


@pytest.fixture(scope="module")
def plain_tok():
    """The demo checkpoint's word-piece tokenizer without [CLS]/[SEP] (a decoder's tokenizer adds none)."""
    from tokenizers.processors import TemplateProcessing

    tok = transformers.AutoTokenizer.from_pretrained(demo.checkpoint_dir(), local_files_only=True)
    tok.backend_tokenizer.post_processor = TemplateProcessing(single="$A", pair="$A $B")
    tok.bos_token, tok.eos_token = "[CLS]", "[SEP]"
    return tok


@pytest.fixture(scope="module")
def gpt2(plain_tok):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=plain_tok.vocab_size, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                  bos_token_id=plain_tok.cls_token_id, eos_token_id=plain_tok.sep_token_id,
                                  pad_token_id=plain_tok.pad_token_id)
    return transformers.GPT2LMHeadModel(cfg).eval()


# ------------------------------------------------------------------ captum-style attribution


def test_captum_style_images_keep_the_map_as_channel_sum(vit, pixels):
    attr = CaptumAttribution(vit)
    a = attr.attribute(pixels, target=[1, 3])
    exp = relprop.explain(vit, pixels, target=torch.tensor([1, 3]))
    assert a.shape == pixels.shape
    torch.testing.assert_close(a.sum(1), exp.map, rtol=1e-5, atol=1e-8)
    assert torch.equal(a[:, 0], a[:, 2])  # spread evenly over the colour channels
    (t,) = attr.attribute((pixels,), target=1)  # a tuple in, a tuple out (captum's convention)
    assert t.shape == pixels.shape


def test_captum_style_input_level_method_returns_the_pixel_relevance(vit, pixels):
    a = CaptumAttribution(vit, method="lrp", preset="attnlrp").attribute(pixels, target=2)
    exp = relprop.explain(vit, pixels, target=2, method="lrp", preset="attnlrp")
    torch.testing.assert_close(a, exp.input_relevance)


def test_captum_style_text_with_the_mask_as_additional_argument():
    bert = models.hf_bert()
    batch = models.text_batch()
    attr = CaptumAttribution(bert, method="gradient_rollout")
    a = attr.attribute(batch["input_ids"], target=1, additional_forward_args=(batch["attention_mask"],))
    exp = relprop.explain(bert, batch, target=1, method="gradient_rollout")
    assert torch.equal(a, exp.scores)
    assert attr.last_explanation.method == "gradient_rollout"


def test_captum_style_refuses_several_inputs_with_advice(vit, pixels):
    with pytest.raises(relprop.InputError, match="additional_forward_args"):
        CaptumAttribution(vit).attribute((pixels, pixels), target=0)


def test_captum_metrics_run_on_relprop_attributions(vit, pixels):
    captum_metrics = pytest.importorskip("captum.metrics", reason="captum is not installed")
    attr = CaptumAttribution(vit)

    def perturb(inputs):
        noise = torch.randn(inputs.shape, generator=torch.Generator().manual_seed(0)) * 0.01
        return noise, inputs - noise

    a = attr.attribute(pixels, target=1)
    infid = captum_metrics.infidelity(vit, perturb, pixels, a, target=1, n_perturb_samples=2)
    sens = captum_metrics.sensitivity_max(attr.attribute, pixels, target=1, n_perturb_samples=2,
                                          perturb_radius=0.01)
    assert infid.shape == (2,) and torch.isfinite(infid).all()
    assert sens.shape == (2,) and torch.isfinite(sens).all() and (sens >= 0).all()


def test_llm_attribution_result_holds_explain_generation_rows(gpt2, plain_tok):
    pytest.importorskip("captum.attr", reason="captum is not installed")
    attr = LLMRelpropAttribution(gpt2, plain_tok)
    res = attr.attribute("a fine film", target="and a story")
    gen = relprop.explain_generation(gpt2, plain_tok, "a fine film", method="lrp", preset="attnlrp",
                                     target=torch.tensor(plain_tok("and a story")["input_ids"]))
    n = gen.source_length
    assert res.input_tokens == ["a", "fine", "film"] and res.output_tokens == ["and", "a", "story"]
    np.testing.assert_allclose(res.token_attr, gen.matrix[:, :n].numpy(), rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(res.seq_attr, gen.matrix[:, :n].sum(0).numpy(), rtol=1e-5, atol=1e-8)


# ------------------------------------------------------------------ Quantus


def test_quantus_explain_func_gives_the_map(vit, pixels):
    a = quantus_explain_func(vit, pixels.numpy(), np.array([1, 3]))
    exp = relprop.explain(vit, pixels, target=torch.tensor([1, 3]))
    assert a.shape == (2, 1, 64, 64) and a.dtype == np.float32
    np.testing.assert_allclose(a[:, 0], exp.map.numpy(), rtol=1e-6)
    with pytest.raises(relprop.InputError, match="images"):
        quantus_explain_func(vit, np.zeros((2, 5), dtype=np.float32), np.array([0, 0]))


def test_quantus_pixel_flipping_equals_relprop_perturbation_curve(vit, pixels):
    """The same map, baseline 0, the same pixels removed: the target probabilities agree.

    Quantus's PixelFlipping ranks the entries of the map repeated over the 3 colour channels and flips
    ``features_in_step`` entries per step, so every third step has removed whole pixels (a pixel's 3
    entries are equal, hence adjacent in the ranking); the map has no ties (random values), so both
    libraries remove the same pixels.
    """
    quantus = pytest.importorskip("quantus", reason="quantus is not installed")
    targets = np.array([1, 3])
    hw, per_step = 64 * 64, 512
    a = np.random.default_rng(0).random((2, 1, 64, 64)).astype(np.float32)
    metric = quantus.PixelFlipping(features_in_step=per_step, perturb_baseline=0.0, normalise=False, abs=False,
                                   disable_warnings=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        curves = metric(model=vit, x_batch=pixels.numpy(), y_batch=targets, a_batch=np.repeat(a, 3, axis=1),
                        device="cpu", softmax=True)
    q = np.asarray(curves)[:, 2::3]  # [samples, 8]: after 512, 1024, ... whole pixels
    steps = [per_step * (j + 1) / hw for j in range(hw // per_step)]
    ours = perturbation_curve(vit, pixels, torch.from_numpy(a[:, 0]), target=torch.from_numpy(targets),
                              mode="positive", steps=steps, baseline=0.0, unit="pixel")
    assert q.shape == ours.probability.shape == (2, len(steps))
    np.testing.assert_allclose(ours.probability, q, rtol=1e-4, atol=1e-6)


# ------------------------------------------------------------------ inseq


def test_inseq_method_gives_relprop_scores_per_step(gpt2, plain_tok):
    inseq = pytest.importorskip("inseq", reason="inseq is not installed")
    import relprop.interop.inseq_method  # noqa: F401  (registers "relprop")

    model = inseq.load_model(gpt2, "relprop", tokenizer=plain_tok)
    out = model.attribute("a fine film", generation_args={"max_new_tokens": 2, "do_sample": False},
                          attributed_fn="logit", show_progress=False)
    seq = out.sequence_attributions[0]
    rows = seq.target_attributions  # [tokens, steps]
    ids = torch.tensor([[plain_tok.convert_tokens_to_ids(t.token) for t in seq.target]])
    for step in range(2):
        n = 3 + step
        ref = relprop.explain(gpt2, {"input_ids": ids[:, :n], "attention_mask": torch.ones(1, n, dtype=torch.long)},
                              target=ids[:, n], method="lrp", preset="attnlrp")
        torch.testing.assert_close(rows[:n, step], ref.scores[0], rtol=1e-5, atol=1e-8)
        assert torch.isnan(rows[n:, step]).all()  # later tokens: not yet generated


def test_the_documented_inseq_example_runs_as_written(gpt2, plain_tok, capsys):
    """docs/interop.md's inseq snippet, executed as written (relprop's method as relprop_method=, inseq's
    own method= being the attribution method's name; out.show() with inseq's default aggregation)."""
    pytest.importorskip("inseq", reason="inseq is not installed")
    import re
    from pathlib import Path
    page = (Path(__file__).resolve().parents[1] / "docs" / "interop.md").read_text()
    section = page[page.index("## inseq"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    scope = {"hf_model": gpt2, "tokenizer": plain_tok}
    exec(compile(code, "docs/interop.md", "exec"), scope)
    assert "Attributed tokens" in capsys.readouterr().out  # out.show() printed the table
    seq = scope["out"].sequence_attributions[0]
    ids = torch.tensor([[plain_tok.convert_tokens_to_ids(t.token) for t in seq.target]])
    n = len(plain_tok("the capital of france is")["input_ids"])
    ref = relprop.explain(gpt2, {"input_ids": ids[:, :n], "attention_mask": torch.ones(1, n, dtype=torch.long)},
                          target=ids[:, n], method="lrp", preset="attnlrp")
    torch.testing.assert_close(seq.target_attributions[:n, 0], ref.scores[0], rtol=1e-5, atol=1e-8)


def test_inseq_method_refuses_a_score_other_than_the_logit(gpt2, plain_tok):
    inseq = pytest.importorskip("inseq", reason="inseq is not installed")
    import relprop.interop.inseq_method  # noqa: F401

    model = inseq.load_model(gpt2, "relprop", tokenizer=plain_tok)
    with pytest.raises(relprop.RelpropError, match="attributed_fn='logit'"):
        model.attribute("a fine film", generation_args={"max_new_tokens": 1, "do_sample": False},
                        attributed_fn="probability", show_progress=False)


def test_inseq_method_on_an_encoder_decoder_gives_source_scores(plain_tok):
    inseq = pytest.importorskip("inseq", reason="inseq is not installed")
    import relprop.interop.inseq_method  # noqa: F401

    torch.manual_seed(0)
    t = plain_tok
    cfg = transformers.BartConfig(vocab_size=t.vocab_size, d_model=32, encoder_layers=2, decoder_layers=2,
                                  encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                  decoder_ffn_dim=64, max_position_embeddings=64, pad_token_id=t.pad_token_id,
                                  bos_token_id=t.cls_token_id, eos_token_id=t.sep_token_id,
                                  decoder_start_token_id=t.cls_token_id, forced_eos_token_id=None)
    bart = transformers.BartForConditionalGeneration(cfg).eval()
    out = inseq.load_model(bart, "relprop", tokenizer=t).attribute(
        "a fine film", generation_args={"max_new_tokens": 2, "do_sample": False}, attributed_fn="logit",
        show_progress=False)
    seq = out.sequence_attributions[0]
    src = torch.tensor([[t.convert_tokens_to_ids(x.token) for x in seq.source]])
    tgt = torch.tensor([[t.convert_tokens_to_ids(x.token) for x in seq.target]])
    for step in range(2):
        n = step + 1
        inputs = {"input_ids": src, "attention_mask": torch.ones_like(src), "decoder_input_ids": tgt[:, :n],
                  "decoder_attention_mask": torch.ones(1, n, dtype=torch.long)}
        ref = relprop.explain(bart, inputs, target=tgt[:, n], method="lrp", preset="attnlrp")
        torch.testing.assert_close(seq.source_attributions[:, step], ref.streams["input_ids"][0], rtol=1e-5, atol=1e-9)
