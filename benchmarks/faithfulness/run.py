"""The faithfulness benchmark: every explanation method of relprop, on every metric of
relprop.evaluation, on two models trained here, offline, on data whose ground truth is known.

    python benchmarks/faithfulness/run.py --out benchmarks/faithfulness/out            # ~20-25 min, 2 cores
    python benchmarks/faithfulness/run.py --out /tmp/faith --quick                     # ~3 min smoke run

1. data (synth.py): sentences of 4 topics with keyword rationales (40 % "mixed": 2 keywords of the
   label's class + 1 of another, label = majority), and 64x64 images of 1 or 2 shapes with pixel masks;
2. models (models.py): the real pretrained all-MiniLM-L6-v2 fine-tuned as BertForSequenceClassification;
   a 4-block timm ViT (vit_tiny_patch16_224 with 64x64 inputs, 8x8 patches, width 128) trained from
   scratch;
3. evaluation, all through relprop.evaluation:
   text  - evaluate(): token-F1 / Precision@K vs the rationales, AOPC, log-odds, positive/negative
           perturbation AUC, Kendall-tau between the explained and the runner-up class; evaluate_text()
           on the mixed sentences with the *minority* class as target and its keyword as rationale;
   images- evaluate() with target="predicted" (perturbation AUC both modes, pixel accuracy, mIoU, mAP)
           and target="label" (perturbation AUC); class-specificity on two-object images: each of the
           two classes explained, the share of the (positive) map's mass on the explained object, and
           segmentation_scores() of the map against the explained object's mask;
4. checks.py: the diagnostics behind the analysis in benchmarks/RESULTS.md (OUT/checks.md, checks.json,
   maps_vision.png);
5. reports: OUT/{text,text_minority,vision,vision_target}/results.{md,csv} + curves.csv + perturbation.png
   (relprop.evaluation.write_report), OUT/vision_specificity.csv, OUT/summary.md and OUT/summary.json (the
   tables of RESULTS.md), OUT/run.log.

The models can then be evaluated from the command line too (see benchmarks/RESULTS.md):

    relprop evaluate OUT/data/text/test.jsonl --model OUT/models/text --out DIR
    relprop evaluate OUT/data/vision/test --model timm:vit_tiny_patch16_224 \
        --checkpoint OUT/models/vision/vit.pth --timm-kwargs "$(cat OUT/models/vision/timm_kwargs.json)" \
        --mean 0.5,0.5,0.5 --std 0.5,0.5,0.5 --out DIR

Seeds are fixed (``--seed``); weights and data go to OUT/models and OUT/data (git-ignored).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from typing import Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # the repository root: relprop

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import torch  # noqa: E402

import relprop  # noqa: E402
import relprop.evaluation as E  # noqa: E402

import models  # noqa: E402
from specificity import class_specificity  # noqa: E402
import synth  # noqa: E402

#: the two configurations: the benchmark, and a smoke run
CONFIGS = {
    "full": dict(text_train=4000, text_steps=300, text_test=128, vision_steps=2000, vision_test=256,
                 vision_two=128, sg_samples=8, ig_steps=16, text_batch=16, vision_batch=32, check_images=128,
                 check_texts=32),
    "quick": dict(text_train=1000, text_steps=30, text_test=16, vision_steps=300, vision_test=48,
                  vision_two=32, sg_samples=4, ig_steps=8, text_batch=16, vision_batch=16, check_images=16,
                  check_texts=16),
}
TEXT_K = (1, 2, 3)
VIT_WIDTH = dict(embed_dim=128, num_heads=4)


def all_methods() -> List[str]:
    return list(relprop.methods())


def text_methods() -> List[str]:
    """Every method but vit_cx (it masks pixels: vision only)."""
    return [m for m in all_methods() if m != "vit_cx"]


#: method "lrp" under the other presets, reported as rows of their own beside the methods (the row "lrp" is its
#: default, AttnLRP: Achtibat et al., ICML 2024): the CVPR 2021 paper's plain-LRP baseline (preset "lrp"),
#: CP-LRP (Ali et al., ICML 2022) and PA-LRP (Bakish et al., NeurIPS 2025). Runs before 2026-12-02, when lrp's
#: default was the plain-LRP preset, named the rows "lrp" (plain) and "lrp[attnlrp]".
PRESET_VARIANTS = {"lrp[lrp]": ("lrp", "lrp"), "lrp[cp_lrp]": ("lrp", "cp_lrp"),
                   "lrp[pa_lrp]": ("lrp", "pa_lrp")}


def evaluate_variants(model, data, log, what: str, **options) -> Dict[str, "E.EvaluationResult"]:
    """relprop.evaluation.evaluate of each PRESET_VARIANTS entry (one method under an explicit preset).
    Where a conservation report is asked for (the default), the relevance is computed by the
    interpreter (``fast_path=False``: the one-backward fast path gives input relevance only, equal
    to the interpreter's to ~1e-4, benchmarks/RESULTS_attnlrp.md) so that the report exists."""
    out = {}
    if options.get("conservation", True):
        options["explain_options"] = {**options.get("explain_options", {}), "fast_path": False}
    for name, (method, preset) in PRESET_VARIANTS.items():
        t = time.time()
        out[name] = E.evaluate(model, data, [method], preset=preset, **options)
        log(f"{what}: {name}: {time.time() - t:.0f}s")
    return out


def variant_row(result, name: str) -> Dict:
    """The table row of a PRESET_VARIANTS result, renamed to the variant."""
    method = PRESET_VARIANTS[name][0]
    row = dict(next(r for r in result.table() if r["method"] == method))
    row["method"] = name
    return row


class Log:
    def __init__(self, path: str):
        self.t0 = time.time()
        self.f = open(path, "a")

    def __call__(self, msg: str) -> None:
        line = f"[{time.time() - self.t0:7.1f}s] {msg}"
        print(line, flush=True)
        self.f.write(line + "\n")
        self.f.flush()


# ----------------------------------------------------------------------------------------------- data
def make_data(out: str, cfg: Dict, seed: int) -> Dict:
    d = os.path.join(out, "data")
    shutil.rmtree(d, ignore_errors=True)  # a folder left by a run with other sizes would mix with this one
    train = synth.text_dataset(cfg["text_train"], seed + 1)
    test = synth.text_dataset(cfg["text_test"], seed + 2)
    synth.write_jsonl(train, os.path.join(d, "text", "train.jsonl"))
    synth.write_jsonl(test, os.path.join(d, "text", "test.jsonl"))
    synth.write_jsonl(test, os.path.join(d, "text", "test_minority.jsonl"), minority=True)
    g = torch.Generator().manual_seed(seed + 3)
    one = synth.image_batch(g, cfg["vision_test"], 1)
    two = synth.image_batch(g, cfg["vision_two"], 2)
    synth.write_image_folder(one, os.path.join(d, "vision", "test"))
    synth.write_image_folder(two, os.path.join(d, "vision", "two_objects"))
    torch.save(two, os.path.join(d, "vision", "two_objects", "objects.pt"))
    return {"text_train": train, "text_test": test, "one": one, "two": two}


# ----------------------------------------------------------------------------------------------- text
def evaluate_text(out: str, data: Dict, cfg: Dict, log) -> Dict:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from transformers.utils import logging as tlog
    tlog.set_verbosity_error()
    mdir = os.path.join(out, "models", "text")
    tok = AutoTokenizer.from_pretrained(mdir, local_files_only=True)
    model = AutoModelForSequenceClassification.from_pretrained(mdir, local_files_only=True).eval()
    methods = text_methods()
    opts = dict(n_samples=cfg["sg_samples"], n_steps=cfg["ig_steps"])
    ds = E.RationaleJSONL(os.path.join(out, "data", "text", "test.jsonl"), tok)
    t = time.time()
    res = E.evaluate(model, ds, methods, target="predicted", batch_size=cfg["text_batch"], rationale_k=TEXT_K,
                     perturbation_batch_size=128, explain_options=opts, progress=False)
    log(f"text: evaluate() on {res.samples} sentences x {len(methods)} methods: {time.time() - t:.0f}s")
    E.write_report(res, os.path.join(out, "text"))
    mixed = np.array([r["mixed"] for r in data["text_test"]])
    ms = E.RationaleJSONL(os.path.join(out, "data", "text", "test_minority.jsonl"), tok)
    t = time.time()
    minority = E.evaluate(model, ms, methods, target="label", batch_size=cfg["text_batch"], rationale_k=TEXT_K,
                          perturbation=False, aopc=False, kendall=False, conservation=False,
                          explain_options=opts, progress=False)
    log(f"text: minority-class test on {minority.samples} mixed sentences: {time.time() - t:.0f}s")
    E.write_report(minority, os.path.join(out, "text_minority"))
    var = evaluate_variants(model, ds, log, "text", target="predicted", batch_size=cfg["text_batch"],
                            rationale_k=TEXT_K, perturbation_batch_size=128, progress=False)
    var_min = evaluate_variants(model, ms, log, "text minority", target="label", batch_size=cfg["text_batch"],
                                rationale_k=TEXT_K, perturbation=False, aopc=False, kendall=False,
                                conservation=False, progress=False)
    for name in PRESET_VARIANTS:
        E.write_report(var[name], os.path.join(out, "text_" + PRESET_VARIANTS[name][1]))
    rows = {}
    base = {r["method"]: r for r in res.table()}
    mrows = {r["method"]: r for r in minority.table()}
    for m in methods:
        r = dict(base[m])
        tau = res.text[m].kendall_tau
        r["kendall_tau_mixed"] = float(np.nanmean(tau[mixed])) if tau is not None and mixed.any() else float("nan")
        r["kendall_tau_single"] = float(np.nanmean(tau[~mixed])) if tau is not None else float("nan")
        for k in TEXT_K:
            r[f"minority_precision@{k}"] = mrows[m].get(f"precision@{k}")
            r[f"minority_token_f1@{k}"] = mrows[m].get(f"token_f1@{k}")
        rows[m] = r
    for name, (method, _) in PRESET_VARIANTS.items():
        r = variant_row(var[name], name)
        tau = var[name].text[method].kendall_tau
        r["kendall_tau_mixed"] = float(np.nanmean(tau[mixed])) if tau is not None and mixed.any() else float("nan")
        r["kendall_tau_single"] = float(np.nanmean(tau[~mixed])) if tau is not None else float("nan")
        mr = variant_row(var_min[name], name)
        for k in TEXT_K:
            r[f"minority_precision@{k}"] = mr.get(f"precision@{k}")
            r[f"minority_token_f1@{k}"] = mr.get(f"token_f1@{k}")
        rows[name] = r
    conservation = {p: c for v in var.values() for p, c in v.conservation.items()}
    conservation.update(res.conservation)
    return {"rows": rows, "result": res, "model": model, "tokenizer": tok, "dataset": ds,
            "conservation": conservation}


# --------------------------------------------------------------------------------------------- vision
def evaluate_vision(out: str, data: Dict, cfg: Dict, log) -> Dict:
    model = models.load_vit(os.path.join(out, "models", "vision"))
    methods = all_methods()
    opts = dict(n_samples=cfg["sg_samples"], n_steps=cfg["ig_steps"])
    norm = (synth.MEAN, synth.STD)
    folder = E.ImageMaskFolder(os.path.join(out, "data", "vision", "test"), normalization=norm)
    common = dict(batch_size=cfg["vision_batch"], perturbation_batch_size=256, explain_options=opts, progress=False)
    t = time.time()
    pred = E.evaluate(model, folder, methods, target="predicted", **common)
    log(f"vision: evaluate(target='predicted') on {pred.samples} images x {len(methods)} methods: "
        f"{time.time() - t:.0f}s")
    E.write_report(pred, os.path.join(out, "vision"))
    t = time.time()
    targ = E.evaluate(model, folder, methods, target="label", segmentation=False, conservation=False, **common)
    log(f"vision: evaluate(target='label'): {time.time() - t:.0f}s")
    E.write_report(targ, os.path.join(out, "vision_target"))
    t = time.time()
    spec = class_specificity(model, data["two"], methods, opts, cfg["vision_batch"])
    log(f"vision: class-specificity on {data['two']['images'].shape[0]} two-object images: {time.time() - t:.0f}s")
    common.pop("explain_options")
    var = evaluate_variants(model, folder, log, "vision", target="predicted", **common)
    var_t = evaluate_variants(model, folder, log, "vision target", target="label", segmentation=False,
                              conservation=False, **common)
    for name in PRESET_VARIANTS:
        E.write_report(var[name], os.path.join(out, "vision_" + PRESET_VARIANTS[name][1]))
        method, preset = PRESET_VARIANTS[name]
        spec[name] = class_specificity(model, data["two"], [method], {"preset": preset}, cfg["vision_batch"])[method]
    rows = {}
    p = {r["method"]: r for r in pred.table()}
    q = {r["method"]: r for r in targ.table()}
    for m in methods:
        r = dict(p[m])
        r["positive_auc_target"] = q[m]["positive_auc"]
        r["negative_auc_target"] = q[m]["negative_auc"]
        r.update(spec[m])
        rows[m] = r
    for name in PRESET_VARIANTS:
        r = variant_row(var[name], name)
        q = variant_row(var_t[name], name)
        r["positive_auc_target"] = q["positive_auc"]
        r["negative_auc_target"] = q["negative_auc"]
        r.update(spec[name])
        rows[name] = r
    conservation = {p: c for v in var.values() for p, c in v.conservation.items()}
    conservation.update(pred.conservation)
    with open(os.path.join(out, "vision_specificity.csv"), "w") as f:
        keys = list(next(iter(spec.values())).keys())
        f.write("method," + ",".join(keys) + "\n")
        for m in spec:
            f.write(m + "," + ",".join(f"{spec[m][k]:.6g}" for k in keys) + "\n")
    return {"rows": rows, "result": pred, "model": model, "folder": folder, "conservation": conservation}


# -------------------------------------------------------------------------------------------- tables
VISION_COLUMNS = [("positive_auc", "pos. AUC (pred.) ↓", "min"), ("negative_auc", "neg. AUC (pred.) ↑", "max"),
                  ("positive_auc_target", "pos. AUC (target) ↓", "min"),
                  ("negative_auc_target", "neg. AUC (target) ↑", "max"),
                  ("pixel_accuracy", "pixel acc. ↑", "max"), ("miou", "mIoU ↑", "max"), ("map", "mAP ↑", "max"),
                  ("spec_share", "2-obj: mass on explained obj. ↑", "max"),
                  ("spec_top1_on_own", "2-obj: max on explained obj. ↑", "max"),
                  ("spec_ap_own", "2-obj: AP explained obj. ↑", "max"),
                  ("spec_ap_other", "2-obj: AP other obj. ↓", "min")]
TEXT_COLUMNS = [("token_f1@3", "token-F1@3 ↑", "max"), ("precision@1", "P@1 ↑", "max"),
                ("precision@2", "P@2 ↑", "max"), ("aopc", "AOPC ↑", "max"), ("log_odds", "log-odds ↓", "min"),
                ("positive_auc", "pos. AUC ↓", "min"), ("negative_auc", "neg. AUC ↑", "max"),
                ("kendall_tau", "Kendall-τ ↓", "min"), ("kendall_tau_mixed", "τ mixed ↓", "min"),
                ("minority_precision@1", "minority P@1 ↑", "max")]


def markdown_table(rows: Dict[str, Dict], columns) -> str:
    best = {}
    for key, _, how in columns:
        vals = [r.get(key) for r in rows.values()]
        vals = [v for v in vals if v is not None and not (isinstance(v, float) and math.isnan(v))]
        if vals:
            best[key] = round(min(vals) if how == "min" else max(vals), 4)
    lines = ["| method | " + " | ".join(c[1] for c in columns) + " |",
             "|---|" + "---:|" * len(columns)]
    for m, r in rows.items():
        cells = []
        for key, _, _ in columns:
            v = r.get(key)
            if v is None or (isinstance(v, float) and math.isnan(v)):
                cells.append("–")
                continue
            s = f"{v:.3f}"
            cells.append(f"**{s}**" if round(v, 4) == best.get(key) else s)
        name = f"**{m}**" if m == "transformer_attribution" else m
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def rank_summary(rows: Dict[str, Dict], columns, method: str = "transformer_attribution") -> List[str]:
    """For each column: the rank of ``method`` among the methods (1 = best; ties share the better rank)."""
    out = []
    for key, title, how in columns:
        vals = {m: r.get(key) for m, r in rows.items()}
        vals = {m: v for m, v in vals.items() if v is not None and not (isinstance(v, float) and math.isnan(v))}
        if method not in vals:
            continue
        mine = vals[method]
        better = sum(1 for v in vals.values() if (v < mine - 1e-9 if how == "min" else v > mine + 1e-9))
        leader = (min if how == "min" else max)(vals, key=vals.get)
        out.append(f"{title}: rank {better + 1}/{len(vals)} (best: {leader} {vals[leader]:.3f}, "
                   f"{method} {mine:.3f})")
    return out


def variant_ranks(vision_rows: Dict, text_rows: Dict) -> List[str]:
    """The rank of each PRESET_VARIANTS row per column, images and text."""
    lines = []
    for name in PRESET_VARIANTS:
        lines += [f"{name}'s rank per column:", "", "- images:"]
        lines += [f"  - {s}" for s in rank_summary(vision_rows, VISION_COLUMNS, name)]
        lines += ["- text:"] + [f"  - {s}" for s in rank_summary(text_rows, TEXT_COLUMNS, name)] + [""]
    return lines


def conservation_lines(vision: Dict, text: Dict) -> List[str]:
    """End-to-end conservation of each preset on the trained models: |in - out - absorbed| / |in|, where
    absorbed is the relevance the biases and other absorbing terms take (relprop.evaluation.conservation)."""
    lines = ["## Conservation per preset (end to end; trained models with biases)", "",
             "| model | preset | mean rel. error | max rel. error |", "|---|---|---:|---:|"]
    for what, part in (("images", vision), ("text", text)):
        for preset, rep in part["conservation"].items():
            err = rep.end_to_end.error
            lines.append(f"| {what} | {preset} | {float(err.mean()):.2e} | {float(err.max()):.2e} |")
    return lines + [""]


# ---------------------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(HERE, "out"), help="output folder (default: %(default)s)")
    p.add_argument("--quick", action="store_true", help="a ~3-minute smoke run (small data, short training)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reuse-models", action="store_true",
                   help="skip training where OUT/models already holds a model (same data seed)")
    p.add_argument("--skip-checks", action="store_true", help="skip the diagnostics of checks.py")
    p.add_argument("--text-test", type=int, help="test sentences (overrides the configuration)")
    p.add_argument("--vision-test", type=int, help="one-object test images (overrides the configuration)")
    p.add_argument("--vision-two", type=int, help="two-object test images (overrides the configuration)")
    args = p.parse_args(argv)
    cfg = dict(CONFIGS["quick" if args.quick else "full"])
    for key in ("text_test", "vision_test", "vision_two"):
        if getattr(args, key) is not None:
            cfg[key] = getattr(args, key)
    out = args.out
    os.makedirs(out, exist_ok=True)
    log = Log(os.path.join(out, "run.log"))
    torch.manual_seed(args.seed)
    t_all = time.time()
    timings: Dict[str, float] = {}
    log(f"faithfulness benchmark ({'quick' if args.quick else 'full'}), seed {args.seed}, torch threads "
        f"{torch.get_num_threads()}, out {out}")

    t = time.time()
    data = make_data(out, cfg, args.seed)
    timings["data"] = time.time() - t
    log(f"data: {len(data['text_train'])} training / {len(data['text_test'])} test sentences, "
        f"{cfg['vision_test']} one-object and {cfg['vision_two']} two-object test images ({timings['data']:.0f}s)")

    # ---- text model
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    tdir = os.path.join(out, "models", "text")
    t = time.time()
    if args.reuse_models and os.path.isfile(os.path.join(tdir, "config.json")):
        text_train = {"reused": True}
    else:
        text_train = models.train_text(data["text_train"], cfg["text_steps"], tdir, args.seed, log=log)
    timings["train_text"] = time.time() - t
    tok = AutoTokenizer.from_pretrained(tdir, local_files_only=True)
    tm = AutoModelForSequenceClassification.from_pretrained(tdir, local_files_only=True).eval()
    text_acc = models.text_accuracy(tm, tok, data["text_test"])
    log(f"text model: {text_train} -> held-out {text_acc}")

    # ---- vision model
    vdir = os.path.join(out, "models", "vision")
    t = time.time()
    if args.reuse_models and os.path.isfile(os.path.join(vdir, "vit.pth")):
        vision_train = {"reused": True}
    else:
        vision_train = models.train_vision(cfg["vision_steps"], vdir, args.seed, log=log, **VIT_WIDTH)
    timings["train_vision"] = time.time() - t
    vit = models.load_vit(vdir)
    vision_acc = {"one_object": models.vision_accuracy(vit, data["one"]),
                  "two_objects": models.vision_accuracy(vit, data["two"])}
    log(f"vision model: {vision_train} -> held-out {vision_acc}")

    # ---- evaluation
    t = time.time()
    text = evaluate_text(out, data, cfg, log)
    timings["evaluate_text"] = time.time() - t
    t = time.time()
    vision = evaluate_vision(out, data, cfg, log)
    timings["evaluate_vision"] = time.time() - t

    checks_md = ""
    if not args.skip_checks:
        import checks
        t = time.time()
        checks_md = checks.run_all(out, text, vision, data, cfg, log)
        timings["checks"] = time.time() - t
    timings["total"] = time.time() - t_all

    # ---- summary
    summary = {"config": cfg, "quick": args.quick, "seed": args.seed, "threads": torch.get_num_threads(),
               "timings_s": timings, "text_training": text_train, "text_accuracy": text_acc,
               "vision_training": vision_train, "vision_accuracy": vision_acc,
               "vision": vision["rows"], "text": text["rows"],
               "skipped": {"vit_cx": "text (it masks pixels on a patch grid: vision only)"},
               "sampling": {"smoothgrad n_samples": cfg["sg_samples"], "integrated_gradients n_steps": cfg["ig_steps"]}}
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1, default=float)
    md = [f"# Faithfulness benchmark ({'quick' if args.quick else 'full'} run)", "",
          "Timings (s): " + ", ".join(f"{k} {v:.0f}" for k, v in timings.items()),
          f"Text model: held-out accuracy {text_acc['accuracy']:.3f} (single-topic {text_acc['accuracy_single']:.3f}, "
          f"mixed {text_acc['accuracy_mixed']:.3f}; n={text_acc['n']})",
          f"Vision model: held-out accuracy {vision_acc['one_object']['accuracy']:.3f} (one object, "
          f"n={vision_acc['one_object']['n']}); both classes in the top 2 on "
          f"{vision_acc['two_objects']['top2_accuracy']:.3f} of the two-object images", "",
          f"## Images ({vision['result'].samples} one-object test images; "
          f"{data['two']['images'].shape[0]} two-object images)", "",
          markdown_table(vision["rows"], VISION_COLUMNS), "",
          "transformer_attribution's rank per column:", ""] + \
         [f"- {s}" for s in rank_summary(vision["rows"], VISION_COLUMNS)] + \
         ["", f"## Text ({text['result'].samples} test sentences)", "", markdown_table(text["rows"], TEXT_COLUMNS), "",
          "transformer_attribution's rank per column:", ""] + \
         [f"- {s}" for s in rank_summary(text["rows"], TEXT_COLUMNS)] + [""] + \
         variant_ranks(vision["rows"], text["rows"]) + conservation_lines(vision, text) + ["", checks_md]
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    log(f"done in {timings['total']:.0f}s; wrote {os.path.join(out, 'summary.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
