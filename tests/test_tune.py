"""relprop.evaluation.tune (the survey's §1.4: aggregation choices as hyperparameters chosen on
held-out data): every setting equals evaluating that setting on its own, the ranking follows the
metric's direction, one forward/backward serves every setting, and the CLI's --grid."""
import numpy as np
import pytest
import torch

import models
import relprop
import relprop.evaluation as E
from relprop.engine import execute


@pytest.fixture(scope="module")
def vit():
    model = models.timm_vit_tiny()
    return model, models.image_batch(model, batch=3, seed=1)


def test_explain_settings_equals_explain_per_setting(vit):
    model, x = vit
    settings = [{}, {"head_fusion": "max"}, {"start_block": 1, "discard_ratio": 0.5}]
    many = relprop.explain_settings(model, x, settings, target=1, method="rollout")
    for s, e in zip(settings, many):
        one = relprop.explain(model, x, target=1, method="rollout", **s)
        assert torch.equal(e.scores, one.scores) and torch.equal(e.matrix, one.matrix), s


def test_one_engine_run_per_batch(vit, monkeypatch):
    """All settings of a batch share one forward/backward pass (one engine run)."""
    model, x = vit
    calls = []
    import relprop.api.method_runs as api

    def counted(request, schedule):
        calls.append(1)
        return execute(request, schedule)
    monkeypatch.setattr(api, "execute", counted)
    relprop.explain_settings(model, x, [{"head_fusion": f} for f in ("mean", "max", "min", "gradient")],
                             target=1, method="transformer_attribution")
    assert len(calls) == 1


def test_tune_ranks_settings_by_the_metric(vit):
    model, x = vit
    grid = {"head_fusion": ["mean", "max"], "start_block": [0, 1]}
    data = {"inputs": x}
    res = E.tune(model, data, "rollout", grid, metric="positive_auc", steps=[0.25, 0.5, 0.75], progress=False)
    assert len(res.rows) == 4 and not res.higher_is_better
    assert [r["score"] for r in res.rows] == sorted(r["score"] for r in res.rows)
    assert res.best == {k: res.rows[0][k] for k in grid}
    # each row is the perturbation AUC of that setting evaluated on its own
    for row in res.rows:
        opts = {k: row[k] for k in grid}
        e = relprop.explain(model, x, method="rollout", **opts)
        curve = E.perturbation_curve(model, x, e, e.target, "positive", [0.25, 0.5, 0.75])
        assert np.isclose(row["score"], float(np.mean(curve.per_sample_auc))), opts
    neg = E.tune(model, data, "rollout", grid, metric="negative_auc", steps=[0.25, 0.5, 0.75], progress=False)
    assert neg.higher_is_better and [r["score"] for r in neg.rows] == sorted((r["score"] for r in neg.rows),
                                                                             reverse=True)
    assert "| rank | head_fusion | start_block | negative_auc |" in repr(neg)


def test_tune_bad_input(vit):
    model, x = vit
    with pytest.raises(relprop.OptionError, match="metric='accuracy' is not a choice. Choices"):
        E.tune(model, {"inputs": x}, "rollout", {"head_fusion": ["mean"]}, metric="accuracy")
    with pytest.raises(relprop.OptionError, match=r"head_fusion='median' is not a choice"):
        E.tune(model, {"inputs": x}, "rollout", {"head_fusion": ["median"]}, progress=False)
    with pytest.raises(relprop.OptionError, match="at least one value"):
        E.tune(model, {"inputs": x}, "rollout", {"head_fusion": []})
    assert E.grid_settings({"a": [1, 2], "b": 3}) == [{"a": 1, "b": 3}, {"a": 2, "b": 3}]


def test_cli_grid(tmp_path, capsys):
    """`relprop evaluate ... --method rollout --grid head_fusion=mean,max start_block=0,1` ranks the 4 settings."""
    from test_evaluation import _saved_vit, _write_image_folder
    from relprop.cli import evaluate as command
    _write_image_folder(str(tmp_path / "data"))
    model_dir = _saved_vit(tmp_path / "vit")
    out = tmp_path / "out"
    code = command.main([str(tmp_path / "data"), "--model", model_dir, "--method", "rollout", "--out", str(out),
                         "--grid", "head_fusion=mean,max", "start_block=0,1", "--steps", "0.1,0.5,0.9",
                         "--no-progress", "--metric", "negative_auc"])
    assert code == 0
    text = (out / "tune.md").read_text()
    assert "| rank | head_fusion | start_block | negative_auc |" in text and text.count("| rollout") == 0
    assert len((out / "tune.csv").read_text().strip().splitlines()) == 5
    assert "best: {" in capsys.readouterr().out
    assert command.parse_grid(["discard_ratio=0,0.9", "positive=true,false", "end_block=none,-1"]) == {
        "discard_ratio": [0, 0.9], "positive": [True, False], "end_block": [None, -1]}
    code = command.main([str(tmp_path / "data"), "--model", model_dir, "--method", "rollout", "lrp", "--out",
                         str(out), "--grid", "head_fusion=mean"])
    assert code == 2 and "--grid tunes one method" in capsys.readouterr().err
