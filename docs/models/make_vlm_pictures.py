"""Make ``docs/models/img/vision_language_prompt.png`` and ``vision_language_generation.png`` from the tiny
randomly initialised LLaVA of ``tests/vlm_models.py`` (no download).

    PYTHONPATH=.:tests python docs/models/make_vlm_pictures.py

The image is synthetic (a bright square on a dark ramp, 32x32 in 4x4 patches of 8); the prompt is
[BOS], 3 ids, the 16 image placeholders, 3 ids. The tiny model has no tokenizer: its ids are drawn
with a made-up word per id (``WORDS``), only so that the pictures read like a prompt. Pictures:

* ``exp.save(...)`` of ``lrp`` under ``"attnlrp"``: the pixel map over the image beside the prompt's
  tokens coloured by ``exp.streams["input_ids"]`` (the 16 placeholders one grey chip: their relevance
  is the pixels');
* ``relprop.explain_generation(llava, None, prompt, max_new_tokens=3)``: the image's relevance for each
  generated token, above the matrix of the tokens each one read.

The weights are random: the pictures show the layout, not what a trained model reads.
"""
import os

import matplotlib

matplotlib.use("Agg")
import torch  # noqa: E402

import relprop  # noqa: E402
import vlm_models  # noqa: E402

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "img")
#: a made-up word per id of the tiny vocabulary (64 ids; 3 is the image placeholder)
WORDS = ["<pad>", "<s>", "</s>", "<image>"] + ["describe", "the", "picture", "what", "is", "in", "it", "a", "square",
                                               "bright", "dark", "ramp", "left", "right", "top", "corner"] * 3


class Vocabulary:
    """Names the tiny model's ids (``convert_ids_to_tokens``), as a tokenizer would."""

    def convert_ids_to_tokens(self, ids):
        return [WORDS[int(i)] if int(i) < len(WORDS) else f"#{int(i)}" for i in ids]


def main():
    model = vlm_models.llava()
    prompt = vlm_models.batch("llava", batch=1)
    prompt["input_ids"][0, 1:4] = torch.tensor([4, 8, 9])  # "describe" "is" "in"
    prompt["input_ids"][0, -3:] = torch.tensor([10, 15, 16])
    img = torch.linspace(0, 0.3, 32)[None, :].expand(32, 32).clone()
    img[8:20, 16:28] = 1.0
    prompt["pixel_values"] = (img[None, None].expand(1, 3, 32, 32) * 2 - 1).contiguous()
    vocab = Vocabulary()
    exp = relprop.explain(model, prompt, target="next_token", method="lrp", preset="attnlrp", tokenizer=vocab)
    exp.save(os.path.join(HERE, "vision_language_prompt.png"))
    gen = relprop.explain_generation(model, vocab, prompt, max_new_tokens=3)
    gen.save(os.path.join(HERE, "vision_language_generation.png"))


if __name__ == "__main__":
    main()
