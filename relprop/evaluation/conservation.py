"""Conservation report: where the relevance went, per attention block and end to end (CVPR 2021
Eq. 3, Lemmas 1–2).

Under a conservative preset (``"chefer2021"``), per sample, the relevance entering a block from the
output side equals the relevance leaving it at its input plus what constants inside it absorbed,
and end to end the relevance injected at the target (1) equals the relevance reaching the input
plus the relevance absorbed by constants (position embeddings, the class token, masks, …). The
report turns ``exp.conservation`` into a table: Σ relevance in, out, absorbed, and the relative
error |in − out − absorbed| / |in|, as the mean over the samples (the error also as its maximum).
The plain-LRP preset ``"lrp"`` is not conservative, and its report says so by its errors.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Sequence

import numpy as np

from ..errors import InputError
from ..explanation import Explanation
from . import _util


@dataclasses.dataclass
class ConservationRow:
    """One row: per-sample arrays [samples]."""

    name: str
    relevance_in: np.ndarray
    relevance_out: np.ndarray
    absorbed: np.ndarray

    @property
    def error(self) -> np.ndarray:
        """[samples] |in - out - absorbed| / |in|."""
        return np.abs(self.relevance_in - self.relevance_out - self.absorbed) / np.maximum(
            np.abs(self.relevance_in), 1e-12)

    def summary(self) -> Dict[str, Any]:
        err = self.error
        return {"part": self.name, "in": float(self.relevance_in.mean()), "out": float(self.relevance_out.mean()),
                "absorbed": float(self.absorbed.mean()), "mean_rel_error": float(err.mean()),
                "max_rel_error": float(err.max())}


@dataclasses.dataclass
class ConservationReport:
    """Rows: the blocks from the output to the input (the order relevance flows in), then
    ``"end to end"`` (in = injected at the target, out = reached the input)."""

    preset: str
    blocks: List[ConservationRow]
    end_to_end: ConservationRow

    @property
    def rows(self) -> List[ConservationRow]:
        return list(self.blocks) + [self.end_to_end]

    def __len__(self) -> int:
        return int(self.end_to_end.relevance_in.shape[0])

    @property
    def max_error(self) -> float:
        """The largest end-to-end relative error of any sample."""
        return float(self.end_to_end.error.max()) if len(self) else float("nan")

    def table(self) -> List[Dict[str, Any]]:
        return [r.summary() for r in self.rows]

    def to_markdown(self) -> str:
        head = "| part | Σ in | Σ out | absorbed | mean rel. error | max rel. error |\n|---|---:|---:|---:|---:|---:|"
        lines = [head]
        for r in self.table():
            lines.append(f"| {r['part']} | {r['in']:.6g} | {r['out']:.6g} | {r['absorbed']:.6g} | "
                         f"{r['mean_rel_error']:.3g} | {r['max_rel_error']:.3g} |")
        return "\n".join(lines)

    @staticmethod
    def concat(reports: Sequence["ConservationReport"]) -> "ConservationReport":
        reports = list(reports)
        if not reports:
            raise InputError("no reports to concatenate")
        names = [r.name for r in reports[0].blocks]
        for rep in reports[1:]:
            if [r.name for r in rep.blocks] != names:
                raise InputError("cannot concatenate conservation reports of different models")

        def cat(rows):
            return ConservationRow(rows[0].name, *[np.concatenate([getattr(r, f) for r in rows])
                                                   for f in ("relevance_in", "relevance_out", "absorbed")])
        blocks = [cat([rep.blocks[i] for rep in reports]) for i in range(len(names))]
        return ConservationReport(reports[0].preset, blocks, cat([rep.end_to_end for rep in reports]))

    def __repr__(self) -> str:
        return f"ConservationReport(preset='{self.preset}', samples={len(self)})\n{self.to_markdown()}"


def conservation_report(explanation: Any) -> ConservationReport:
    """The conservation table of an ``relprop.Explanation`` (or of its ``conservation``).

    Raises
    ------
    InputError
        if the method propagated no relevance (``exp.conservation`` is None: attention-only and
        gradient-only methods).
    """
    cons = explanation.conservation if isinstance(explanation, Explanation) else explanation
    if cons is None:
        name = getattr(explanation, "method", "this explanation")
        raise InputError(f"'{name}' propagated no relevance, so there is no conservation to report "
                         "(methods that use the relevance walk: transformer_attribution, lrp, partial_lrp, …)")
    blocks = [ConservationRow(b.name, _util.to_numpy(b.relevance_in).astype(np.float64),
                              _util.to_numpy(b.relevance_out).astype(np.float64),
                              _util.to_numpy(b.absorbed).astype(np.float64))
              for b in reversed(list(cons.blocks))]
    end = ConservationRow("end to end", _util.to_numpy(cons.injected).astype(np.float64),
                          _util.to_numpy(cons.input).astype(np.float64),
                          _util.to_numpy(cons.absorbed).astype(np.float64))
    return ConservationReport(cons.preset, blocks, end)
