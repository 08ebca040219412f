"""Targets users have: label names, a language model's predicted next token with ``target=None``, a
given next token by id or by string, and contrastive targets ``relprop.contrast(a, b)``.

A contrast's relevance seed is +1 at class a and −1 at class b, so every method that is linear in the
seed (gradients, input × gradient, integrated gradients, the LRP walk) gives exactly the difference of
the two single-class explanations: the reference here is that difference, computed one class at a time.
"""
from __future__ import annotations

import pytest
import torch

import relprop
from relprop.targets import specify
from relprop.targets import Contrast, contrast, predicted_next_token

import models


@pytest.fixture(scope="module")
def bert():
    m = models.hf_bert()
    m.config.id2label = {0: "negative", 1: "neutral", 2: "positive"}
    m.config.label2id = {v: k for k, v in m.config.id2label.items()}
    return m


@pytest.fixture(scope="module")
def batch():
    return models.text_batch((7, 5))


def test_label_names_are_class_indices(bert, batch):
    by_name = relprop.explain(bert, batch, target="Positive")
    by_index = relprop.explain(bert, batch, target=2)
    assert torch.equal(by_name.scores, by_index.scores) and by_name.target.tolist() == [2, 2]
    per_sample = relprop.explain(bert, batch, target=["negative", "positive"])
    assert per_sample.target.tolist() == [0, 2]
    with pytest.raises(relprop.TargetError, match="not a label of .*negative, neutral, positive"):
        relprop.explain(bert, batch, target="happy")


@pytest.mark.parametrize("method", ["input_x_gradient", "lrp", "integrated_gradients"])
def test_contrast_is_the_difference_of_the_two_explanations(bert, batch, method):
    opts = {"n_steps": 4} if method == "integrated_gradients" else {}
    diff = relprop.explain(bert, batch, target=relprop.contrast("positive", "negative"), method=method, **opts)
    pos = relprop.explain(bert, batch, target=2, method=method, **opts)
    neg = relprop.explain(bert, batch, target=0, method=method, **opts)
    assert diff.target is None
    assert torch.allclose(diff.target_scores, pos.target_scores - neg.target_scores, atol=1e-5)
    scale = pos.scores.abs().max()
    assert torch.allclose(diff.scores, pos.scores - neg.scores, atol=1e-4 * scale)
    assert not torch.allclose(diff.scores, pos.scores, atol=1e-3 * scale)  # b's part is there


def test_contrast_for_every_method_runs_on_the_contrast_score(bert, batch):
    """Nonlinear methods: the explained score is the difference (target_scores), never class a alone."""
    logits = bert(**batch).logits.detach()
    for method in ["transformer_attribution", "gradient_rollout", "attcat"]:
        exp = relprop.explain(bert, batch, target=contrast(2, 0), method=method)
        assert torch.allclose(exp.target_scores, logits[:, 2] - logits[:, 0], atol=1e-5)
        assert torch.isfinite(exp.scores).all()


def test_contrast_refuses_the_predicted_class():
    with pytest.raises(relprop.TargetError, match="not the predicted class"):
        contrast(None, 1)
    assert isinstance(contrast(1, 0), Contrast)


def test_language_model_target_none_is_the_predicted_next_token():
    lm = models.hf_gpt2_lm()
    x = models.decoder_batch((7, 5))
    with torch.no_grad():
        logits = lm(**x, use_cache=False).logits
    last = x["attention_mask"].sum(1) - 1
    rows = logits[torch.arange(2), last]
    exp = relprop.explain(lm, x)
    given = relprop.explain(lm, x, target=rows.argmax(-1).tolist())  # ints are token ids for an LM
    assert torch.allclose(exp.target_scores, rows.max(-1).values, atol=1e-5)
    assert torch.equal(exp.scores, given.scores)
    # token a minus token b at the last non-padding position
    d = relprop.explain(lm, x, target=contrast(5, 9), method="input_x_gradient")
    assert torch.allclose(d.target_scores, rows[:, 5] - rows[:, 9], atol=1e-5)


def test_predicted_next_token_is_chosen_once():
    """Integrated gradients runs the model on scaled inputs: the token stays the one predicted on the
    inputs themselves."""
    fn = predicted_next_token(None)
    first = torch.zeros(1, 3, 10)
    first[0, -1, 4] = 1.0
    other = torch.zeros(1, 3, 10)
    other[0, -1, 7] = 5.0
    assert fn(first).item() == 1.0 and fn(other).item() == 0.0  # token 4, not other's argmax 7


@pytest.mark.parametrize("method", ["integrated_gradients", "smoothgrad"])
def test_next_token_string_keeps_the_predicted_token_along_the_path(method):
    """``target="next_token"`` scores the token predicted on the inputs at every forward pass of a
    method that runs the model on changed inputs, exactly like passing that token's id."""
    lm = models.hf_gpt2_lm()
    x = models.decoder_batch((7, 5))
    with torch.no_grad():
        logits = lm(**x, use_cache=False).logits
    last = x["attention_mask"].sum(1) - 1
    predicted = logits[torch.arange(2), last].argmax(-1).tolist()
    torch.manual_seed(0)
    named = relprop.explain(lm, x, target="next_token", method=method)
    torch.manual_seed(0)
    given = relprop.explain(lm, x, target=predicted, method=method)
    assert torch.equal(named.scores, given.scores)
    assert torch.equal(named.target_scores, given.target_scores)


class OneTokenTokenizer:
    """A tokenizer that knows three words (one id each) and splits anything else into two ids."""

    vocab = {" Paris": 11, " London": 12, " Rome": 13}
    all_special_ids = [0]

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [self.vocab[text]] if text in self.vocab else [1, 2]}


def test_language_model_token_strings():
    lm = models.hf_gpt2_lm()
    x = models.decoder_batch((7, 5))
    tok = OneTokenTokenizer()
    a = specify(" Paris", lm, tok, x["attention_mask"])
    with torch.no_grad():
        logits = lm(**x, use_cache=False).logits
    last = x["attention_mask"].sum(1) - 1
    assert torch.equal(a(logits), logits[torch.arange(2), last, 11])
    with pytest.raises(relprop.TargetError, match="2 tokens"):
        specify("Parisian", lm, tok, x["attention_mask"])
    with pytest.raises(relprop.TargetError, match="tokenizer="):
        relprop.explain(lm, x, target=" Paris")
    exp = relprop.explain(lm, x, target=contrast(" Paris", " Rome"), tokenizer=tok, method="input_x_gradient")
    assert torch.allclose(exp.target_scores, logits[torch.arange(2), last, 11] - logits[torch.arange(2), last, 13],
                          atol=1e-5)


@pytest.mark.parametrize("name", ["hf_gpt2_lm", "hf_gpt2_cls", "hf_llama"])
def test_left_padded_decoder_batch_warns(name):
    model = getattr(models, name)()
    x = models.decoder_batch((7, 5))
    left = {k: v.clone() for k, v in x.items()}
    for k in left:  # move sample 1's padding to the left
        left[k][1] = torch.roll(x[k][1], shifts=2)
    assert left["attention_mask"][1, 0] == 0 and left["attention_mask"][1, -1] == 1
    with pytest.warns(relprop.RelpropWarning, match=r"samples \[1\] are left-padded"):
        relprop.explain(model, left, method="raw_attention")
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error", relprop.RelpropWarning)
        relprop.explain(model, x, method="raw_attention")  # right padding: no warning
    bert = models.hf_bert()
    with warnings.catch_warnings():
        warnings.simplefilter("error", relprop.RelpropWarning)
        relprop.explain(bert, left, method="raw_attention", special_tokens_mask=left["attention_mask"] == 0)


def test_layer_names_the_block_of_gradcam_style_methods():
    """layer='blocks.0' (pytorch-grad-cam's target_layers) is block=0; a sub-module path names its block."""
    model = models.timm_vit_tiny()
    x = models.image_batch(model)
    for method in ("gradcam", "grads", "attention_norm"):
        by_index = relprop.explain(model, x, method=method, block=0)
        for layer in ("blocks.0", "blocks.0.norm1", "blocks.0.attn"):
            assert torch.equal(relprop.explain(model, x, method=method, layer=layer).scores, by_index.scores)
        assert not torch.equal(by_index.scores, relprop.explain(model, x, method=method).scores)
    with pytest.raises(relprop.MethodError, match=r"blocks\.0', 'blocks\.1'"):
        relprop.explain(model, x, method="gradcam", layer="head")


def test_integrated_gradients_convergence_delta(bert, batch):
    """exp.convergence_delta = Σ IG − (f(x) − f(x₀)) (captum's return_convergence_delta); it shrinks as the
    Riemann sum refines, and f(x₀) is the model's score on the baseline."""
    deltas = []
    for n in (2, 16):
        exp = relprop.explain(bert, batch, method="integrated_gradients", n_steps=n, target=1)
        assert exp.convergence_delta.shape == (2,)
        deltas.append(exp.convergence_delta.abs().max().item())
    assert deltas[1] < deltas[0]
    emb = bert.get_input_embeddings()
    with torch.no_grad():
        f_x = bert(**batch).logits[:, 1]
        hooked = emb.register_forward_hook(lambda m, i, o: torch.zeros_like(o))  # the zero baseline x₀
        try:
            f_0 = bert(**batch).logits[:, 1]
        finally:
            hooked.remove()
    # Σ of the token scores is Σ IG (the scores sum the embedding size), masked special tokens aside
    full = relprop.explain(bert, batch, method="integrated_gradients", n_steps=16, target=1,
                           special_tokens_mask=torch.zeros_like(batch["input_ids"], dtype=torch.bool))
    assert torch.allclose(full.convergence_delta, full.scores.sum(1) - (f_x - f_0), atol=1e-4)
    assert relprop.explain(bert, batch, method="input_x_gradient").convergence_delta is None
