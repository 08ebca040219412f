"""Reports of an :class:`EvaluationResult`: a markdown file and a CSV table with one row per method,
the perturbation curves as CSV and as a matplotlib plot.

Columns (dataset averages; ↑ higher is better, ↓ lower is better):

=====================  ==================================================================
``positive_auc`` ↓     area under the top-1 accuracy curve, most relevant removed first
``negative_auc`` ↑     the same, least relevant removed first (CVPR 2021 Table 1)
``pixel_accuracy`` ↑   map thresholded at its mean vs. the mask (CVPR 2021 Table 2)
``miou`` ↑             mean IoU of foreground and background, per image, averaged
``map`` ↑              mean over images of the soft map's average precision
``token_f1@k`` ↑       F1 of the top-k tokens against the rationale (CVPR 2021 Fig. 4)
``precision@k`` ↑      share of the top-k tokens in the rationale (AttCAT §5.3)
``aopc`` ↑             mean probability drop, top 0–100 % tokens deleted (AttCAT Eq. 13)
``log_odds`` ↓         mean log(p(ŷ|x̃)/p(ŷ|x)), top 0–100 % tokens → [PAD] (AttCAT Eq. 14)
``kendall_tau`` ↓      Kendall-τ between the token scores of two classes (AttCAT Eq. 15)
``conservation_error`` largest end-to-end relative conservation error of the method's preset
=====================  ==================================================================
"""
from __future__ import annotations

import csv
import math
import os
from typing import Any, Dict, List

import numpy as np

DIRECTION = {"positive_auc": "↓", "negative_auc": "↑", "pixel_accuracy": "↑", "miou": "↑", "map": "↑",
             "aopc": "↑", "log_odds": "↓", "kendall_tau": "↓"}


def _nanmean(a) -> float:
    if a is None:
        return float("nan")
    a = np.asarray(a, dtype=np.float64)
    ok = ~np.isnan(a)
    return float(a[ok].mean()) if ok.any() else float("nan")


def summary_rows(result) -> List[Dict[str, Any]]:
    """One dict per method: ``method``, then the metrics that were measured (dataset averages), then
    ``conservation_error`` (if any relevance was propagated) and ``samples``."""
    rows = []
    for m in result.methods:
        row: Dict[str, Any] = {"method": m}
        for mode, curve in result.perturbation.get(m, {}).items():
            row[f"{mode}_auc"] = curve.auc
        seg = result.segmentation.get(m)
        if seg is not None:
            row.update(pixel_accuracy=seg.mean_pixel_accuracy, miou=seg.mean_miou, map=seg.mean_ap)
        txt = result.text.get(m)
        if txt is not None:
            for k, v in txt.token_f1.items():
                row[f"token_f1@{k}"] = _nanmean(v)
            for k, v in txt.precision_at_k.items():
                row[f"precision@{k}"] = _nanmean(v)
            if txt.aopc is not None:
                row["aopc"] = txt.aopc.value
            if txt.log_odds is not None:
                row["log_odds"] = txt.log_odds.value
            if txt.kendall_tau is not None:
                row["kendall_tau"] = _nanmean(txt.kendall_tau)
        if result.conservation:
            preset = result.presets.get(m)
            row["conservation_error"] = result.conservation[preset].max_error if preset in result.conservation \
                else float("nan")
        row["samples"] = result.samples
        rows.append(row)
    return rows


def _columns(rows: List[Dict[str, Any]]) -> List[str]:
    cols: List[str] = []
    for r in rows:
        for k in r:
            if k not in cols:
                cols.append(k)
    return cols


def _fmt(v: Any) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e-3 and v != 0 else f"{v:.4f}"
    return str(v)


def to_markdown_table(result) -> str:
    """The one-row-per-method table in markdown (↑/↓ marks which direction is better)."""
    rows = summary_rows(result)
    cols = _columns(rows)
    head = [c + (f" {DIRECTION[c]}" if c in DIRECTION else " ↑" if c.startswith(("token_f1", "precision"))
                 else "") for c in cols]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" if c == "method" else "---:" for c in cols) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(_fmt(r.get(c)) for c in cols) + " |")
    return "\n".join(lines)


def to_markdown(result) -> str:
    """The whole report: settings, the table, the perturbation curves and the conservation tables."""
    out = [f"# relprop evaluation ({result.modality}, {result.samples} samples)", ""]
    out += [f"- {k}: {v}" for k, v in result.settings.items()]
    out += ["", "## Results (one row per method)", "", to_markdown_table(result), "", _conventions(result), ""]
    if result.perturbation:
        first = next(iter(result.perturbation.values()))
        fr = next(iter(first.values())).fractions
        out += ["## Perturbation curves (top-1 accuracy after removing a fraction)", "",
                "| method | mode | " + " | ".join(f"{f:.0%}" for f in fr) + " | AUC |",
                "|---|---|" + "---:|" * (len(fr) + 1)]
        for m in result.methods:
            for mode, c in result.perturbation[m].items():
                out.append(f"| {m} | {mode} | " + " | ".join(f"{a:.3f}" for a in c.accuracy) + f" | {c.auc:.4f} |")
        out.append("")
    if result.text and any(t.aopc is not None for t in result.text.values()):
        t0 = next(t for t in result.text.values() if t.aopc is not None)
        fr = t0.aopc.fractions
        out += ["## AOPC curves (mean p(ŷ|x) − p(ŷ|x̃_k), top k deleted)", "",
                "| method | " + " | ".join(f"{f:.0%}" for f in fr) + " |", "|---|" + "---:|" * len(fr)]
        for m in result.methods:
            if result.text[m].aopc is not None:
                out.append(f"| {m} | " + " | ".join(f"{a:.4g}" for a in result.text[m].aopc.mean_curve) + " |")
        out.append("")
    for preset, rep in result.conservation.items():
        users = [m for m in result.methods if result.presets.get(m) == preset]
        out += [f"## Conservation, preset '{preset}' ({', '.join(users)})", "", rep.to_markdown(), ""]
    return "\n".join(out)


def _conventions(result) -> str:
    notes = []
    if result.perturbation:
        notes.append("AUC: trapezoidal area (sklearn.metrics.auc) under the mean top-1 accuracy over the removed "
                     "fractions; accuracy 1 throughout gives the last minus the first fraction (0.8 for 10–90 %). "
                     "Positive: most relevant removed first (lower is better); negative: least relevant first "
                     "(higher is better).")
    if result.segmentation:
        notes.append("Segmentation: each map thresholded at its own mean; mIoU = mean IoU of foreground and "
                     "background; pixel accuracy, mIoU and AP per image, then averaged over the images.")
    if result.text:
        notes.append("Text: special tokens and padding never count or get removed; AOPC deletes the top k % "
                     "tokens, log-odds replaces them (AttCAT §5.3); Kendall-τ against the runner-up class.")
    if result.conservation:
        notes.append("conservation_error: largest end-to-end relative error |in − out − absorbed| / |in| of the "
                     "preset the method's relevance came from (– : the method uses no relevance).")
    return "\n".join(f"- {n}" for n in notes)


def write_markdown(result, path: str) -> str:
    with open(path, "w", encoding="utf-8") as f:
        f.write(to_markdown(result))
    return path


def write_csv(result, path: str) -> str:
    """The summary table, one row per method (empty cells where a metric does not apply)."""
    rows = summary_rows(result)
    cols = _columns(rows)
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        for r in rows:
            w.writerow({c: ("" if r.get(c) is None or (isinstance(r.get(c), float) and math.isnan(r[c]))
                            else r[c]) for c in cols})
    return path


def write_curves_csv(result, path: str) -> str:
    """The perturbation curves, one line per (method, mode, fraction)."""
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["method", "mode", "fraction", "accuracy"])
        for m in result.methods:
            for mode, c in result.perturbation.get(m, {}).items():
                for fr, a in zip(c.fractions, c.accuracy):
                    w.writerow([m, mode, f"{fr:g}", a])
    return path


def plot_perturbation(result, path: str) -> str:
    """Top-1 accuracy against the removed fraction, one panel per mode (and AOPC for texts), one line
    per method. Uses matplotlib's Agg canvas directly (no global backend change)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    panels = []
    modes = []
    for m in result.methods:
        for mode in result.perturbation.get(m, {}):
            if mode not in modes:
                modes.append(mode)
    panels += [("mode", mode) for mode in modes]
    if result.text and any(t.aopc is not None for t in result.text.values()):
        panels.append(("aopc", None))
    if not panels:
        panels = [("empty", None)]
    fig = Figure(figsize=(5 * len(panels), 4), constrained_layout=True)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, (kind, mode) in zip(axes, panels):
        if kind == "mode":
            for m in result.methods:
                c = result.perturbation.get(m, {}).get(mode)
                if c is not None:
                    ax.plot(c.fractions, c.accuracy, marker="o", label=f"{m} ({c.auc:.3f})")
            better = "lower" if mode == "positive" else "higher"
            ax.set_title(f"{mode} perturbation (AUC, {better} is better)")
            ax.set_xlabel("fraction removed")
            ax.set_ylabel("top-1 accuracy")
            ax.set_ylim(-0.02, 1.02)
        elif kind == "aopc":
            for m in result.methods:
                t = result.text.get(m)
                if t is not None and t.aopc is not None:
                    ax.plot(t.aopc.fractions, t.aopc.mean_curve, marker="o", label=f"{m} ({t.aopc.value:.3g})")
            ax.set_title("AOPC (top k % deleted; higher is better)")
            ax.set_xlabel("fraction deleted")
            ax.set_ylabel("p(ŷ|x) − p(ŷ|x̃)")
        else:
            ax.text(0.5, 0.5, "no perturbation test was run", ha="center", va="center")
            ax.set_axis_off()
        if kind != "empty":
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.savefig(path, dpi=100)
    return path


def write_report(result, out_dir: str) -> Dict[str, str]:
    """Write ``results.md``, ``results.csv``, ``curves.csv`` and ``perturbation.png`` into ``out_dir``."""
    os.makedirs(out_dir, exist_ok=True)
    return {"markdown": write_markdown(result, os.path.join(out_dir, "results.md")),
            "csv": write_csv(result, os.path.join(out_dir, "results.csv")),
            "curves": write_curves_csv(result, os.path.join(out_dir, "curves.csv")),
            "plot": plot_perturbation(result, os.path.join(out_dir, "perturbation.png"))}
