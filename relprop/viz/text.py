"""Text explanations as HTML pages and coloured terminal output.

Each token (or word, when word pieces are merged) is one element whose background colour says how much
it drove the explained class, in relprop's one colour language (:mod:`relprop.viz.colours`, the same as
the image overlays and heatmaps): red for relevance that supports it, blue for relevance that speaks
against it (signed methods), white for none. Colours are scaled per sample by the largest |score| of
its tokens. In a terminal the colours follow the terminal: the map itself in true colour, its nearest
of the 256 colours, and in a 16-colour terminal red and blue backgrounds (:func:`colours.terminal16`).
Special tokens ([CLS], [SEP], ...) are shown grey and uncoloured (their scores are not meaningful,
``exp.mask`` is False there); padding is left out.

Given a second explanation of the same inputs for another class (``counterfactual=``), each sample shows
both side by side: what drove the predicted class, and what would drive the other one.
"""
from __future__ import annotations

import dataclasses
import html as _html
from typing import TYPE_CHECKING, List, Optional, Sequence

if TYPE_CHECKING:  # numpy is imported where it is used: an optional dependency (relprop[viz])
    import numpy as np

from ..errors import InputError
from . import colours
from .names import target_caption

#: word-piece markers: BERT's continuation prefix, and the word-start prefixes of BPE / SentencePiece
CONTINUATION = "##"
WORD_START = ("Ġ", "▁")


@dataclasses.dataclass
class Token:
    text: str  # what is displayed
    score: float
    special: bool  # a special token (no colour)
    pieces: int = 1  # how many word pieces were merged into it


def signed_score(value: float) -> str:
    """A word's score for people: three significant digits, the sign always, trailing zeros kept (+1.00,
    not +1; +0.914; +24.2)."""
    text = format(float(value), "+#.3g")
    return text[:-1] if text.endswith(".") else text


def token_strings(tokenizer, input_ids) -> List[List[str]]:
    """Per sample, the token strings of ``input_ids`` ([batch, positions] or [positions])."""
    ids = input_ids.tolist() if hasattr(input_ids, "tolist") else list(input_ids)
    if ids and not isinstance(ids[0], (list, tuple)):
        ids = [ids]
    return [tokenizer.convert_ids_to_tokens(row) for row in ids]


def _row(x, index: int) -> np.ndarray:
    import numpy as np
    if hasattr(x, "detach"):
        x = x.detach().float().cpu().numpy() if x.dtype.is_floating_point else x.detach().cpu().numpy()
    return np.asarray(x)[index]


def tokens_of(exp, index: int, tokens: Sequence[str], merge_words: bool = False,
              keep_padding: bool = False) -> List[Token]:
    """The tokens of sample ``index`` with their scores, padding left out, word pieces optionally merged
    into words (a word's score is the sum of its pieces' scores: relevance is additive).

    ``tokens``: the sample's token strings (one per position of ``exp.scores``).
    """
    import numpy as np
    scores = _row(exp.scores, index)
    mask = _row(exp.mask, index) if exp.mask is not None else np.ones_like(scores, dtype=bool)
    if len(tokens) != len(scores):
        raise InputError(f"{len(tokens)} token strings for {len(scores)} scores in sample {index}")
    out: List[Token] = []
    for tok, s, m in zip(tokens, scores, mask):
        tok = str(tok)
        if not m and not keep_padding and _is_padding(tok):
            continue
        out.append(Token(tok, float(s) if m else 0.0, not bool(m)))
    return merge_word_pieces(out) if merge_words else [dataclasses.replace(t, text=_clean(t.text)) for t in out]


#: token strings of padding, left out of the display
PAD_TOKENS = {"[PAD]", "<pad>", "<PAD>"}


def _is_padding(tok: str) -> bool:
    return tok in PAD_TOKENS


def _clean(piece: str) -> str:
    if piece.startswith(CONTINUATION) and len(piece) > 2:
        return piece[2:]
    for p in WORD_START:
        if piece.startswith(p):
            return piece[len(p):] or piece
    return piece


def merge_word_pieces(tokens: List[Token]) -> List[Token]:
    """Merge word pieces into words: BERT's ``##`` pieces join the piece before them; with BPE or
    SentencePiece (``Ġ``/``▁`` marks a word start) a piece without the mark joins the one before.
    Special tokens are never merged."""
    prefix_style = any(t.text.startswith(WORD_START) for t in tokens if not t.special)
    words: List[Token] = []
    for t in tokens:
        if t.special:
            words.append(t)
            continue
        if prefix_style:
            joins = not t.text.startswith(WORD_START)
        else:
            joins = t.text.startswith(CONTINUATION)
        if joins and words and not words[-1].special:
            w = words[-1]
            words[-1] = Token(w.text + _clean(t.text), w.score + t.score, False, w.pieces + 1)
        else:
            words.append(Token(_clean(t.text), t.score, False))
    return words


def colour(value: float) -> tuple:
    """RGB (0-255) of a score scaled to [-1, 1]: white at 0, red for positive, blue for negative
    (:func:`relprop.viz.colours.rgb`)."""
    return colours.rgb(value)


def scale_of(tokens: List[Token]) -> float:
    """The per-sample colour scale: the largest |score| of the non-special tokens (1 if all are 0)."""
    m = max((abs(t.score) for t in tokens if not t.special), default=0.0)
    return m if m > 0 else 1.0


def _hex(rgb) -> str:
    return "#%02x%02x%02x" % rgb


def _header(exp, index: int, labels, role: str) -> str:
    caption = target_caption(exp, index, labels)
    if caption.startswith("score "):  # a score function without a name
        return f"{role}: the target function's score ({float(exp.target_scores[index]):.3g})"
    return f"{role}: {caption}"


_STYLE = """
body { font-family: -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.25em; } h2 { font-size: 1.05em; margin-top: 1.6em; border-bottom: 1px solid #ddd; }
.legend { font-size: 0.85em; color: #555; }
.legend span { padding: 0 0.4em; border-radius: 3px; }
.sample { display: flex; flex-wrap: wrap; gap: 1.5em; margin: 0.8em 0; padding: 0.6em 0;
          border-bottom: 1px solid #f0f0f0; }
.explanation { flex: 1 1 28em; }
.caption { flex: 1 1 100%; font-size: 0.8em; color: #888; }
.header { font-size: 0.85em; color: #444; margin-bottom: 0.3em; }
.header b { color: #000; }
.tokens { line-height: 2.0; }
.tok { padding: 0.15em 0.2em; margin: 0 0.05em; border-radius: 3px; white-space: pre; }
.tok.special { color: #999; font-size: 0.8em; background-color: #f3f3f3; }
"""


#: inline styles of a token (the page's stylesheet says the same; a notebook output has no stylesheet)
_TOKEN_STYLE = "padding: 0.15em 0.2em; margin: 0 0.05em; border-radius: 3px; white-space: pre"
_SPECIAL_STYLE = "color: #999; font-size: 0.8em; background-color: #f3f3f3"


def tokens_html(tokens: List[Token]) -> str:
    """One ``<span class="tok">`` per token, its background the colour of its score scaled by the
    sample's largest |score| (:func:`scale_of`), its text escaped; special tokens grey. Styled inline:
    the same in a page and in a notebook."""
    s = scale_of(tokens)
    parts = []
    for t in tokens:
        text = _html.escape(t.text)
        if t.special:
            parts.append(f'<span class="tok special" title="special token" style="{_TOKEN_STYLE}; {_SPECIAL_STYLE}">'
                         f'{text}</span>')
            continue
        rgb = colour(t.score / s)
        title = f"{t.score:+.4g}" + (f" ({t.pieces} word pieces)" if t.pieces > 1 else "")
        parts.append(f'<span class="tok" data-score="{t.score:.6g}" title="{title}" '
                     f'style="background-color: rgb({rgb[0]}, {rgb[1]}, {rgb[2]}); color: {colours.ink(rgb)}; '
                     f'{_TOKEN_STYLE}">{text}</span>')
    return " ".join(parts)


def _as_list(x) -> list:
    if x is None:
        return []
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _token_rows(tokens, n: int) -> List[Sequence[str]]:
    if tokens is None:
        raise InputError("text rendering needs the token strings: pass tokens= (a list of strings per "
                         "sample, e.g. relprop.viz.token_strings(tokenizer, inputs['input_ids']))")
    rows = list(tokens)
    if rows and isinstance(rows[0], str):
        rows = [rows]
    if len(rows) != n:
        raise InputError(f"tokens has {len(rows)} samples, the explanation {n}")
    return rows


def sample_html(exp, index: int, tokens: Sequence[str], *, labels=None, counterfactual=None,
                merge_words: bool = True, caption: Optional[str] = None, extra: Optional[str] = None) -> str:
    """One sample's ``<div class="sample">``: its tokens coloured for the explained class, and beside them
    those for ``counterfactual`` (an explanation of the same sample for another class) when given."""
    toks = tokens_of(exp, index, tokens, merge_words)
    head = _html.escape(_header(exp, index, labels, "explained"))
    cells = [f'<div class="explanation predicted"><div class="header">{_bold_label(head)}'
             f'{_html.escape(extra or "")}</div><div class="tokens">{tokens_html(toks)}</div></div>']
    if counterfactual is not None:
        ctoks = tokens_of(counterfactual, index, tokens, merge_words)
        chead = _html.escape(_header(counterfactual, index, labels, "counterfactual"))
        cells.append(f'<div class="explanation counterfactual"><div class="header">{_bold_label(chead)}</div>'
                     f'<div class="tokens">{tokens_html(ctoks)}</div></div>')
    cap = f'<div class="caption">{_html.escape(caption)}</div>' if caption else ""
    return f'<div class="sample" data-index="{index}">{cap}{"".join(cells)}</div>'


def section_html(exp, rows: Sequence[str]) -> str:
    """A method's ``<h2>`` heading followed by its samples' rows (from :func:`sample_html`)."""
    kind = "signed" if exp.signed else "non-negative"
    spec = "class-specific" if exp.class_specific else "class-agnostic"
    return (f'<section class="method" data-method="{_html.escape(exp.method)}"><h2>{_html.escape(exp.method)} '
            f'<small>({kind}, {spec})</small></h2>\n' + "\n".join(rows) + "\n</section>")


def page_html(sections: Sequence[str], title: Optional[str] = None, note: Optional[str] = None) -> str:
    """A standalone HTML page (inline CSS, no scripts, nothing fetched) of sections from
    :func:`section_html`, with a colour legend."""
    title = title or "relprop explanation"
    pos, neg, weak = _hex(colour(1.0)), _hex(colour(-1.0)), _hex(colour(0.35))
    pos_ink, neg_ink = colours.ink(colour(1.0)), colours.ink(colour(-1.0))
    body = [f"<h1>{_html.escape(title)}</h1>"]
    if note:
        body.append(f'<p class="legend">{_html.escape(note)}</p>')
    body.append('<p class="legend">Colour = relevance for the class named above the tokens, scaled per '
                f'sentence: <span style="background-color: {pos}; color: {pos_ink}">supports it</span> '
                f'<span style="background-color: {weak}">a little</span> '
                f'<span style="background-color: {neg}; color: {neg_ink}">speaks against it</span> '
                '(signed methods only). '
                'Hover a token for its score; a word\'s score is the sum of its word pieces\'.</p>')
    body.extend(sections)
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{_html.escape(title)}</title><style>{_STYLE}</style></head>"
            "<body>\n" + "\n".join(body) + "\n</body></html>\n")


def to_html(exps, tokens, *, labels=None, counterfactual=None, merge_words: bool = True,
            title: Optional[str] = None, texts: Optional[Sequence[str]] = None, note: Optional[str] = None) -> str:
    """A standalone HTML page: one section per explanation in ``exps`` (e.g. one per method), one row per
    sample, one ``<span class="tok">`` per token (or word) coloured by its score.

    Parameters
    ----------
    exps : an Explanation, or a list of them (of the same inputs).
    tokens : per sample, the token strings (``token_strings(tokenizer, input_ids)``).
    labels : class names (``model.config.id2label`` or a list) for the headers.
    counterfactual : an Explanation (or one per entry of ``exps``) of the same inputs for another class,
        shown beside each sample.
    merge_words : merge word pieces into words (scores summed).
    texts : the input texts, shown as each row's caption.
    """
    exps = _as_list(exps)
    cfs = _as_list(counterfactual)
    if len(cfs) == 1 and len(exps) > 1:
        cfs = cfs * len(exps)
    if cfs and len(cfs) != len(exps):
        raise InputError(f"{len(cfs)} counterfactual explanations for {len(exps)} explanations")
    sections = []
    for k, e in enumerate(exps):
        rows = _token_rows(tokens, len(e))
        cf = cfs[k] if cfs else None
        samples = [sample_html(e, i, rows[i], labels=labels, counterfactual=cf, merge_words=merge_words,
                               caption=f"{i + 1}. {texts[i]}" if texts is not None and i < len(texts) else None)
                   for i in range(len(e))]
        sections.append(section_html(e, samples))
    return page_html(sections, title, note)


def _bold_label(header: str) -> str:
    role, _, rest = header.partition(": ")
    return f"{role}: <b>{rest}</b>" if rest else header


def rich_text(tokens: List[Token], color_system: Optional[str] = "auto"):
    """The tokens with their background colours (:mod:`relprop.viz.colours`), for a rich console.

    ``color_system``: rich's name of the terminal's colours. ``"standard"``/``"windows"`` (16 colours):
    :func:`colours.terminal16` styles (red for, blue against, none near 0); ``"truecolor"``/``"256"``:
    the map's own colours (rich shows their nearest of 256 in a 256-colour terminal); both return a
    ``rich.text.Text``. ``"auto"``: a :class:`TerminalTokens` that picks one of these when printed, by
    the console that prints it."""
    if color_system == "auto":
        return TerminalTokens(tokens)
    from rich.style import Style
    from rich.text import Text
    s = scale_of(tokens)
    sixteen = color_system in ("standard", "windows")
    out = Text()
    for j, t in enumerate(tokens):
        if j:
            out.append(" ")
        if t.special:
            out.append(t.text, style="dim")
        elif sixteen:
            out.append(t.text, style=colours.terminal16(t.score / s) or "")
        else:
            rgb = colour(t.score / s)
            out.append(t.text, style=Style(color=colours.ink(rgb), bgcolor=_hex(rgb)))
    return out


class TerminalTokens:
    """Coloured tokens for ``rich``'s ``console.print``: styled for the printing console's colours when
    printed (:func:`rich_text` with its ``color_system``)."""

    def __init__(self, tokens: List[Token]):
        self.tokens = list(tokens)

    def __rich_console__(self, console, options):
        yield rich_text(self.tokens, console.color_system or "truecolor")


def top_tokens(tokens: List[Token], k: int = 5) -> List[Token]:
    """The ``k`` non-special tokens with the largest scores."""
    return sorted((t for t in tokens if not t.special), key=lambda t: -t.score)[:k]


def print_terminal(exp, tokens, *, labels=None, counterfactual=None, merge_words: bool = True, top: int = 5,
                   console=None, indices: Optional[Sequence[int]] = None) -> None:
    """Print each sample's tokens coloured by relevance (rich), with the explained class and the top
    tokens; with ``counterfactual``, the other class's explanation below it."""
    from rich.console import Console
    console = console or Console(highlight=False)
    rows = _token_rows(tokens, len(exp))
    for i in (range(len(exp)) if indices is None else indices):
        for e, role in ((exp, "explained"), (counterfactual, "counterfactual")):
            if e is None:
                continue
            toks = tokens_of(e, i, rows[i], merge_words)
            console.print(f"  [bold]{_header(e, i, labels, role)}[/bold]  ({e.method})")
            console.print(rich_text(toks, console.color_system or "truecolor"), soft_wrap=False)
            best = ", ".join(f"{t.text} {signed_score(t.score)}" for t in top_tokens(toks, top))
            console.print(f"  top: {best}", highlight=False)
        console.print()


def text_figure(exp, tokens, *, labels=None, counterfactual=None, merge_words: bool = True,
                indices: Optional[Sequence[int]] = None, width: float = 8.0, fontsize: float = 11.0, fig=None):
    """The coloured tokens drawn with matplotlib (for a PNG/PDF of a text explanation): one paragraph per
    sample (and per counterfactual), each headed by the class it explains, wrapped at ``width`` inches."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    rows = _token_rows(tokens, len(exp))
    indices = list(range(len(exp))) if indices is None else list(indices)
    paras = []
    for i in indices:
        for e, role in ((exp, "explained"), (counterfactual, "counterfactual")):
            if e is not None:
                paras.append((f"{_header(e, i, labels, role)}  [{e.method}]", tokens_of(e, i, rows[i], merge_words)))
    fig = fig or Figure(figsize=(width, 1.0), dpi=100)
    canvas = FigureCanvasAgg(fig) if fig.canvas is None or type(fig.canvas).__name__ == "FigureCanvasBase" \
        else fig.canvas
    renderer = canvas.get_renderer()
    dpi = fig.dpi
    margin, gap, line_h = 0.15 * dpi, 0.06 * dpi, fontsize * 2.0 * dpi / 72
    max_x = width * dpi - margin
    placed, y = [], margin
    for head, toks in paras:
        placed.append(("head", head, margin, y, None))
        y += line_h * 0.9
        x = margin
        s = scale_of(toks)
        for t in toks:
            probe = fig.text(0, 0, t.text, fontsize=fontsize * (0.8 if t.special else 1.0))
            w = probe.get_window_extent(renderer).width + 0.1 * dpi
            probe.remove()
            if x + w > max_x and x > margin:
                x, y = margin, y + line_h
            placed.append(("tok", t.text, x, y, None if t.special else colour(t.score / s)))
            x += w + gap
        y += line_h * 1.5
    height_px = y + margin
    fig.set_size_inches(width, height_px / dpi)
    for kind, text, x, yy, rgb in placed:
        fx, fy = x / (width * dpi), 1 - (yy + line_h * 0.5) / height_px
        if kind == "head":
            fig.text(fx, fy, text, fontsize=fontsize * 0.85, weight="bold", va="center")
        elif rgb is None:
            fig.text(fx, fy, text, fontsize=fontsize * 0.8, color="#999999", va="center")
        else:
            fig.text(fx, fy, text, fontsize=fontsize, va="center", color=colours.ink(rgb),
                     bbox=dict(boxstyle="round,pad=0.2", fc=tuple(c / 255 for c in rgb), ec="none"))
    return fig
