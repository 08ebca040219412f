"""Draw docs/figures/architecture.png: relprop's layers bottom to top, the packages of each layer, and
the one-way imports between them. The layers and packages are read from ``tests/layering.py``
(``LAYERS``, ``PACKAGE_LAYERS``), the checker of ``tests/test_layers.py``, so the picture cannot name a
package the checker does not know.

    python docs/figures/architecture.py      # writes docs/figures/architecture.png
"""
import os
import sys

import matplotlib

matplotlib.use("Agg")
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests"))
import layering  # noqa: E402

#: one line per package (top-level modules as ``name.py``)
WHAT = {
    "errors": "every error relprop raises on purpose (RelpropError and its kinds), RelpropWarning",
    "graph": "torch.export capture and its caches; sources, live nodes, attention blocks, token streams, windows",
    "rules": "one relevance rule per aten op family; presets (tables of rules); RuleSpec",
    "engine": "run(Request) -> Trace: forward, gradients, relevance walk, memory plans, fast path",
    "targets": "what is explained -> per-sample scores: classes, next token, QA spans, contrasts",
    "methods": "each method a pure function of a Trace; MethodInfo registry",
    "viz": "pictures of an Explanation's fields: overlays, grids, HTML, terminal",
    "explanation": "Explanation from a method's output: patch grid, special tokens, flat maps",
    "models": "family adapters (one registry): split a batch, prepare the call, compose the results, generate",
    "api": "explain, explain_settings, coverage, explain_generation; every argument checked; adapter_for(model)",
    "evaluation": "the papers' protocols: perturbation, segmentation, text",
    "tools": "the offline demo model; activation maximization",
    "interop": "relprop inside captum, Quantus and inseq",
    "cli": "relprop explain | methods | demo | evaluate | visualize",
}
COLOURS = ["#e8eef7", "#f3f7e8"]


def layers():
    """[(layer, [packages])], bottom first, without the package's own __init__ (it re-exports them all)."""
    out = []
    for name in layering.LAYERS:
        packages = [p for p, layer in layering.PACKAGE_LAYERS.items() if layer == name and p in WHAT]
        if packages:
            out.append((name, packages))
    missing = {p for p in layering.PACKAGE_LAYERS if p not in WHAT} - {"version", "__main__"}
    assert not missing, f"packages without a line in WHAT: {sorted(missing)}"
    return out


def draw(path: str) -> str:
    rows = layers()
    row_h, gap, left, width = 0.62, 0.32, 1.55, 9.2
    height = len(rows) * (row_h + gap) + 0.9
    fig = Figure(figsize=(left + width + 0.3, height))
    ax = fig.add_axes([0, 0, 1, 1])
    ax.set_xlim(0, left + width + 0.3)
    ax.set_ylim(0, height)
    ax.axis("off")
    ax.text(0.15, height - 0.3, "relprop: layers, bottom first. A module imports only from its layer or below "
            "(arrows: 'imports'); tests/test_layers.py checks it.", fontsize=9.5, va="center", weight="bold")
    centres = []
    for i, (layer, packages) in enumerate(rows):
        y = 0.25 + i * (row_h + gap)
        centres.append(y + row_h / 2)
        ax.text(left - 0.15, y + row_h / 2, layer, ha="right", va="center", fontsize=9, style="italic",
                color="#555555")
        box_w = width / len(packages)
        for j, package in enumerate(packages):
            x = left + j * box_w
            ax.add_patch(FancyBboxPatch((x + 0.04, y), box_w - 0.08, row_h, boxstyle="round,pad=0.0,rounding_size=0.08",
                                        facecolor=COLOURS[i % 2], edgecolor="#4a5a70", linewidth=0.9))
            name = "errors.py, version.py" if package == "errors" else f"{package}/"
            ax.text(x + 0.14, y + row_h * 0.70, name, fontsize=9, weight="bold", family="monospace", va="center")
            ax.text(x + 0.14, y + row_h * 0.30, WHAT[package], fontsize=6.9 if len(packages) == 1 else 6.4,
                    va="center", wrap=False)
    for lower, upper in zip(centres, centres[1:]):
        ax.add_patch(FancyArrowPatch((0.35, upper - row_h / 2), (0.35, lower + row_h / 2), arrowstyle="-|>",
                                     mutation_scale=11, color="#4a5a70", linewidth=1.1))
        ax.text(0.45, (upper + lower) / 2, "imports", fontsize=6.5, color="#4a5a70", va="center")
    ax.text(0.15, 0.08, "relprop/__init__.py gathers the public names of every layer, imported on first use.",
            fontsize=7.5, color="#555555")
    fig.savefig(path, dpi=150, facecolor="white")
    return path


if __name__ == "__main__":
    print(draw(os.path.join(HERE, "architecture.png")))
