"""The evaluation API: the papers' metrics on hand-made cases with known answers, batch
invariance, the datasets on disk and the ``relprop evaluate`` command on tiny generated data."""
import csv
import json
import os

import numpy as np
import pytest
import torch

import models
import relprop
import relprop.evaluation as E
from relprop.cli import evaluate as command


# ------------------------------------------------------------------------------------------ toy models
class SumImage(torch.nn.Module):
    """Two classes: logit 1 = sum of the (normalized) pixels, logit 0 = ``threshold``."""

    def __init__(self, threshold=0.5):
        super().__init__()
        self.threshold = threshold
        self.seen = []

    def forward(self, x):
        self.seen.append(x.detach().clone())
        s = x.flatten(1).sum(1)
        return torch.stack([torch.full_like(s, self.threshold), s], 1)


class SumTokens(torch.nn.Module):
    """Two classes: logit 1 = Σ value[id] over attended tokens, logit 0 = ``threshold`` (id 0 = [PAD], value 0)."""

    def __init__(self, values, threshold=0.0):
        super().__init__()
        self.register_buffer("values", torch.as_tensor(values, dtype=torch.float32))
        self.threshold = threshold
        self.config = type("Config", (), {"pad_token_id": 0})()

    def forward(self, input_ids, attention_mask=None):
        am = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        s = (self.values[input_ids] * am).sum(1)
        return torch.stack([torch.full_like(s, self.threshold), s], 1)


def _object_images(sizes, side=10):
    """[n, 1, side, side] images with ``sizes[i]`` object pixels of value 1 (row-major), 0 elsewhere."""
    x = torch.zeros(len(sizes), side * side)
    for i, n in enumerate(sizes):
        x[i, :n] = 1.0
    return x.reshape(len(sizes), 1, side, side)


# ---------------------------------------------------------------------------------------- perturbation
def test_perturbation_curve_exact_on_a_sum_model():
    """CVPR 2021 §4: with a perfect map, positive removal keeps an object of n of 100 pixels until f·100 ≥ n."""
    sizes = [35, 5, 100, 61]
    x = _object_images(sizes)
    model = SumImage(threshold=0.5)  # class 1 while one object pixel is left
    pos = E.perturbation_curve(model, x, x[:, 0], mode="positive")
    neg = E.perturbation_curve(model, x, x[:, 0], mode="negative")
    f = np.array(E.DEFAULT_STEPS)
    expected = np.array([[100 * fi < n - 1e-9 for fi in f] for n in sizes])
    assert np.array_equal(pos.per_sample_correct, expected)
    assert np.array_equal(pos.removed[0], np.floor(f * 100 + 1e-9).astype(int))
    assert neg.per_sample_correct.all()  # background goes first; the object survives up to 90 %
    assert pos.auc == pytest.approx(sum((expected.mean(0)[1:] + expected.mean(0)[:-1]) / 2 * 0.1))
    assert pos.per_sample_auc.mean() == pytest.approx(pos.auc)
    assert neg.auc == pytest.approx(0.8)
    assert np.array_equal(pos.target, [1, 1, 1, 1]) and pos.clean_correct.all()


def test_reversed_ranking_flips_positive_and_negative_auc():
    """CVPR 2021 Table 1: a reversed ranking turns the positive curve into the negative one and back."""
    x = _object_images([10, 20, 30])
    model = SumImage(threshold=0.5)
    good = x[:, 0] + 0.01 * torch.rand(3, 10, 10, generator=torch.Generator().manual_seed(0))
    aucs = {(sign, mode): E.perturbation_curve(model, x, sign * good, mode=mode).auc
            for sign in (1, -1) for mode in ("positive", "negative")}
    assert aucs[(1, "positive")] < aucs[(1, "negative")]
    assert aucs[(1, "positive")] == pytest.approx(aucs[(-1, "negative")])
    assert aucs[(1, "negative")] == pytest.approx(aucs[(-1, "positive")])
    assert aucs[(1, "negative")] == pytest.approx(0.8) and aucs[(1, "positive")] < 0.2


def test_baseline_is_given_in_unnormalized_space():
    """Removed pixels take (baseline − mean)/std: 0 = black un-normalized (CVPR 2021 code); default 0 normalized."""
    x = torch.ones(1, 3, 4, 4)
    model = SumImage()
    norm = ((0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
    E.perturbation_curve(model, x, torch.arange(16.0).reshape(1, 4, 4), steps=[0.5], normalization=norm)
    seen = model.seen[-1][0]
    assert torch.all(seen[:, 2:, :] == -2.0) and torch.all(seen[:, :2, :] == 1.0)  # the 8 highest pixels: rows 2-3
    E.perturbation_curve(model, x, torch.arange(16.0).reshape(1, 4, 4), steps=[0.5], baseline=(1.0, 0.5, 0.0),
                         normalization=norm)
    assert model.seen[-1][0, :, 3, 3].tolist() == [2.0, 0.0, -2.0]
    E.perturbation_curve(model, x, torch.arange(16.0).reshape(1, 4, 4), steps=[0.5])
    assert torch.all(model.seen[-1][0][:, 2:, :] == 0.0)


def test_patch_unit_removes_whole_patches():
    """unit='patch' ranks exp.scores on the patch grid and blanks whole patches."""
    x = torch.ones(1, 1, 4, 4)
    model = SumImage()
    E.perturbation_curve(model, x, torch.tensor([[4.0, 1.0, 3.0, 2.0]]), steps=[0.5], unit="patch")
    seen = model.seen[-1][0, 0]
    assert seen[:2, :2].eq(0).all() and seen[2:, :2].eq(0).all() and seen[:, 2:].eq(1).all()


def test_text_removal_never_touches_special_tokens_and_delete_updates_the_mask():
    """Text: [CLS]/[SEP]/padding are never removed; 'delete' shifts tokens left and pads the attention mask."""
    ids = torch.tensor([[2, 5, 6, 7, 3, 0]])
    am = torch.tensor([[1, 1, 1, 1, 1, 0]])
    removable = torch.tensor([[False, True, True, True, False, False]])
    scores = torch.tensor([[9.0, 1.0, 3.0, 2.0, 9.0, 9.0]])
    seen = []

    class Record(SumTokens):
        def forward(self, input_ids, attention_mask=None):
            seen.append((input_ids.clone(), attention_mask.clone()))
            return super().forward(input_ids, attention_mask)

    model = Record(torch.ones(10))
    E.perturbation_curve(model, {"input_ids": ids, "attention_mask": am}, scores, steps=[0.34, 1.0],
                         removal="delete", removable=removable, batch_size=2)
    ids1, am1 = seen[1]  # seen[0] is the clean pass; then both copies in one chunk
    assert ids1[0].tolist() == [2, 5, 7, 3, 0, 0] and am1[0].tolist() == [1, 1, 1, 1, 0, 0]
    assert ids1[1].tolist() == [2, 3, 0, 0, 0, 0] and am1[1].tolist() == [1, 1, 0, 0, 0, 0]
    seen.clear()
    E.perturbation_curve(model, {"input_ids": ids, "attention_mask": am}, scores, steps=[1.0], removal="mask",
                         removable=removable, tokenizer=type("T", (), {"mask_token_id": 4, "pad_token_id": 0})())
    assert seen[-1][0][0].tolist() == [2, 4, 4, 4, 3, 0] and seen[-1][1][0].tolist() == am[0].tolist()


def test_perturbation_is_batch_invariant(zoo):
    """Per-sample evaluation: a batch gives what its samples give alone, for any chunk size."""
    model = zoo("hf_vit")
    x = models.image_batch(model, batch=3, seed=1)
    exp = relprop.explain(model, x, method="rollout")
    whole = E.perturbation_curve(model, x, exp.map, target=[0, 1, 2], mode="positive", batch_size=5)
    for i in range(3):
        one = E.perturbation_curve(model, x[i:i + 1], exp.map[i:i + 1], target=[i], mode="positive", batch_size=2)
        assert np.array_equal(one.per_sample_correct[0], whole.per_sample_correct[i])
        assert np.allclose(one.log_probability[0], whole.log_probability[i], atol=1e-5)
    bert = zoo("hf_bert_eager")
    tb = models.text_batch()
    texp = relprop.explain(bert, tb, method="attcat")
    whole = E.aopc(bert, tb, texp, batch_size=7)
    for i in range(4):
        sample = {k: v[i:i + 1] for k, v in tb.items()}
        one = E.aopc(bert, sample, texp.scores[i:i + 1], removable=texp.mask[i:i + 1], batch_size=3)
        assert np.allclose(one.per_sample, whole.per_sample[i], atol=1e-6)


# ---------------------------------------------------------------------------------------- segmentation
def test_perfect_map_scores_one_and_inverted_map_zero():
    """CVPR 2021 Table 2: the mask itself as a map gives pixel accuracy, mIoU and mAP of 1; its inverse 0."""
    mask = torch.zeros(2, 8, 8, dtype=torch.bool)
    mask[0, 2:6, 1:5] = True
    mask[1, :, :3] = True
    perfect = E.segmentation_scores(mask.float() * 0.7 + 0.1, mask)
    assert perfect.mean_pixel_accuracy == 1.0 and perfect.mean_miou == 1.0 and perfect.mean_ap == pytest.approx(1.0)
    inverse = E.segmentation_scores(1.0 - mask.float(), mask)
    assert inverse.mean_pixel_accuracy == 0.0 and inverse.mean_miou == 0.0


def test_segmentation_hand_computed_case():
    """Threshold at the map's mean, IoU of foreground and background averaged per image (CVPR 2021 §4)."""
    mask = torch.tensor([[[1, 1, 0, 0]]], dtype=torch.bool).reshape(1, 2, 2)
    smap = torch.tensor([[[0.9, 0.1], [0.8, 0.2]]])  # mean 0.5 -> foreground predicted at (0,0) and (1,0)
    r = E.segmentation_scores(smap, mask)  # truth fg = row 0; pred fg = column 0
    assert r.pixel_accuracy[0] == pytest.approx(0.5)
    assert r.iou_foreground[0] == pytest.approx(1 / 3) and r.iou_background[0] == pytest.approx(1 / 3)
    assert r.miou[0] == pytest.approx(1 / 3) and r.pooled_miou == pytest.approx(1 / 3)
    assert r.ap[0] == pytest.approx(0.5 * (1.0 + 2 / 4))  # ranked 0.9 (fg), 0.8, 0.2, 0.1 (fg): P 1, then 2/4


# ------------------------------------------------------------------------------------------------ text
def test_token_f1_and_precision_at_k_by_hand():
    """ERASER token-F1 of the top-k and AttCAT Precision@K on a hand-made rationale."""
    scores = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0, 0.0]])
    rationale = torch.tensor([[True, False, True, False, False, True]])
    assert E.token_f1(scores, rationale, 2)[0] == pytest.approx(0.4)  # P 1/2, R 1/3
    assert E.precision_at_k(scores, rationale, 2)[0] == pytest.approx(0.5)
    mask = torch.tensor([[False, True, True, True, True, True]])  # position 0 is [CLS]
    assert E.token_f1(scores, rationale, 2, mask)[0] == pytest.approx(0.5)  # top-2 {1, 2}; R {2, 5}
    assert E.token_f1(scores, rationale, 6, mask)[0] == pytest.approx(2 * 0.4 * 1 / 1.4)  # all 5: P 2/5, R 1
    assert np.isnan(E.token_f1(scores, torch.zeros_like(rationale), 2)[0])


def test_kendall_tau_identical_and_reversed_rankings():
    """AttCAT Eq. 15: Kendall-τ is 1 for identical rankings and −1 for reversed ones, over unmasked tokens."""
    a = torch.tensor([[0.3, 0.1, 0.9, 0.5, 7.0], [1.0, 2.0, 3.0, 4.0, 5.0]])
    mask = torch.tensor([[True, True, True, True, False]] * 2)
    assert np.allclose(E.kendall_tau(a, a * 2 + 1, mask), 1.0)
    assert np.allclose(E.kendall_tau(a, -a, mask), -1.0)


def test_aopc_of_a_random_ranking_lies_between_best_and_worst():
    """AttCAT Eq. 13–14: AOPC(best) ≥ AOPC(random) ≥ AOPC(worst), log-odds the other way, on a sum model."""
    g = torch.Generator().manual_seed(0)
    values = torch.cat([torch.zeros(1), torch.rand(19, generator=g) * 2 - 0.5])
    model = SumTokens(values, threshold=1.0)
    ids = torch.randint(1, 20, (6, 12), generator=g)
    am = torch.ones_like(ids)
    am[3, 9:] = 0
    inputs = {"input_ids": ids, "attention_mask": am}
    best = values[ids]
    rand = torch.rand(ids.shape, generator=g)
    results = {}
    for name, s in (("best", best), ("random", rand), ("worst", -best)):
        results[name] = (E.aopc(model, inputs, s, target=1).per_sample,
                         E.log_odds(model, inputs, s, target=1).per_sample)
    assert np.all(results["best"][0] >= results["random"][0] - 1e-7)
    assert np.all(results["random"][0] >= results["worst"][0] - 1e-7)
    assert np.all(results["best"][1] <= results["random"][1] + 1e-7)
    assert np.all(results["random"][1] <= results["worst"][1] + 1e-7)
    assert results["best"][0].mean() > results["worst"][0].mean()
    # by hand for one text: AOPC = mean over k of p(y|x) - p(y|x̃_k), deleting the top 10·k % tokens
    r = E.aopc(model, inputs, best, target=1)
    p = torch.softmax(torch.stack([torch.tensor(1.0), best[0].sum()]), 0)[1]
    order = best[0].sort(descending=True, stable=True).values
    drops = [float(p - torch.softmax(torch.stack([torch.tensor(1.0), order[int(np.floor(f * 12 + 1e-9)):].sum()]),
                                     0)[1]) for f in E.AOPC_STEPS]
    assert r.per_sample[0] == pytest.approx(np.mean(drops), abs=1e-6)


# ---------------------------------------------------------------------------------------- conservation
def test_conservation_report_rows_per_block_and_end_to_end(zoo):
    """Σ relevance in = out + absorbed per block and end to end under chefer2021; not under lrp."""
    model = zoo("hf_vit")
    x = models.image_batch(model, batch=2)
    ta = relprop.explain(model, x, method="transformer_attribution")
    lrp = relprop.explain(model, x, method="lrp", preset="lrp")  # the paper's plain-LRP baseline
    rep = E.conservation_report(ta)
    assert [r.name for r in rep.rows] == [b.name for b in reversed(ta.blocks)] + ["end to end"]
    assert rep.max_error < 1e-4 and np.allclose(rep.end_to_end.relevance_in, 1.0)
    assert all(r.error.max() < 1e-4 for r in rep.blocks)
    assert E.conservation_report(lrp).preset == "lrp" and E.conservation_report(lrp).max_error > 1e-3
    assert "| end to end |" in rep.to_markdown()


# -------------------------------------------------------------------------------------- datasets & runner
def _write_image_folder(root, n=4, size=32, labels=True):
    from PIL import Image
    os.makedirs(os.path.join(root, "images"))
    os.makedirs(os.path.join(root, "masks"))
    rng = np.random.default_rng(0)
    for i in range(n):
        img = (rng.random((size, size, 3)) * 80).astype(np.uint8)
        mask = np.zeros((size, size), dtype=np.uint8)
        y, x = rng.integers(0, size // 2, 2)
        img[y:y + 12, x:x + 12] = [220, 40 * i, 30]
        mask[y:y + 12, x:x + 12] = 255
        Image.fromarray(img).save(os.path.join(root, "images", f"img{i}.png"))
        Image.fromarray(mask).save(os.path.join(root, "masks", f"img{i}.png"))
    if labels:
        with open(os.path.join(root, "labels.csv"), "w") as f:
            f.write("name,label\n" + "".join(f"img{i}.png,{i % 5}\n" for i in range(n)))


WORDS = ["a", "fine", "film", "dull", "one", "great", "plot", "bad", "acting", "the", "was", "and", "movie"]


def _tokenizer():
    from transformers import BertTokenizerFast
    vocab = {t: i for i, t in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS)}
    return BertTokenizerFast(vocab=vocab)


def _saved_vit(folder) -> str:
    """A tiny HF ViT and its image processor (mean = std = 0.5, 32×32) saved in ``folder``."""
    from transformers import ViTImageProcessor
    models.hf_vit().save_pretrained(str(folder))
    ViTImageProcessor(image_mean=[0.5] * 3, image_std=[0.5] * 3, size={"height": 32, "width": 32}).save_pretrained(
        str(folder))
    return str(folder)


def _saved_bert(folder) -> str:
    """A tiny HF BERT and a tokenizer over ``WORDS`` saved in ``folder``."""
    models.hf_bert().save_pretrained(str(folder))
    _tokenizer().save_pretrained(str(folder))
    return str(folder)


def _write_jsonl(path):
    lines = [{"text": "a fine film", "label": 1, "rationale": ["fine"]},
             {"text": "a dull one", "label": 0, "rationale": [[2, 6]]},
             {"text": "the plot was great and the acting fine", "label": 1, "rationale": ["great", "fine"]},
             {"text": "bad movie", "label": 2, "rationale": ["bad"]}]
    with open(path, "w") as f:
        f.write("\n".join(json.dumps(r) for r in lines) + "\n")


def test_datasets_read_images_masks_and_rationales(tmp_path):
    """Folder of images with masks (resized, normalized) and JSONL rationales mapped onto tokens."""
    _write_image_folder(str(tmp_path / "img"))
    data = E.ImageMaskFolder(str(tmp_path / "img"), image_size=16, normalization=((0.5,) * 3, (0.5,) * 3))
    (batch,) = list(data.batches(8))
    assert batch["inputs"].shape == (4, 3, 16, 16) and batch["masks"].shape == (4, 16, 16)
    assert batch["inputs"].min() >= -1 and batch["inputs"].max() <= 1 and batch["masks"].any()
    assert batch["labels"].tolist() == [0, 1, 2, 3]
    _write_jsonl(str(tmp_path / "t.jsonl"))
    texts = E.RationaleJSONL(str(tmp_path / "t.jsonl"), _tokenizer())
    (tb,) = list(texts.batches(8))
    tok = texts.tokenizer
    marked = [[tok.convert_ids_to_tokens(int(t)) for t, r in zip(ids, rat) if r]
              for ids, rat in zip(tb["inputs"]["input_ids"], tb["rationales"])]
    assert marked == [["fine"], ["dull"], ["great", "fine"], ["bad"]]
    assert tb["special_tokens_mask"][:, 0].all() and tb["labels"].tolist() == [1, 0, 1, 2]


#: float32 machine epsilon: the tolerances below are multiples of it, measured (torch 2.14.1, CPU)
EPS32 = float(torch.finfo(torch.float32).eps)
#: a map computed in a batch of 3 and alone: at most 1.6 eps of its largest |score| apart (measured: 1.1e-11
#: on 5.7e-5 for transformer_attribution, 0 for rollout); 8 eps leaves room for other kernels
MAP_TOL = 8 * EPS32
#: the log-probability of the same perturbed copy in a batch and alone: 1.2e-7 apart (measured, |log p| < 1.7),
#: i.e. about 1 eps of |log p|; 8 eps of the largest |log p|
LOGP_TOL = 8 * EPS32


def test_evaluate_is_batch_invariant_and_reports_every_metric(zoo, tmp_path):
    """evaluate(): one explain call per batch, per-sample metrics; a batch equals its samples one by one.

    A map computed in a batch and alone differs by float32 rounding (MAP_TOL); where it does, pixels whose
    scores are that close may be ranked in the other order and other pixels removed, so the perturbation
    curves are compared on the samples whose maps are bit-identical (there: to the rounding of one
    forward pass, LOGP_TOL), and at least one sample per method is."""
    model = zoo("hf_vit")
    x = models.image_batch(model, batch=3, seed=2)
    masks = x[:, 0] > 0.5
    methods = ["transformer_attribution", "rollout"]
    whole = E.evaluate(model, {"inputs": x, "masks": masks}, methods, progress=False, steps=[0.0, 0.3, 0.6, 0.9])
    parts = E.evaluate(model, [{"inputs": x[i:i + 1], "masks": masks[i:i + 1]} for i in range(3)], methods,
                       progress=False, steps=[0.0, 0.3, 0.6, 0.9])
    batched = relprop.explain(model, x, method=methods)
    for m, exp in zip(methods, batched):
        alone = [relprop.explain(model, x[i:i + 1], method=m).map[0] for i in range(3)]
        for i in range(3):
            scale = float(exp.map[i].abs().max())
            assert float((exp.map[i] - alone[i]).abs().max()) <= MAP_TOL * scale, (m, i)
        same = [i for i in range(3) if torch.equal(exp.map[i], alone[i])]
        assert same, f"{m}: no sample's map is bit-identical in the batch and alone"
        for mode in ("positive", "negative"):
            a, b = whole.perturbation[m][mode], parts.perturbation[m][mode]
            assert np.array_equal(a.removed, b.removed)
            assert np.array_equal(a.per_sample_correct[same], b.per_sample_correct[same])
            scale = float(np.abs(a.log_probability).max())
            assert np.allclose(a.log_probability[same], b.log_probability[same], rtol=0, atol=LOGP_TOL * scale)
        assert np.allclose(whole.segmentation[m].miou, parts.segmentation[m].miou, atol=1e-6)
    rows = whole.table()
    assert [r["method"] for r in rows] == methods
    assert {"positive_auc", "negative_auc", "pixel_accuracy", "miou", "map", "conservation_error"} <= set(rows[0])
    assert whole.samples == parts.samples == 3 and "chefer2021" in whole.conservation
    paths = E.write_report(whole, str(tmp_path / "out"))
    assert all(os.path.getsize(p) > 0 for p in paths.values())


# ----------------------------------------------------------------------------------------------- command
def _csv_rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_command_on_an_image_folder(tmp_path, capsys):
    """`relprop evaluate` on 32×32 PNGs with masks and a saved tiny HF ViT: files, one row per method."""
    _write_image_folder(str(tmp_path / "data"))
    model_dir = _saved_vit(tmp_path / "vit")
    out = tmp_path / "out"
    methods = ["transformer_attribution", "rollout", "lrp"]
    code = command.main([str(tmp_path / "data"), "--model", model_dir, "--method", *methods, "--out", str(out),
                         "--target", "label", "--steps", "0.1,0.5,0.9", "--no-progress", "--batch-size", "3"])
    assert code == 0
    assert {"results.md", "results.csv", "perturbation.png", "curves.csv"} <= set(os.listdir(out))
    rows = _csv_rows(out / "results.csv")
    assert [r["method"] for r in rows] == methods and all(r["samples"] == "4" for r in rows)
    assert all(0 <= float(r["miou"]) <= 1 and 0 <= float(r["positive_auc"]) <= 0.8 for r in rows)
    md = (out / "results.md").read_text()
    assert "mean=[0.5, 0.5, 0.5]" in md and md.count("| transformer_attribution |") == 3  # table + 2 curves
    assert "target: label" in md


def test_command_on_a_jsonl_file(tmp_path, capsys):
    """`relprop evaluate` on a 4-line JSONL with rationales and a saved tiny BERT with a local vocabulary."""
    data = str(tmp_path / "texts.jsonl")
    _write_jsonl(data)
    model_dir = _saved_bert(tmp_path / "bert")
    out = tmp_path / "out"
    methods = ["transformer_attribution", "attcat", "rollout"]
    code = command.main([data, "--model", model_dir, "--method", *methods, "--out", str(out), "--k", "1", "2",
                         "--no-progress", "--batch-size", "3"])
    assert code == 0
    rows = _csv_rows(out / "results.csv")
    assert [r["method"] for r in rows] == methods
    for r in rows:
        assert 0 <= float(r["token_f1@1"]) <= 1 and 0 <= float(r["precision@2"]) <= 1
        assert -1 <= float(r["kendall_tau"]) <= 1 and r["aopc"] and r["log_odds"]
    rollout = rows[2]
    assert float(rollout["kendall_tau"]) == pytest.approx(1.0)  # class-agnostic: same ranking for both classes
    assert (out / "perturbation.png").stat().st_size > 0 and "| rollout |" in capsys.readouterr().out


def test_command_as_a_subcommand_reports_bad_input(tmp_path, capsys):
    """add_parser() wires `evaluate` into a CLI (func=run); a missing dataset exits with code 2, not a traceback."""
    import argparse
    parser = argparse.ArgumentParser(prog="relprop")
    command.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["evaluate", str(tmp_path / "nothing.jsonl"), "--model", "x", "--out", str(tmp_path),
                              "--method", "rollout", "--method", "lrp"])
    assert args.func is command.run and args.method == ["rollout", "lrp"]
    assert args.func(args) == 2 and "nothing.jsonl" in capsys.readouterr().err


def test_command_agrees_with_explain(tmp_path, capsys):
    """`relprop evaluate` takes the model names and the comma-separated methods of `relprop explain`, and a
    model it cannot load is relprop's one-line error with exit status 3, as for explain."""
    from relprop import cli
    data = str(tmp_path / "texts.jsonl")
    _write_jsonl(data)
    model_dir = _saved_bert(tmp_path / "bert")
    out = tmp_path / "out"
    code = command.main([data, "--model", model_dir, "--method", "rollout,raw_attention", "--out", str(out),
                         "--no-progress", "--no-aopc"])
    assert code == 0
    assert [r["method"] for r in _csv_rows(out / "results.csv")] == ["rollout", "raw_attention"]
    capsys.readouterr()
    for spec in ("no_such_model_xyz", str(tmp_path / "no_such_folder")):
        assert cli.main(["evaluate", data, "--model", spec, "--out", str(tmp_path / "o2")]) == 3
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("relprop: error: ") and "Traceback" not in err[0], err
    assert cli.main(["evaluate", data, "--model", model_dir, "--method", "rollout,nope", "--out", str(out)]) == 2
    assert "unknown method: 'nope'" in capsys.readouterr().err
