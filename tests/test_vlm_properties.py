"""Property tests for vision-language models (tests/vlm_models.py): hypothesis varies the pixels, the
prompt's words and the explained token; the model is built (and so captured) once per module, every
drawn input has the same shapes, so each property costs one capture (40-150 s on two busy cores) and a
few seconds per example.

* conservation: Σ pixels + Σ prompt tokens + absorbed = the explained logit (``lrp``, ``"attnlrp"``,
  the layer-by-layer walk), the image placeholders 0, the image reaching the score;
* batch invariance: a sample explained in a batch of two equals it explained alone;
* the model untouched by every call.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

import relprop
import vlm_models as V
from relprop.targets import next_token
from snapshot import assert_same, snapshot

pytestmark = pytest.mark.slow  # each module fixture captures a vision-language model

BEFORE, AFTER = 3, 3
WORDS = BEFORE + AFTER  # the prompt's ids other than BOS and the placeholders
PROPERTY = settings(max_examples=4, deadline=None)


@pytest.fixture(scope="module")
def models():
    return V.model_cache({f: b for f, (b, _) in V.FAMILIES.items()}, V.batch)


def _inputs(family: str, seed: int, words, batch: int = 2):
    """vlm_models.batch's layout with the drawn pixels (a seed) and words (ids >= FIRST_ID)."""
    out = V.batch(family, batch=batch, before=BEFORE, after=AFTER, seed=seed)
    ids = out["input_ids"]
    free = (ids != V.IMAGE_TOKEN) & (torch.arange(ids.shape[1]) > 0)
    ids[free] = torch.tensor(words[:batch * int(free[0].sum())], dtype=ids.dtype)
    return out


#: the explained tokens: any id but the padding id 0, whose embedding row is zero (Gemma ties its output to
#: its embedding, so logit 0 is identically 0 and nothing is relevant)
TOKENS = st.lists(st.integers(1, V.VOCAB - 1), min_size=2, max_size=2)


def _words(batch: int = 2):
    return st.lists(st.integers(V.FIRST_ID, V.VOCAB - 1), min_size=batch * WORDS, max_size=batch * WORDS)


@pytest.mark.parametrize("family", ["llava", "gemma3"])
@PROPERTY
@given(seed=st.integers(0, 2 ** 16), words=_words(), tokens=TOKENS)
def test_conservation_and_model_untouched(models, family, seed, words, tokens):
    model = models(family)
    inputs = _inputs(family, seed, words)
    before = snapshot(model)
    e = relprop.explain(model, inputs, target=next_token(inputs["attention_mask"], tokens), method="lrp",
                        preset="attnlrp", fast_path=False)
    assert_same(before, snapshot(model))
    logits = e.logits[torch.arange(2), -1, torch.tensor(tokens)]
    torch.testing.assert_close(e.target_scores, logits, rtol=1e-6, atol=1e-7)
    pixels, prompt = e.input_relevance.flatten(1).sum(1), e.streams["input_ids"].sum(1)
    absorbed = e.conservation.injected - e.conservation.input
    torch.testing.assert_close(pixels + prompt + absorbed, e.target_scores, rtol=1e-5, atol=1e-5)
    assert float(e.conservation.error.max()) < 1e-5
    assert float(e.streams["input_ids"][inputs["input_ids"] == V.IMAGE_TOKEN].abs().max()) == 0.0
    assert float(pixels.abs().min()) > 0
    torch.testing.assert_close(e.scores.sum(1), pixels, rtol=1e-5, atol=1e-7)  # patches: the pixels summed


@PROPERTY
@given(seed=st.integers(0, 2 ** 16), words=_words(), tokens=TOKENS)
def test_batch_invariance(models, seed, words, tokens):
    model = models("llava")
    inputs = _inputs("llava", seed, words)
    before = snapshot(model)
    both = relprop.explain(model, inputs, target=next_token(inputs["attention_mask"], tokens), method="lrp",
                           preset="attnlrp")
    for i in range(2):
        one_in = {k: v[i:i + 1] for k, v in inputs.items()}
        one = relprop.explain(model, one_in, target=next_token(one_in["attention_mask"], tokens[i]), method="lrp",
                              preset="attnlrp")
        scale = float(both.input_relevance[i].abs().max())
        torch.testing.assert_close(one.input_relevance, both.input_relevance[i:i + 1], rtol=0, atol=1e-5 * scale)
        scale = float(both.streams["input_ids"][i].abs().max())
        torch.testing.assert_close(one.streams["input_ids"], both.streams["input_ids"][i:i + 1], rtol=0,
                                   atol=1e-5 * scale)
    assert_same(before, snapshot(model))
