"""explain_generation: every generated token explained, equal to explaining each step by hand on
the teacher-forced prefix with the next-token target; contrastive rows; the pictures."""
import pytest
import torch
import transformers as tf

import relprop
from relprop.targets import next_token

import two_stream_models as M


def _gpt2():
    torch.manual_seed(0)
    cfg = tf.GPT2Config(vocab_size=64, n_embd=16, n_layer=2, n_head=2, n_positions=32, bos_token_id=0,
                        eos_token_id=None)
    return tf.GPT2LMHeadModel(cfg).eval()


def test_decoder_only_generation_equals_each_step_by_hand():
    model = _gpt2()
    prompt = torch.randint(1, 64, (1, 5), generator=torch.Generator().manual_seed(3))
    gen = relprop.explain_generation(model, None, prompt, max_new_tokens=4)
    assert gen.matrix.shape == (4, 8) and gen.source_length == 5
    seq = prompt
    for t, tok in enumerate(gen.rows):
        by_hand = relprop.explain(model, {"input_ids": seq}, target=next_token(), method="lrp", preset="attnlrp")
        assert int(by_hand.logits[0, -1].argmax()) == int(tok)  # greedy: the step's prediction is the generated token
        torch.testing.assert_close(gen.matrix[t, :seq.shape[1]], by_hand.scores[0].float(), rtol=1e-4, atol=1e-7)
        assert bool((gen.matrix[t, seq.shape[1]:] == 0).all())
        seq = torch.cat([seq, tok.view(1, 1)], 1)


def test_encoder_decoder_fixed_continuation_and_contrast_equal_each_step_by_hand():
    model = M.bart()
    src = torch.randint(4, 64, (1, 6), generator=torch.Generator().manual_seed(4))
    cont = torch.tensor([7, 9, 11])
    start = model.config.decoder_start_token_id
    for contrast in (None, 5):
        gen = relprop.explain_generation(model, None, src, target=cont, contrast=contrast, method="gradient_rollout",
                                         preset=None)
        assert gen.matrix.shape == (3, 6 + 3)
        for t in range(3):
            dec = torch.tensor([[start] + cont[:t].tolist()])

            def score(o, tok=int(cont[t])):
                s = o.logits[:, -1, tok]
                return s if contrast is None else s - o.logits[:, -1, contrast]

            by_hand = relprop.explain(model, {"input_ids": src, "decoder_input_ids": dec}, target=score,
                                      method="gradient_rollout")
            row = torch.cat([by_hand.streams["input_ids"][0], by_hand.streams["decoder_input_ids"][0]])
            torch.testing.assert_close(gen.matrix[t, :6 + t + 1], row.float(), rtol=1e-4, atol=1e-7)


def test_generation_pictures(tmp_path):
    gen = relprop.explain_generation(_gpt2(), None, torch.tensor([[3, 4, 5]]), max_new_tokens=2)
    html = gen.html()
    assert html.count("<tr>") == 3 and html.count("<td") == 2 * 4  # 2 rows x (3 prompt + 1 generated) cells
    png = gen.save(str(tmp_path / "g.png"))
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_image_to_text_generation_equals_each_step_by_hand():
    model = M.vision_encoder_decoder()
    image = M.inputs_for("vision_encoder_decoder", batch=1)["pixel_values"]
    cont = torch.tensor([5, 6, 7])
    gen = relprop.explain_generation(model, None, image, target=cont, method="gradient_rollout", preset=None)
    assert gen.source_length == 16 and gen.matrix.shape == (3, 16 + 3)  # 4x4 patches, start + 2 earlier tokens
    for t in range(3):
        dec = torch.tensor([[0] + cont[:t].tolist()])
        by_hand = relprop.explain(model, {"pixel_values": image, "decoder_input_ids": dec},
                                  target=lambda o, tok=int(cont[t]): o.logits[:, -1, tok], method="gradient_rollout")
        row = torch.cat([by_hand.streams["pixel_values"][0], by_hand.streams["decoder_input_ids"][0]])
        torch.testing.assert_close(gen.matrix[t, :16 + t + 1], row.float(), rtol=1e-4, atol=1e-7)


def test_chunked_copies_equal_one_batched_call(monkeypatch):
    """The teacher-forced copies explained in chunks (``batch_size``, or the default chunk of about
    TOKENS_PER_CALL tokens) give the rows of one call over every copy; each chunk's Explanation is kept."""
    model = _gpt2()
    prompt = torch.randint(1, 64, (1, 6), generator=torch.Generator().manual_seed(5))
    cont = torch.tensor([7, 9, 11, 13, 15])
    one = relprop.explain_generation(model, None, prompt, target=cont, contrast=3, batch_size=5)
    assert isinstance(one.explanation, relprop.Explanation) and len(one.explanation) == 5
    two = relprop.explain_generation(model, None, prompt, target=cont, contrast=3, batch_size=2)
    assert [len(e) for e in two.explanation] == [2, 2, 1]
    torch.testing.assert_close(two.matrix, one.matrix, rtol=1e-5, atol=1e-7)
    assert torch.equal(two.rows, one.rows) and torch.equal(two.columns, one.columns)
    monkeypatch.setattr(relprop.generation, "TOKENS_PER_CALL", 3 * 10)  # 10 tokens per copy: 3 copies a call
    auto = relprop.explain_generation(model, None, prompt, target=cont, contrast=3)
    assert [len(e) for e in auto.explanation] == [3, 2]
    torch.testing.assert_close(auto.matrix, one.matrix, rtol=1e-5, atol=1e-7)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(relprop.OptionError, match="batch_size"):
            relprop.explain_generation(model, None, prompt, target=cont, batch_size=bad)


def test_chunked_encoder_decoder_equals_one_batched_call():
    model = M.bart()
    src = torch.randint(4, 64, (1, 6), generator=torch.Generator().manual_seed(4))
    cont = torch.tensor([7, 9, 11])
    one = relprop.explain_generation(model, None, src, target=cont, method="gradient_rollout", preset=None)
    each = relprop.explain_generation(model, None, src, target=cont, method="gradient_rollout", preset=None,
                                      batch_size=1)
    assert len(each.explanation) == 3 and each.source_length == one.source_length == 6
    torch.testing.assert_close(each.matrix, one.matrix, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("prompt, says", [
    # pixel_values for a model that is no vision-language model: generating from input_ids alone would be another
    # prompt (a vision-language model's image prompt is explained with its image: tests/test_vlm_generation.py)
    ({"input_ids": torch.tensor([[3, 4, 5]]), "pixel_values": torch.zeros(1, 3, 8, 8)},
     r"drop.*pixel_values.*GPT2LMHeadModel is not a vision-language model"),
    ({"input_ids": torch.tensor([[3, 4, 5]]), "attention_mask": torch.tensor([[0, 1, 1]])}, "masks some of its"),
    ({"attention_mask": torch.tensor([[1, 1, 1]])}, "needs its 'input_ids'"),
])
def test_a_dict_prompt_is_never_cut_down_silently(prompt, says):
    with pytest.raises(relprop.InputError, match=says):
        relprop.explain_generation(_gpt2(), None, prompt, max_new_tokens=2)


def test_a_tokenizers_output_is_a_prompt():
    """A BatchEncoding (a mapping, not a dict) with an all-ones mask explains like its ids."""
    ids = torch.tensor([[3, 4, 5]])
    enc = tf.BatchEncoding({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    model = _gpt2()
    a = relprop.explain_generation(model, None, enc, max_new_tokens=2)
    b = relprop.explain_generation(model, None, ids, max_new_tokens=2)
    assert torch.equal(a.matrix, b.matrix) and torch.equal(a.rows, b.rows) and torch.equal(a.columns, b.columns)
