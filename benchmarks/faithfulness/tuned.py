"""Rows of the faithfulness benchmark for the aggregation chosen by relprop.evaluation.tune (the survey's
§1.4: aggregation choices as hyperparameters, chosen on held-out data) and for the norm-based flows.

Needs the models and test data of a run of run.py in OUT (``python benchmarks/faithfulness/run.py --out
OUT [--quick]``). For every rollout-style method, tune() ranks a grid of aggregation settings on a
*validation* split generated here with another seed (held out from both training and test), by the
positive-perturbation AUC (images) or AOPC (text); the best setting is then evaluated on the test split
with evaluate(), as a row "<method>[tuned]" beside the method's default row of OUT/summary.json.

    python benchmarks/faithfulness/tuned.py --out OUT [--val-images 32 --val-texts 32]

Writes OUT/tuned.md and OUT/tuned.json and prints the tables.

A reduced version that needs no trained model (for a machine where run.py is too heavy): the offline
demo classifier (all-MiniLM-L6-v2 zero-shot over the four topics of the synthetic sentences, mean
pooling, so ``query="mean"``) on synthetic sentences, text metrics only, default and tuned rows both
computed here:

    python benchmarks/faithfulness/tuned.py --out OUT --demo [--val-texts 16 --test-texts 24]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

import relprop.evaluation as E  # noqa: E402

import models  # noqa: E402
import synth  # noqa: E402

#: the grids tuned (every setting shares one forward/backward per batch)
GRID = {"head_fusion": ["mean", "max", "gradient"], "discard_ratio": [0.0, 0.9], "start_block": [0, -2]}
GRIDS = {
    "raw_attention": {"head_fusion": ["mean", "max", "min", "gradient"], "layers": ["last", "sum"]},
    "rollout": GRID,
    "gradient_rollout": GRID,
    "transformer_attribution": GRID,
    "attention_norm": {"head_fusion": ["combined", "max"], "layers": ["last", "rollout", "sum"]},
    "attn_res_ln_norm": {"layers": ["rollout", "last", "sum"], "start_block": [0, -2]},
    "value_zeroing": {"layers": ["rollout", "last", "sum"], "start_block": [0, -2]},
}
#: named settings evaluated on the test split beside the default and tuned rows: the norm-based flow of
#: Kobayashi et al. (2020) aggregated over the blocks (row-normalized norm matrices rolled out, survey §1.5)
EXTRA_ROWS = {"attention_norm": {"attention_norm[layers=rollout]": {"layers": "rollout"}}}
COLUMNS = {"vision": ["positive_auc", "negative_auc", "miou"], "text": ["aopc", "log_odds", "token_f1@3"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="the OUT folder of a run.py run (models, data, summary.json)")
    p.add_argument("--val-images", type=int, default=32)
    p.add_argument("--val-texts", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--methods", nargs="+", default=list(GRIDS))
    p.add_argument("--demo", action="store_true", help="the reduced run: the demo classifier, synthetic text")
    p.add_argument("--test-texts", type=int, default=24, help="--demo: test sentences")
    args = p.parse_args(argv)
    out = args.out
    if args.demo:
        return demo_run(args)
    summary = json.load(open(os.path.join(out, "summary.json")))
    val = os.path.join(out, "data_val")
    g = torch.Generator().manual_seed(args.seed + 101)
    synth.write_image_folder(synth.image_batch(g, args.val_images, 1), os.path.join(val, "vision"))
    synth.write_jsonl(synth.text_dataset(args.val_texts, args.seed + 102), os.path.join(val, "text.jsonl"))
    result = {}
    lines = ["# Tuned aggregation (relprop.evaluation.tune on a held-out validation split)", ""]

    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    vit = models.load_vit(os.path.join(out, "models", "vision"))
    tdir = os.path.join(out, "models", "text")
    tok = AutoTokenizer.from_pretrained(tdir, local_files_only=True)
    bert = AutoModelForSequenceClassification.from_pretrained(tdir, local_files_only=True).eval()
    setups = {
        "vision": (vit, E.ImageMaskFolder(os.path.join(val, "vision"), normalization=(synth.MEAN, synth.STD)),
                   E.ImageMaskFolder(os.path.join(out, "data", "vision", "test"),
                                     normalization=(synth.MEAN, synth.STD)), "positive_auc",
                   dict(batch_size=16, perturbation_batch_size=256, progress=False)),
        "text": (bert, E.RationaleJSONL(os.path.join(val, "text.jsonl"), tok),
                 E.RationaleJSONL(os.path.join(out, "data", "text", "test.jsonl"), tok), "aopc",
                 dict(batch_size=16, perturbation_batch_size=128, rationale_k=(1, 2, 3), progress=False)),
    }
    for kind, (model, val_data, test_data, metric, common) in setups.items():
        base = summary.get(kind, {})  # run.py's rows of the methods with their defaults
        cols = COLUMNS[kind]
        lines += [f"## {kind} (tuned by {metric} on {len(val_data)} validation samples; rows on the test split)", "",
                  "| method | setting | " + " | ".join(cols) + " |", "|---|---|" + "---|" * len(cols)]
        result[kind] = {}
        for method in args.methods:
            tuned, rows, t_tune = tune_and_test(model, val_data, test_data, method, metric, common, {}, ("tuned",))
            result[kind][method] = {"best": tuned.best, "ranking": tuned.rows, "test": rows["tuned"], "tune_s": t_tune}
            report_tuning(kind + " " + method, tuned, t_tune)
            if method in base:
                rows = {"default": base[method], **rows}  # run.py's row of the default setting
            lines += table_rows(method, tuned.best, rows, cols)
        lines.append("")
    with open(os.path.join(out, "tuned.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    with open(os.path.join(out, "tuned.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def demo_run(args) -> int:
    """The reduced run (see the module docstring)."""
    from relprop import demo
    out = args.out
    os.makedirs(out, exist_ok=True)
    model, tok = demo.load(demo.labels_from_names(synth.TEXT_CLASSES))
    synth.write_jsonl(synth.text_dataset(args.val_texts, args.seed + 102), os.path.join(out, "val.jsonl"))
    synth.write_jsonl(synth.text_dataset(args.test_texts, args.seed + 103), os.path.join(out, "test.jsonl"))
    val = E.RationaleJSONL(os.path.join(out, "val.jsonl"), tok)
    test = E.RationaleJSONL(os.path.join(out, "test.jsonl"), tok)
    common = dict(batch_size=8, perturbation_batch_size=64, rationale_k=(1, 2, 3), progress=False)
    fixed = {"query": "mean"}
    cols = COLUMNS["text"] + ["positive_auc"]
    lines = [f"# Tuned aggregation, reduced run: demo all-MiniLM-L6-v2 zero-shot on synthetic sentences "
             f"(tuned by AOPC on {len(val)} validation sentences; rows on {len(test)} test sentences)", "",
             "| method | setting | " + " | ".join(cols) + " |", "|---|---|" + "---|" * len(cols)]
    result = {}
    for method in args.methods:
        tuned, rows, t_tune = tune_and_test(model, val, test, method, "aopc", common, fixed, ("default", "tuned"))
        result[method] = {"best": tuned.best, "ranking": tuned.rows, "test": rows, "tune_s": t_tune}
        report_tuning(method, tuned, t_tune)
        new = table_rows(method, tuned.best, rows, cols)
        lines += new
        print("\n".join(new), flush=True)  # the test rows as soon as they exist
    with open(os.path.join(out, "tuned_demo.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    with open(os.path.join(out, "tuned_demo.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def tune_and_test(model, val, test, method: str, metric: str, common: dict, fixed: dict, which) -> tuple:
    """tune() ``method``'s grid on ``val`` by ``metric``, then evaluate() on ``test`` the settings named in
    ``which`` ("default": the method's defaults, "tuned": the best setting) and the method's
    :data:`EXTRA_ROWS`; ``fixed``: options every setting gets.
    Returns (TuneResult, {name: test-table row}, seconds spent tuning)."""
    t = time.time()
    tuned = E.tune(model, val, method, GRIDS[method], metric=metric, explain_options=fixed, **common)
    t_tune = time.time() - t
    named = {"default": {}, "tuned": tuned.best, **EXTRA_ROWS.get(method, {})}
    rows = {}
    for name in list(which) + list(EXTRA_ROWS.get(method, {})):
        opts = {**fixed, **named[name]}
        res = E.evaluate(model, test, [method], explain_options=opts, kendall=False, conservation=False, **common)
        rows[name] = res.table()[0]
    return tuned, rows, t_tune


def report_tuning(what: str, tuned, seconds: float) -> None:
    """Print the ranking of a tune() run."""
    print(f"{what}: {len(tuned.rows)} settings tuned in {seconds:.0f}s; best {tuned.best}", flush=True)
    print(tuned.to_markdown(), flush=True)


def table_rows(method: str, best: dict, rows: dict, cols) -> list:
    """Markdown rows "<method> | default", "<method>[tuned] | <setting>" and the EXTRA_ROWS, of the rows
    present."""
    names = {"default": (method, "default"), "tuned": (f"{method}[tuned]", _setting(best)),
             **{k: (k, _setting(v)) for k, v in EXTRA_ROWS.get(method, {}).items()}}
    return [f"| {names[k][0]} | {names[k][1]} | " + " | ".join(_fmt(r.get(c)) for c in cols) + " |"
            for k, r in rows.items()]


def _fmt(v) -> str:
    return "–" if v is None else f"{float(v):.3f}"


def _setting(best) -> str:
    return ", ".join(f"{k}={v}" for k, v in best.items())


if __name__ == "__main__":
    sys.exit(main())
