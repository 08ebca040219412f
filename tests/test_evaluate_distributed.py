"""``relprop evaluate`` at scale: sharded over processes with torchrun, resumable.

On a generated folder of 6 images with masks and a saved tiny HuggingFace ViT, in batches of 2:

* ``torchrun --standalone --nproc_per_node 2 -m relprop evaluate ...`` writes the same
  results.csv and curves.csv, byte for byte, as the single-process command, and both equal the
  in-process :func:`relprop.evaluation.evaluate` of the whole dataset;
* a run interrupted after some batches picks up from its output folder: it reads those batches
  back, computes the rest and writes the same tables; other settings on the same folder are refused.
"""
import os
import shutil
import subprocess
import sys

import pytest
import torch

import models
from relprop.cli import evaluate as command
from relprop.evaluation import datasets, report, runner
from relprop.evaluation.sharded import merge
from test_evaluation import _write_image_folder

METHODS = ["transformer_attribution", "rollout"]
STEPS = "0.3,0.6"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import ViTImageProcessor
    root = tmp_path_factory.mktemp("sharded")
    _write_image_folder(str(root / "data"), n=6)
    model_dir = str(root / "vit")
    models.hf_vit().save_pretrained(model_dir)
    ViTImageProcessor(image_mean=[0.5] * 3, image_std=[0.5] * 3, size={"height": 32, "width": 32}).save_pretrained(
        model_dir)
    return root, model_dir


def _argv(root, model_dir, out, *extra):
    return [str(root / "data"), "--model", model_dir, "--method", *METHODS, "--out", str(out), "--steps", STEPS,
            "--batch-size", "2", "--no-progress", "--device", "cpu", "--target", "label", *extra]


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                         env.get("PYTHONPATH", "")])
    return env


def _tables(out):
    return {name: (out / name).read_text() for name in ("results.csv", "curves.csv")}


@pytest.mark.slow  # torchrun starts two processes
def test_torchrun_two_processes_equal_single_process(setup, capsys):
    root, model_dir = setup
    single, double = root / "single", root / "double"
    assert command.main(_argv(root, model_dir, single)) == 0
    torchrun = shutil.which("torchrun")
    cmd = ([torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"]) + \
        ["--standalone", "--nproc_per_node", "2", "-m", "relprop", "evaluate", *_argv(root, model_dir, double)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _tables(single) == _tables(double)
    # rank 0 computed batches 0 and 2, rank 1 batch 1; the table holds all six images
    assert sorted(os.listdir(double / "partial")) == ["batch-000000.pkl", "batch-000001.pkl", "batch-000002.pkl",
                                                      "manifest.json"]
    assert proc.stdout.count("| transformer_attribution |") >= 1  # only rank 0 prints the table
    # ... and both equal evaluate() of the whole dataset in one process
    model = command.load_model(model_dir, "vision")
    data = datasets.ImageMaskFolder(str(root / "data"), image_size=(32, 32), normalization=([0.5] * 3, [0.5] * 3))
    whole = runner.evaluate(model, data, METHODS, target="label", batch_size=2, steps=[0.3, 0.6], progress=False)
    report.write_report(whole, str(root / "inprocess"))
    assert _tables(root / "inprocess") == _tables(single)
    with capsys.disabled():
        print("\nsingle-process vs 2-process torchrun evaluation: results.csv and curves.csv identical "
              f"({len(_tables(single)['results.csv'].splitlines()) - 1} methods, 6 images)")


def test_interrupted_run_resumes(setup, capsys):
    root, model_dir = setup
    out = root / "resumed"
    assert command.main(_argv(root, model_dir, out)) == 0
    full = _tables(out)
    # an interruption after the first two batches: batch 2 and the report were never written
    os.remove(out / "partial" / "batch-000002.pkl")
    for name in ("results.csv", "curves.csv"):
        os.remove(out / name)
    capsys.readouterr()
    assert command.main(_argv(root, model_dir, out)) == 0
    assert "2 batch(es) read back" in capsys.readouterr().out
    assert _tables(out) == full
    # other settings on the same folder: refused, exit code 2
    assert command.main(_argv(root, model_dir, out)[:-2] + ["--target", "predicted"]) == 2
    assert "partial results of another evaluation" in capsys.readouterr().err


def test_merge_equals_one_evaluation(zoo):
    """merge() of per-batch results equals evaluate() of the batches together (per-sample arrays)."""
    model = zoo("hf_vit")
    x = models.image_batch(model, batch=4, seed=5)
    masks = torch.zeros(4, 32, 32, dtype=torch.bool)
    masks[:, 8:20, 8:20] = True
    batches = [{"inputs": x[i:i + 2], "masks": masks[i:i + 2]} for i in (0, 2)]
    opts = dict(methods=METHODS, progress=False, steps=[0.3, 0.6])
    whole = runner.evaluate(model, batches, **opts)
    merged = merge([runner.evaluate(model, b, **opts) for b in batches])
    assert repr(whole.table()) == repr(merged.table())  # NaN where a metric does not apply
