"""benchmarks/faithfulness/tuned.py: the rows it reports are evaluate()'s rows of the default setting,
of the setting tune() chose on the validation data, and of the method's named extra settings."""
import importlib.util
import os

import pytest

import models
import relprop.evaluation as E

HERE = os.path.dirname(os.path.abspath(__file__))


def _tuned():
    # loaded under its own name; its "import models" finds this folder's models module (already imported), which
    # only tuned.main() would use
    path = os.path.join(os.path.dirname(HERE), "benchmarks", "faithfulness", "tuned.py")
    spec = importlib.util.spec_from_file_location("faithfulness_tuned", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_tune_and_test_reports_evaluate_rows_of_default_tuned_and_extra_settings(monkeypatch):
    tuned = _tuned()
    model = models.timm_vit_tiny()
    val = {"inputs": models.image_batch(model, batch=3, seed=1)}
    test = {"inputs": models.image_batch(model, batch=3, seed=2)}
    monkeypatch.setitem(tuned.GRIDS, "attention_norm", {"head_fusion": ["combined", "max"], "layers": ["last", "sum"]})
    common = dict(steps=[0.25, 0.5, 0.75], progress=False)
    res, rows, seconds = tuned.tune_and_test(model, val, test, "attention_norm", "positive_auc", common, {},
                                            ("default", "tuned"))
    assert len(res.rows) == 4 and seconds >= 0
    assert res.best == E.tune(model, val, "attention_norm", tuned.GRIDS["attention_norm"], metric="positive_auc",
                              **common).best
    assert list(rows) == ["default", "tuned", "attention_norm[layers=rollout]"]
    for name, opts in (("default", {}), ("tuned", res.best), ("attention_norm[layers=rollout]", {"layers": "rollout"})):
        want = E.evaluate(model, test, ["attention_norm"], explain_options=opts, kendall=False, conservation=False,
                          **common).table()[0]
        assert rows[name] == want, name
    lines = tuned.table_rows("attention_norm", res.best, rows, ["positive_auc"])
    assert lines[0] == f"| attention_norm | default | {rows['default']['positive_auc']:.3f} |"
    assert lines[1].startswith("| attention_norm[tuned] | " + ", ".join(f"{k}={v}" for k, v in res.best.items()))
    assert lines[2].startswith("| attention_norm[layers=rollout] | layers=rollout | ")
