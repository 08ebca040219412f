"""``Explanation.show()`` and ``Explanation.save(path)``: the renderers of :mod:`relprop.viz` for one
explanation, in Python scripts and notebooks.

Images: an overlay of the map on the input (the input as fed to the model; pass ``mean``/``std`` of the
preprocessing to show its true colours), a grid of all samples when the batch has several and no
``index`` is given. Text: coloured tokens (HTML in notebooks and ``.html`` files, rich colours in a
terminal, a drawn figure in ``.png``/``.pdf``/``.svg``); the token strings come from ``tokens=`` (one
list per sample), from ``tokenizer=`` with ``inputs=`` (the tokenizer's output that was explained), or
from the explanation itself (``exp.tokens``, remembered by :func:`relprop.explain`). Likewise the
image (``exp.image`` and its normalisation) and the class names (``exp.labels``, ``exp.target_label``):
every argument is optional after any input form ``explain()`` takes; an argument given wins.
"""
from __future__ import annotations

import os
from typing import Any, Optional, Sequence

from ..errors import InputError
from . import image as vimg
from . import text as vtext
from . import vision_text as vvt

FIGURE_SUFFIXES = (".png", ".jpg", ".jpeg", ".pdf", ".svg")


def _tokens(exp, tokens, tokenizer, inputs):
    if tokens is not None:
        rows = list(tokens)
        return [rows] if rows and isinstance(rows[0], str) else rows
    if tokenizer is not None and inputs is not None:
        ids = inputs["input_ids"] if isinstance(inputs, dict) or hasattr(inputs, "keys") else inputs
        return vtext.token_strings(tokenizer, ids)
    remembered = getattr(exp, "tokens", None)
    if remembered is not None:
        return [list(r) for r in remembered]
    raise InputError("a text explanation needs its token strings: pass tokens=[[...], ...] (one list per "
                     "sample) or tokenizer= and inputs= (the tokenizer output that was explained)")


def remembered(exp, image=None, labels=None, mean=None, std=None):
    """``image``, ``labels``, ``mean``, ``std`` as given, else what the explanation remembers
    (``exp.image`` with its ``image_mean``/``image_std``, ``exp.labels``); the remembered
    normalisation is undone only on the remembered image."""
    if image is None and getattr(exp, "image", None) is not None:
        image = exp.image
        mean = mean if mean is not None else getattr(exp, "image_mean", None)
        std = std if std is not None else getattr(exp, "image_std", None)
    return image, (labels if labels is not None else getattr(exp, "labels", None)), mean, std


def _image_figure(exp, index, image, labels, mean, std, percentile, fig=None):
    image, labels, mean, std = remembered(exp, image, labels, mean, std)
    n = exp.map.shape[0] if exp.map is not None else 0
    if index is None and n > 1:
        return vimg.grid_figure([exp], image, labels=labels, mean=mean, std=std, percentile=percentile, fig=fig)
    index = 0 if index is None else index
    img = None
    if image is not None:
        img = image[index] if (hasattr(image, "dim") and image.dim() == 4) or isinstance(image, (list, tuple)) \
            else image
    return vimg.overlay_figure(exp, index, img, labels=labels, mean=mean, std=std, percentile=percentile, fig=fig)


def save(exp, path: str, *, image: Any = None, tokens: Optional[Sequence] = None, tokenizer=None, inputs=None,
         index: Optional[int] = None, labels=None, counterfactual=None, mean=None, std=None,
         percentile: float = 99.5, merge_words: bool = True, dpi: int = 150) -> str:
    """Write ``exp`` to ``path``; the format follows the suffix.

    Images (``.png``, ``.jpg``, ``.pdf``, ``.svg``): the overlay of sample ``index`` on ``image`` (the
    batch or one image), or a grid of every sample when ``index`` is None and the batch has several.
    A vision-language model's explanation (image and prompt from one run): one row per sample (or that
    of ``index``), the image's heatmap beside the prompt's tokens coloured by their relevance
    (:func:`relprop.viz.vision_text.combined_figure`; ``tokens=``: the prompt's token strings).
    Text: ``.html`` a page with one coloured element per word (or word piece, ``merge_words=False``);
    ``.png``/``.pdf``/``.svg`` the same drawn as a figure. ``counterfactual``: an explanation of the same
    text for another class, shown beside. ``labels``: class names (``model.config.id2label``).
    Returns ``path``.
    """
    suffix = os.path.splitext(str(path))[1].lower()
    if vvt.is_vision_text(exp) and suffix in FIGURE_SUFFIXES:  # a vision-language model: image and prompt
        return vimg.save_figure(_vision_text_figure(exp, index, image, tokens, mean, std, percentile), str(path), dpi)
    if exp.modality == "vision" or exp.map is not None:
        if suffix not in FIGURE_SUFFIXES:
            raise InputError(f"cannot save an image explanation as '{suffix}': use one of {FIGURE_SUFFIXES}")
        return vimg.save_figure(_image_figure(exp, index, image, labels, mean, std, percentile), str(path), dpi)
    rows = _tokens(exp, tokens, tokenizer, inputs)
    labels = labels if labels is not None else getattr(exp, "labels", None)
    idx = None if index is None else [index]
    if suffix in (".html", ".htm"):
        if idx is not None:
            page = vtext.page_html([vtext.section_html(exp, [vtext.sample_html(
                exp, index, rows[index], labels=labels, counterfactual=counterfactual, merge_words=merge_words)])])
        else:
            page = vtext.to_html(exp, rows, labels=labels, counterfactual=counterfactual, merge_words=merge_words)
        with open(path, "w", encoding="utf-8") as f:
            f.write(page)
        return str(path)
    if suffix in FIGURE_SUFFIXES:
        fig = vtext.text_figure(exp, rows, labels=labels, counterfactual=counterfactual, merge_words=merge_words,
                                indices=idx)
        return vimg.save_figure(fig, str(path), dpi)
    raise InputError(f"cannot save a text explanation as '{suffix}': use .html or one of {FIGURE_SUFFIXES}")


def _vision_text_figure(exp, index, image, tokens, mean, std, percentile, fig=None):
    image, _, mean, std = remembered(exp, image, None, mean, std)
    return vvt.combined_figure(exp, None if index is None else [index], image, tokens=tokens, mean=mean, std=std,
                               percentile=percentile, fig=fig)


def _headless_backend():
    """matplotlib's backend when it opens no window (Agg and the file backends: a script without a display),
    else None."""
    import matplotlib
    backend = matplotlib.get_backend()
    try:
        from matplotlib.backends import BackendFilter, backend_registry
        quiet = backend_registry.list_builtin(BackendFilter.NON_INTERACTIVE)
    except ImportError:  # matplotlib < 3.9
        from matplotlib import rcsetup
        quiet = rcsetup.non_interactive_bk
    return backend if backend.lower() in {b.lower() for b in quiet} else None


def _in_notebook() -> bool:
    try:
        from IPython import get_ipython
        shell = get_ipython()
    except ImportError:
        return False
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"


def show(exp, *, image: Any = None, tokens: Optional[Sequence] = None, tokenizer=None, inputs=None,
         index: Optional[int] = None, labels=None, counterfactual=None, mean=None, std=None,
         percentile: float = 99.5, merge_words: bool = True, top: int = 5):
    """Display ``exp``: in a notebook, the overlay figure as a PNG (images, whatever matplotlib's backend) or
    the HTML tokens (text), returning None so that the cell does not show it a second time; in a terminal,
    a matplotlib window (images; where no window can open, matplotlib's backend being non-interactive, the
    figure is written to a temporary PNG and its path printed) or the tokens in colour with the top tokens
    (text). Arguments as :func:`save`. Outside a notebook returns the figure (images) or the HTML string
    (text)."""
    vision_text = vvt.is_vision_text(exp)
    if exp.modality == "vision" or exp.map is not None or vision_text:
        def draw(fig=None):
            if vision_text:
                return _vision_text_figure(exp, index, image, tokens, mean, std, percentile, fig)
            return _image_figure(exp, index, image, labels, mean, std, percentile, fig)
        if _in_notebook():
            import io

            from IPython.display import Image, display
            buffer = io.BytesIO()
            draw().savefig(buffer, format="png", bbox_inches="tight")
            display(Image(data=buffer.getvalue(), format="png"))
            return None
        import matplotlib.pyplot as plt
        fig = draw(plt.figure())
        backend = _headless_backend()
        if backend is None:
            plt.show()
        else:
            import sys
            import tempfile
            with tempfile.NamedTemporaryFile(prefix="relprop-", suffix=".png", delete=False) as f:
                fig.savefig(f, format="png", bbox_inches="tight")
            print(f"relprop: no window can open here (matplotlib's backend is {backend!r}); the figure was written "
                  f"to {f.name} (exp.save(path) writes it where you choose)", file=sys.stderr)
        return fig
    rows = _tokens(exp, tokens, tokenizer, inputs)
    labels = labels if labels is not None else getattr(exp, "labels", None)
    page = vtext.to_html(exp, rows, labels=labels, counterfactual=counterfactual, merge_words=merge_words)
    if _in_notebook():
        from IPython.display import HTML, display
        display(HTML(page))
        return None
    else:
        vtext.print_terminal(exp, rows, labels=labels, counterfactual=counterfactual, merge_words=merge_words,
                             top=top, indices=None if index is None else [index])
    return page


def overlay(exp, image: Any = None, index: int = 0, *, mean=None, std=None, signed: Optional[bool] = None,
            percentile: float = vimg.DEFAULT_PERCENTILE, cmap: Optional[str] = None, alpha: float = 0.5):
    """The picture of sample ``index``'s map as an [H, W, 3] uint8 numpy array (for notebooks and logging
    tools: ``wandb.Image(relprop.viz.overlay(exp, x))``): the same colours as ``save`` draws
    (``relprop.viz.colours``: a signed map red for, blue against, centred on 0; a non-negative map
    min-max scaled from white to red; both over a grey copy of the image; ``cmap="jet"`` blends the
    paper's colours half-and-half, as in Chefer et al. 2021, Fig. 1), without axes or colourbar. Without
    ``image`` the coloured map alone, at the size of ``exp.map``."""
    import numpy as np
    if exp.grid is None:
        raise InputError(f"explanation '{exp.method}' has no patch grid: an overlay is for image explanations; "
                         "for text use exp.words(tokenizer, inputs)")
    values = vimg.relevance_map(exp, index)
    signed = bool(exp.signed) if signed is None else signed
    img = None
    if image is None and getattr(exp, "image", None) is not None:
        image, _, mean, std = remembered(exp, None, None, mean, std)
        image = image[index]
    if image is not None:
        img = vimg.display_image(image, mean, std)
        values = vimg._resize(values, img.shape[:2])
    vmin, vmax = vimg.clip_limits(values, signed, percentile)
    rgb = vimg.blend(img, values, signed, vmin, vmax, cmap, alpha)
    return (np.clip(rgb, 0.0, 1.0) * 255).round().astype(np.uint8)


def words(exp, tokenizer=None, inputs=None, index: Optional[int] = None, *, tokens: Optional[Sequence] = None,
          merge_words: bool = True):
    """Word-level scores as ``(word, score)`` pairs: word pieces merged into words, a word's score the sum
    of its pieces' scores (relevance is additive; CVPR 2021 scores tokens, a word is the sum of its
    tokens), padding and special tokens left out. ``tokenizer`` and ``inputs`` (the batch explained) give
    the token strings, or ``tokens=`` per sample. One list per sample, or that of sample ``index``."""
    rows = _tokens(exp, tokens, tokenizer, inputs)
    picked = range(len(exp)) if index is None else [index]
    out = [[(t.text, t.score) for t in vtext.tokens_of(exp, i, rows[i], merge_words) if not t.special]
           for i in picked]
    return out if index is None else out[0]
