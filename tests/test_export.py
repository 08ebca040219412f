"""Explanations as data: exp[i] and slices select samples (every per-sample field alike), to_dict / JSON /
NPZ round-trip the scores exactly, the tidy table has one row per sample and position with the names,
and the names fall back to "token j" / "patch (r, c)" / "class t" when the explanation knows none."""
import json

import numpy as np
import pytest
import torch

import models
import relprop
from explanations import fake_image, fake_text
from relprop import Explanation


@pytest.fixture(scope="module")
def text_exp(zoo):
    model = zoo("hf_bert_eager")
    batch = models.text_batch(lengths=(7, 4, 5))
    return relprop.explain(model, batch, target=[0, 1, 0], method="transformer_attribution")


def test_index_selects_one_sample_with_every_field(text_exp):
    exp = text_exp
    for i in (0, 2, -1, -3):
        one = exp[i]
        j = i % 3
        assert isinstance(one, Explanation) and len(one) == 1
        assert torch.equal(one.scores[0], exp.scores[j]) and torch.equal(one.mask[0], exp.mask[j])
        assert int(one.target[0]) == int(exp.target[j]) and one.target_scores[0] == exp.target_scores[j]
        assert torch.equal(one.matrix[0], exp.matrix[j])
        for a, b in zip(one.blocks, exp.blocks):
            assert torch.equal(a.attention[0], b.attention[j]) and torch.equal(a.gradient[0], b.gradient[j])
        assert torch.equal(one.heads[0], exp.heads[j]) and torch.equal(one.logits[0], exp.logits[j])
    two = exp[1:]
    assert len(two) == 2 and torch.equal(two.scores, exp.scores[1:]) and torch.equal(two.target, exp.target[1:])
    assert exp.scores.shape[0] == 3  # the original is untouched


def test_index_out_of_range_names_the_valid_range(text_exp):
    with pytest.raises(IndexError, match=r"3 samples \(valid: -3 to 2\)"):
        text_exp[3]
    with pytest.raises(IndexError, match="valid: -3 to 2"):
        text_exp[-4]
    with pytest.raises(TypeError, match="sample number or a slice"):
        text_exp["a"]


def test_to_dict_json_round_trip(text_exp, tmp_path):
    exp = text_exp
    d = exp.to_dict()
    assert json.loads(json.dumps(d)) == d  # JSON-serialisable
    assert d["method"] == "transformer_attribution" and len(d["samples"]) == 3
    s = d["samples"][1]
    assert s["target"] == 1 and s["target_label"] == "class 1"
    assert s["positions"][:2] == ["token 0", "token 1"]  # no tokens known: named by position
    assert np.array_equal(np.array(s["scores"], dtype=np.float32), exp.scores[1].numpy())
    assert s["mask"] == exp.mask[1].tolist()
    path = exp.to_json(str(tmp_path / "e.json"), labels={0: "neg", 1: "pos"})
    back = json.load(open(path))
    assert back["samples"][1]["target_label"] == "pos" and back["samples"][0]["target_label"] == "neg"
    assert json.loads(exp.to_json()) == d
    rows = [[f"w{j}" for j in range(exp.scores.shape[1])] for _ in range(3)]
    assert exp.to_dict(tokens=rows)["samples"][2]["positions"] == rows[2]


def test_npz_round_trip(text_exp, tmp_path):
    exp = text_exp
    path = exp.save_npz(str(tmp_path / "e.npz"), labels=["neg", "pos"])
    back = Explanation.load_npz(path)
    assert torch.equal(back.scores, exp.scores.float()) and torch.equal(back.mask, exp.mask)
    assert torch.equal(back.target, exp.target) and torch.equal(back.target_scores, exp.target_scores.float())
    assert back.method == exp.method and back.preset == exp.preset and back.signed == exp.signed
    raw = np.load(path)
    assert np.array_equal(raw["scores"], exp.scores.numpy())
    assert json.loads(raw["meta"][()])["samples"][1]["target_label"] == "pos"
    assert back.to_dict()["samples"] == exp.to_dict()["samples"]
    np.savez(str(tmp_path / "other.npz"), scores=np.zeros(3))
    with pytest.raises(ValueError, match="not an explanation saved by relprop"):
        Explanation.load_npz(str(tmp_path / "other.npz"))


def test_image_npz_keeps_the_map(tmp_path):
    m = np.arange(64, dtype=np.float32).reshape(8, 8) - 30
    exp = fake_image(np.stack([m, -m]), target=(1, 2))
    back = Explanation.load_npz(exp.save_npz(str(tmp_path / "i.npz")))
    assert torch.equal(back.map, exp.map) and back.grid == (2, 2) and back.modality == "vision"
    d = exp.to_dict(include_map=True)
    assert d["samples"][0]["positions"] == ["patch (0, 0)", "patch (0, 1)", "patch (1, 0)", "patch (1, 1)"]
    assert np.array_equal(np.array(d["samples"][1]["map"], dtype=np.float32), -m)
    one = exp[-1]
    assert torch.equal(one.map[0], exp.map[1]) and int(one.target[0]) == 2


def test_table_is_tidy():
    exp = fake_text([[0.0, 2.0, -1.0], [0.0, 0.5, 0.25]], mask=[[False, True, True], [False, True, True]],
                    target=(1,))
    table = exp.to_table(tokens=[["[CLS]", "good", "film"], ["[CLS]", "a", "film"]], labels=["neg", "pos"])
    rows = table.to_dict("records") if hasattr(table, "to_dict") else table
    assert len(rows) == 6
    assert rows[1] == {"sample": 0, "position": 1, "name": "good", "score": 2.0, "mask": True, "target": 1,
                       "target_label": "pos", "method": "lrp"}
    assert rows[3]["name"] == "[CLS]" and rows[3]["mask"] is False or not rows[3]["mask"]
    assert sum(r["score"] for r in rows if r["sample"] == 1) == pytest.approx(0.75)


def test_table_is_a_data_frame_with_pandas():
    pd = pytest.importorskip("pandas", reason="pandas is optional: without it to_table returns a list of dicts")
    table = fake_text([[1.0, 2.0]]).to_table()
    assert isinstance(table, pd.DataFrame) and list(table["name"]) == ["token 0", "token 1"]


def test_repr_shows_a_missing_preset_as_none():
    exp = fake_text([[1.0, 2.0]], method="rollout", preset=None)
    assert "preset=None" in repr(exp) and "preset='None'" not in repr(exp)
    assert "preset='attnlrp'" in repr(fake_text([[1.0]], preset="attnlrp"))
