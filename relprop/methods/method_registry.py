"""The method registry: every explanation method by name, with what it needs, what it is and
where it applies (:class:`MethodInfo`, declared by :func:`method` where the method is defined)."""
from __future__ import annotations

import dataclasses
import difflib
import html
import inspect
from typing import Callable, Dict, List, Optional, Tuple

from ..errors import MethodError


@dataclasses.dataclass(frozen=True)
class MethodInfo:
    """One registered method: ``fn(trace, **options) -> dict``, what it needs, what it is and where
    it applies, all declared by the keywords of ``method`` where the method is defined.

    Attributes
    ----------
    name, fn, description, reference
        the method, its one-line description and the paper.
    class_specific, signed
        whether its scores depend on the explained class, and may be negative.
    needs_relevance
        it reads the relevance walk (else gradients and attention only).
    preset
        the preset it uses unless one is given (``"lrp"``); None: the default.
    needs_blocks
        it reads per-block attention records.
    needs_input_gradient
        it reads the gradient at the input (``Trace.input_gradient``).
    folds
        ``head_maps(record) -> [batch, heads, N, N]``, the per-head maps of a block record
        whose rollout the method computes, when the method can be folded block by block during the
        reverse walk without keeping the records (``relprop.methods.fold_maps.RowFold``: the
        same maps the method passes to ``relprop.methods.aggregation.aggregate``); None: it
        reads the records after the walk.
    streams
        how many token streams it defines its scores on: 2 for a method with a definition
        on encoder-decoder and co-attention models (two streams joined by cross-attention: the
        bi-modal rules, or the input relevance of every stream), else 1 (refused on such models).
    no_windows
        why it does not apply to models with window attention (Swin), in words; None:
        it applies (``relprop.methods.windowed`` says how the methods read such models).
    rollout
        it multiplies (or averages) the maps of several blocks, so it needs every block to
        map the same tokens to themselves and tokens to mix nowhere but in the attention blocks
        (``relprop.methods.rollout_utils.rollout_blocks``).
    checks_only
        whether it applies to a model is judged by the checks it makes before any work,
        not by running it (``relprop.api.refusals``): its cost is in re-running the model, or it
        reads the input gradient, which a trace keeps only when a method of the call asks for it.
    head_fusions
        the values its ``head_fusion=`` option takes, for a method whose heads are not
        fused as a mean of maps (attention norms, value zeroing); None: those of
        ``relprop.methods.aggregation.HEAD_FUSIONS``, or it has no such option.
    """

    name: str
    fn: Callable
    description: str
    class_specific: bool
    signed: bool
    reference: str
    needs_relevance: bool
    preset: Optional[str] = None
    needs_blocks: bool = True
    needs_input_gradient: bool = False
    folds: Optional[Callable] = None
    streams: int = 1
    no_windows: Optional[str] = None
    rollout: bool = False
    checks_only: bool = False
    head_fusions: Optional[Tuple[str, ...]] = None

    @property
    def options(self) -> List[str]:
        """The names of the method's options (its keyword parameters after ``trace``)."""
        return [p for p in inspect.signature(self.fn).parameters if p != "trace"]


_METHODS: Dict[str, MethodInfo] = {}


def method(name: str, *, description: str, class_specific: bool, signed: bool, reference: str,
           needs_relevance: bool, preset: Optional[str] = None, needs_blocks: bool = True,
           needs_input_gradient: bool = False, folds: Optional[Callable] = None, streams: int = 1,
           no_windows: Optional[str] = None, rollout: bool = False, checks_only: bool = False,
           head_fusions: Optional[Tuple[str, ...]] = None, replace: bool = False):
    """Register an explanation method under ``name`` (see ``MethodInfo`` for the fields).

    A name registered already is an error unless ``replace=True`` (a second registration never
    silently changes what a name means); the function is returned unchanged.
    """
    if streams not in (1, 2):
        raise MethodError(f"method '{name}': streams={streams!r} is not a choice. Choices: [1, 2]")
    if folds is not None and not callable(folds):
        raise MethodError(f"method '{name}': folds must be a function head_maps(record), not {type(folds).__name__}")

    def decorate(fn):
        if name in _METHODS and not replace:
            raise MethodError(f"a method named '{name}' is registered already ({_METHODS[name].description}); pick "
                              "another name, or pass replace=True to replace it")
        _METHODS[name] = MethodInfo(name, fn, description, class_specific, signed, reference, needs_relevance,
                                    preset, needs_blocks, needs_input_gradient, folds, streams, no_windows,
                                    rollout, checks_only, None if head_fusions is None else tuple(head_fusions))
        return fn
    return decorate


def get_method(name: str) -> MethodInfo:
    """The method called ``name``; an unknown name is an error that lists the known ones."""
    try:
        return _METHODS[name]
    except (KeyError, TypeError):
        close = difflib.get_close_matches(str(name).lower(), list(_METHODS), n=1)  # ("LRP": 'lrp')
        hint = f" Did you mean '{close[0]}'?" if close else ""
        raise MethodError(f"'{name}' is not a method. Choices: {sorted(_METHODS)}.{hint}") from None


def all_methods() -> Dict[str, MethodInfo]:
    """Every registered method by name."""
    return dict(_METHODS)


class MethodTable(dict):
    """``relprop.methods()``: a dict of method name -> {description, class_specific, signed,
    reference} that prints as a table (a REPL's ``repr``, ``str``) and renders as an HTML table in a
    notebook (``_repr_html_``); as a dict it is unchanged (keys, ``in``, indexing, ``==`` a dict)."""

    COLUMNS = ("method", "class-specific", "signed", "description")

    def _rows(self):
        return [(name, "yes" if d["class_specific"] else "no", "yes" if d["signed"] else "no",
                 d["description"]) for name, d in self.items()]

    def __repr__(self) -> str:
        rows = [self.COLUMNS] + self._rows()
        widths = [max(len(r[c]) for r in rows) for c in range(3)]
        lines = ["  ".join(r[c].ljust(widths[c]) for c in range(3)) + "  " + r[3] for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths) + "  " + "-" * len(self.COLUMNS[3]))
        return "\n".join(lines) + f"\n({len(self)} methods; relprop.methods()[name]['reference'] cites each)"

    __str__ = __repr__

    def _repr_html_(self) -> str:
        esc = html.escape
        head = "".join(f"<th style='text-align: left'>{esc(c)}</th>" for c in self.COLUMNS + ("reference",))
        body = "".join("<tr>" + "".join(f"<td style='text-align: left'>{esc(str(v))}</td>"
                                        for v in row + (self[row[0]]["reference"],)) + "</tr>"
                       for row in self._rows())
        return f"<table class='relprop-methods'><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def table() -> MethodTable:
    """Every method name with its description, class-specificity, sign and reference
    (``relprop.methods()``): a ``MethodTable``, a dict that prints as a table."""
    return MethodTable({name: {"description": m.description, "class_specific": m.class_specific,
                               "signed": m.signed, "reference": m.reference}
                        for name, m in _METHODS.items()})
