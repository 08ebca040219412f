"""Make the figures of docs/models/ from tiny randomly initialised models (no download).

    PYTHONPATH=. python docs/models/make_figures.py

* ``img/translation_matrix.png``: a Marian translation model's source–target relevance matrix: the
  rows are the target tokens it is made to write (teacher-forced), the columns the source tokens and
  the earlier target tokens (``relprop.explain_generation``, AttnLRP).
* ``img/caption_maps.png``: a ViT → GPT-2 captioner's image map per caption word (the bi-modal
  gradient rollout of Chefer et al., ICCV 2021), one panel per word.
* ``img/generation.html``: the HTML heatmap of the translation matrix.

The models are random: the figures show the layout of the pictures, not what a trained model reads.
"""
import os

import torch
import transformers as tf

import relprop
from relprop.viz import colours, save_figure

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "img")


def _scaled(model, std=0.2):
    """Random weights larger than the default initialization, so that the maps are not uniform."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, std)
    return model


def translation():
    torch.manual_seed(0)
    cfg = tf.MarianConfig(vocab_size=40, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                          decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                          max_position_embeddings=32, pad_token_id=1, decoder_start_token_id=1)
    model = _scaled(tf.MarianMTModel(cfg).eval())
    src_words = ["the", "cat", "sat", "on", "the", "mat", "</s>"]
    tgt_words = ["le", "chat", "était", "sur", "le", "tapis", "</s>"]
    vocab = {w: i for i, w in enumerate(dict.fromkeys(["<pad>", "</s>"] + src_words + tgt_words))}
    words = {i: w for w, i in vocab.items()}
    src = torch.tensor([[vocab[w] for w in src_words]])
    cont = torch.tensor([vocab[w] for w in tgt_words])
    gen = relprop.explain_generation(model, None, src, target=cont)
    gen.labels = [words[int(t)] for t in gen.columns]
    gen.labels[gen.source_length] = "<start>"  # the decoder's start token (the pad id for Marian)
    gen.row_labels = [words[int(t)] for t in gen.rows]
    gen.save(os.path.join(HERE, "translation_matrix.png"))
    gen.save(os.path.join(HERE, "generation.html"))


def caption():
    enc = tf.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                       image_size=32, patch_size=8, num_channels=3)
    dec = tf.GPT2Config(vocab_size=40, n_embd=32, n_layer=2, n_head=4, n_positions=32, add_cross_attention=True,
                        bos_token_id=0, eos_token_id=1)
    cfg = tf.VisionEncoderDecoderConfig.from_encoder_decoder_configs(enc, dec)
    cfg.decoder_start_token_id, cfg.pad_token_id = 0, 1
    model = _scaled(tf.VisionEncoderDecoderModel(cfg).eval())
    torch.manual_seed(1)
    image = torch.zeros(1, 3, 32, 32)
    image[:, 0, 4:20, 6:22] = 1.0  # a red square
    image[:, 2, 18:30, 16:30] = 1.0  # a blue one
    words = ["a", "red", "and", "blue", "square"]
    ids = torch.arange(2, 2 + len(words))
    g = len(words)
    dec_in = torch.cat([torch.tensor([0]), ids[:-1]])[None].expand(g, -1)
    rows = torch.arange(g)

    def score(o):  # row t: the logit of word t at position t (teacher-forced)
        return o.logits[rows, rows, ids]

    exp = relprop.explain(model, {"pixel_values": image.expand(g, -1, -1, -1), "decoder_input_ids": dec_in},
                          target=score, method="gradient_rollout")
    from matplotlib.figure import Figure
    fig = Figure(figsize=(2.0 * (g + 1), 2.3))
    ax = fig.add_subplot(1, g + 1, 1)
    ax.imshow(image[0].permute(1, 2, 0).numpy())
    ax.set_title("image", fontsize=9)
    ax.axis("off")
    for t, w in enumerate(words):
        ax = fig.add_subplot(1, g + 1, t + 2)
        ax.imshow(exp.map[t].numpy(), cmap=colours.colormap(signed=False))
        ax.set_title(f"'{w}'", fontsize=9)
        ax.axis("off")
    fig.tight_layout()
    save_figure(fig, os.path.join(HERE, "caption_maps.png"))


if __name__ == "__main__":
    os.makedirs(HERE, exist_ok=True)
    translation()
    caption()
    print("wrote", sorted(os.listdir(HERE)))
