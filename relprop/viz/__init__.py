"""Pictures of explanations, all in one colour language (:mod:`.colours`: red for, blue against, white
none): image overlays and method grids (:mod:`.image`), HTML pages, drawn text and
coloured terminal output for text (:mod:`.text`), the per-block heatmap of a text's relevance
(:mod:`.blocks`), one panel per attention head (:mod:`.heads`).

matplotlib and Pillow draw; nothing needs LaTeX or a display (figures are ``matplotlib.figure.Figure``
objects drawn with the Agg canvas; save them with :func:`save_figure`).
"""
from . import colours
from .image import (DEFAULT_PERCENTILE, DIVERGING_CMAP, SEQUENTIAL_CMAP, clip_limits, display_image,
                    draw_overlay, grid_figure, overlay_figure, save_figure)
from .text import (colour, merge_word_pieces, page_html, print_terminal, rich_text, sample_html, section_html,
                   text_figure, to_html, token_strings, tokens_of, top_tokens)
from .blocks import block_scores, blocks_figure
from .api import overlay, words
from .heads import head_rows, heads_figure

__all__ = [
    "colours",
    "DEFAULT_PERCENTILE", "DIVERGING_CMAP", "SEQUENTIAL_CMAP", "clip_limits", "display_image", "draw_overlay",
    "grid_figure", "overlay_figure", "save_figure",
    "colour", "merge_word_pieces", "page_html", "print_terminal", "rich_text", "sample_html", "section_html",
    "text_figure", "to_html", "token_strings", "tokens_of", "top_tokens",
    "block_scores", "blocks_figure", "head_rows", "heads_figure", "overlay", "words",
]
