"""The ``lrp`` rows under ``"attnlrp"`` and ``"pa_lrp"`` alone, on the models and test data a run of
``run.py`` left in ``--out`` (``--reuse-models``): a shorter way to the PA-LRP rows of the faithfulness
table than the whole run (every method) when time is short.

    python benchmarks/faithfulness/pa_rows.py --out OUT
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import models  # noqa: E402
import synth  # noqa: E402

import relprop.evaluation as E  # noqa: E402

TEXT_K = 3
PRESETS = ("attnlrp", "pa_lrp")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    args = p.parse_args()
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    mdir = os.path.join(args.out, "models", "text")
    tok = AutoTokenizer.from_pretrained(mdir, local_files_only=True)
    text = AutoModelForSequenceClassification.from_pretrained(mdir, local_files_only=True).eval()
    ds = E.RationaleJSONL(os.path.join(args.out, "data", "text", "test.jsonl"), tok)
    vit = models.load_vit(os.path.join(args.out, "models", "vision"))
    folder = E.ImageMaskFolder(os.path.join(args.out, "data", "vision", "test"), normalization=(synth.MEAN, synth.STD))
    for preset in PRESETS:
        t = time.time()
        r = E.evaluate(text, ds, ["lrp"], preset=preset, target="predicted", batch_size=16, rationale_k=TEXT_K,
                       perturbation_batch_size=128, progress=False)
        E.write_report(r, os.path.join(args.out, "pa_rows", "text_" + preset))
        print(f"## text, lrp[{preset}] ({r.samples} sentences, {time.time() - t:.0f}s)", flush=True)
        print(open(os.path.join(args.out, "pa_rows", "text_" + preset, "results.md")).read(), flush=True)
        t = time.time()
        r = E.evaluate(vit, folder, ["lrp"], preset=preset, target="predicted", batch_size=16,
                       perturbation_batch_size=256, progress=False)
        E.write_report(r, os.path.join(args.out, "pa_rows", "vision_" + preset))
        print(f"## vision, lrp[{preset}] ({r.samples} images, {time.time() - t:.0f}s)", flush=True)
        print(open(os.path.join(args.out, "pa_rows", "vision_" + preset, "results.md")).read(), flush=True)


if __name__ == "__main__":
    main()
