"""Diagnostics behind the analysis of the faithfulness benchmark (benchmarks/RESULTS.md).

Each check asks one question about why transformer_attribution (TA) ranks where it does:

1. definition: do the authors' other settings of TA change the picture (the BERT code's row-normalized
   I + Ā starting at the last block, the mean-pooled query row)? And a variant that is not a library
   option: each block's E_h(dA ⊙ R_A)⁺ scaled to unit row mass before the identity is added;
2. is the rollout of TA doing anything? TA against the first-order sum Σ_b E_h(dA_b ⊙ R_A,b)⁺[CLS]
   (if the identity dominates every I + Ā, the product is a sum and row normalization is a no-op);
3. where the class-specificity comes from: per block, the similarity of R_A, dA and (dA ⊙ R_A)⁺ between
   the two classes of one input, and (text) where R_A and TA put their mass when the minority class
   of a two-topic sentence is explained;
4. how concentrated the image maps are (effective number of patches, mass on the object);
5. images: removing pixels (map upsampled) vs whole patches in the perturbation test;
6. images: signed methods ranked by their signed score vs by its magnitude;
7. images: vit_cx and integrated_gradients with a black baseline (the colour the perturbation test
   removes to, and the background's) instead of their default 0 in normalized space (mid grey);
8. the eps stabilizer;
9. conservation of the chefer2021 rules on the trained models, and batch invariance.

Everything goes through relprop.explain and relprop.evaluation; numbers are written to OUT/checks.md and
OUT/checks.json.
"""
from __future__ import annotations

import json
import os
import time
from typing import Dict, List

import numpy as np
import torch
import torch.nn.functional as F

import relprop
import relprop.evaluation as E
from relprop.methods.rollout_utils import chain

import synth
from specificity import class_specificity

TA = "transformer_attribution"
SIGNED_VISION = ["lrp", "cat", "attcat", "grads", "input_x_gradient", "smoothgrad", "integrated_gradients", "vit_cx"]
UNIT_METHODS = [TA, "rollout", "raw_attention", "attention_norm", "gradient_rollout", "lrp", "input_x_gradient",
                "integrated_gradients"]
CONCENTRATION_METHODS = [TA, "rollout", "raw_attention", "attention_norm", "gradient_rollout", "lrp",
                         "input_x_gradient"]
MINORITY_METHODS = [TA, "ta_last_block", "ta_without_gradient", "gradient_rollout", "partial_lrp", "grads",
                    "attcat"]
NORM = (synth.MEAN, synth.STD)


def _f(v, fmt="{:.3f}"):
    return "–" if v is None or (isinstance(v, float) and np.isnan(v)) else fmt.format(v)


def _md(rows: List[Dict], cols: List[str]) -> str:
    out = ["| " + " | ".join(cols) + " |", "|---|" + "---:|" * (len(cols) - 1)]
    for r in rows:
        out.append("| " + " | ".join(str(r.get(c)) if isinstance(r.get(c), str) else _f(r.get(c)) for c in cols)
                   + " |")
    return "\n".join(out)


def _batches(ds, n, size):
    """The first ``n`` samples of a dataset in batches of ``size``."""
    seen = 0
    for b in ds.batches(size):
        if seen >= n:
            return
        yield b
        seen += len(b["texts"]) if "texts" in b else b["inputs"].shape[0]


def _upsample(patch_scores: torch.Tensor, grid, size) -> torch.Tensor:
    """[batch, patches] -> [batch, H, W] bilinear, as relprop.explain builds ``exp.map``."""
    gh, gw = grid
    return F.interpolate(patch_scores.float().reshape(-1, 1, gh, gw), size=size, mode="bilinear",
                         align_corners=False)[:, 0]


def _block_maps(exp) -> List[torch.Tensor]:
    """E_h(dA_b ⊙ R_A,b)⁺ of every block, [batch, tokens, tokens]."""
    return [(b.gradient * b.relevance).clamp(min=0).mean(1) for b in exp.blocks]


def scale_normalized_ta(exp) -> torch.Tensor:
    """[batch, tokens] TA with each block's E_h(dA ⊙ R_A)⁺ divided by its row sums before I is added
    (rows of I + M̃ then normalized), so that every block weighs as much as the identity, as the
    attention does in rollout. Not a library option: computed from exp.blocks."""
    mats = [m / m.sum(-1, keepdim=True).clamp_min(1e-30) for m in _block_maps(exp)]
    return chain(mats, normalize_rows=True)[:, 0, :]


def first_order_ta(exp) -> torch.Tensor:
    """[batch, tokens] Σ_b E_h(dA_b ⊙ R_A,b)⁺[CLS, :]: TA without the products of the rollout."""
    return sum(m[:, 0, :] for m in _block_maps(exp))


# ---------------------------------------------------------------------------------- 1./2. definition
def text_variants(text: Dict, minority_ds, cfg, n_blocks: int) -> List[Dict]:
    model, ds = text["model"], text["dataset"]
    main = text["rows"][TA]
    rows = [{"variant": "TA as benchmarked (all blocks, I + Ā not normalized, [CLS] row)", "P@1": main["precision@1"],
             "token-F1@3": main["token_f1@3"], "AOPC": main["aopc"], "log-odds": main["log_odds"],
             "Kendall-τ": main["kendall_tau"], "minority P@1": main["minority_precision@1"]}]
    variants = [(f"authors' BERT setting: last block only (start_block={n_blocks - 1}), rows normalized",
                 {"start_block": n_blocks - 1, "normalize_rows": True}),
                ("query='mean' (mean of the token rows instead of [CLS])", {"query": "mean"})]
    for name, opts in variants:
        r = E.evaluate(model, ds, [TA], target="predicted", batch_size=cfg["text_batch"], rationale_k=(1, 3),
                       perturbation=False, conservation=False, explain_options=opts, progress=False).table()[0]
        m = E.evaluate(model, minority_ds, [TA], target="label", batch_size=cfg["text_batch"], rationale_k=(1,),
                       perturbation=False, aopc=False, kendall=False, conservation=False, explain_options=opts,
                       progress=False).table()[0]
        rows.append({"variant": name, "P@1": r["precision@1"], "token-F1@3": r["token_f1@3"], "AOPC": r["aopc"],
                     "log-odds": r["log_odds"], "Kendall-τ": r["kendall_tau"], "minority P@1": m["precision@1"]})
    # the scale-normalized variant (scores computed from the blocks, metrics from relprop.evaluation)
    p1, f1, aop, lod, mp1, tau = [], [], [], [], [], []
    for b in ds.batches(cfg["text_batch"]):
        e = relprop.explain(model, b["inputs"], method=TA, special_tokens_mask=b["special_tokens_mask"])
        s = scale_normalized_ta(e).masked_fill(~e.mask, 0.0)
        p1.append(E.precision_at_k(s, b["rationales"], 1, mask=e.mask))
        f1.append(E.token_f1(s, b["rationales"], 3, mask=e.mask))
        aop.append(E.aopc(model, b["inputs"], s, removable=e.mask, tokenizer=ds.tokenizer, batch_size=128))
        lod.append(E.log_odds(model, b["inputs"], s, removable=e.mask, tokenizer=ds.tokenizer, batch_size=128))
        logits = e.logits.float()
        other = logits.scatter(1, e.target[:, None], float("-inf")).argmax(1)
        eo = relprop.explain(model, b["inputs"], target=other, method=TA, special_tokens_mask=b["special_tokens_mask"])
        tau.append(E.kendall_tau(s, scale_normalized_ta(eo), mask=e.mask))
    for b in minority_ds.batches(cfg["text_batch"]):
        e = relprop.explain(model, b["inputs"], target=b["labels"], method=TA,
                            special_tokens_mask=b["special_tokens_mask"])
        mp1.append(E.precision_at_k(scale_normalized_ta(e), b["rationales"], 1, mask=e.mask))
    rows.append({"variant": "each block's E_h(dA⊙R_A)⁺ scaled to unit row mass before + I (not a library option)",
                 "P@1": float(np.nanmean(np.concatenate(p1))), "token-F1@3": float(np.nanmean(np.concatenate(f1))),
                 "AOPC": E.FaithfulnessResult.concat(aop).value, "log-odds": E.FaithfulnessResult.concat(lod).value,
                 "Kendall-τ": float(np.nanmean(np.concatenate(tau))),
                 "minority P@1": float(np.nanmean(np.concatenate(mp1)))})
    return rows


def vision_variants(vision: Dict, two, cfg, n_blocks: int) -> List[Dict]:
    model, folder = vision["model"], vision["folder"]
    main = vision["rows"][TA]
    rows = [{"variant": "TA as benchmarked (all blocks, not normalized)", "pos. AUC": main["positive_auc"],
             "neg. AUC": main["negative_auc"], "mIoU": main["miou"], "mAP": main["map"],
             "2-obj share": main["spec_share"], "2-obj AP own": main["spec_ap_own"],
             "2-obj AP other": main["spec_ap_other"]}]
    variants = [(f"last block only (start_block={n_blocks - 1})", {"start_block": n_blocks - 1})]
    for name, opts in variants:
        r = E.evaluate(model, folder, [TA], target="predicted", batch_size=cfg["vision_batch"],
                       perturbation_batch_size=256, conservation=False, explain_options=opts, progress=False).table()[0]
        s = class_specificity(model, two, [TA], opts, cfg["vision_batch"])[TA]
        rows.append({"variant": name, "pos. AUC": r["positive_auc"], "neg. AUC": r["negative_auc"],
                     "mIoU": r["miou"], "mAP": r["map"], "2-obj share": s["spec_share"],
                     "2-obj AP own": s["spec_ap_own"], "2-obj AP other": s["spec_ap_other"]})
    # scale-normalized, from the blocks
    pos, neg, seg = [], [], []
    for b in folder.batches(cfg["vision_batch"]):
        e = relprop.explain(model, b["inputs"], method=TA)
        s = scale_normalized_ta(e)[:, e.prefix_tokens:]
        pos.append(E.perturbation_curve(model, b["inputs"], s, mode="positive", normalization=NORM, batch_size=256))
        neg.append(E.perturbation_curve(model, b["inputs"], s, mode="negative", normalization=NORM, batch_size=256))
        seg.append(E.segmentation_scores(_upsample(s, e.grid, b["masks"].shape[-2:]), b["masks"]))
    x = synth.normalize(two["images"])
    share, ap_own, ap_other = [], [], []
    for st in range(0, x.shape[0], cfg["vision_batch"]):
        for o in (0, 1):
            sl = slice(st, st + cfg["vision_batch"])
            e = relprop.explain(model, x[sl], target=two["classes"][sl, o], method=TA)
            mp = _upsample(scale_normalized_ta(e)[:, e.prefix_tokens:], e.grid, x.shape[-2:])
            own, other = two["masks"][sl, o], two["masks"][sl, 1 - o]
            pm = mp.clamp_min(0)
            a, c = (pm * own).sum((1, 2)), (pm * other).sum((1, 2))
            share.append((a / (a + c).clamp_min(1e-30)).numpy())
            ap_own.append(E.segmentation_scores(mp, own))
            ap_other.append(E.segmentation_scores(mp, other))
    sg = E.SegmentationResult.concat(seg)
    rows.append({"variant": "each block's E_h(dA⊙R_A)⁺ scaled to unit row mass before + I (not a library option)",
                 "pos. AUC": E.PerturbationResult.concat(pos).auc, "neg. AUC": E.PerturbationResult.concat(neg).auc,
                 "mIoU": sg.mean_miou, "mAP": sg.mean_ap, "2-obj share": float(np.mean(np.concatenate(share))),
                 "2-obj AP own": E.SegmentationResult.concat(ap_own).mean_ap,
                 "2-obj AP other": E.SegmentationResult.concat(ap_other).mean_ap})
    return rows


def rollout_inertness(model, inputs, extra=None, prefix=None) -> Dict:
    extra = extra or {}
    e = relprop.explain(model, inputs, method=TA, **extra)
    fo = first_order_ta(e)
    s = e.scores if prefix is None else e.scores
    fo = fo if prefix is None else fo[:, prefix:]
    if prefix is None:
        fo = fo.masked_fill(~e.mask, 0.0)
        tau = E.kendall_tau(e, fo)
    else:
        tau = E.kendall_tau(s, fo)
    cls_mass = [float(m[:, 0, :].sum(-1).mean()) for m in _block_maps(e)]
    return {"tau": float(np.nanmean(tau)),
            "max_rel_diff": float(((s - fo).abs().amax(1) / s.abs().amax(1).clamp_min(1e-30)).max()),
            "cls_row_mass_per_block": cls_mass}


# ----------------------------------------------------------------------------- 3. class-specificity
def _cos(a: torch.Tensor, b: torch.Tensor) -> np.ndarray:
    a, b = a.flatten(1).double(), b.flatten(1).double()
    return torch.nn.functional.cosine_similarity(a, b, dim=1).numpy()


def block_specificity(model, inputs, target_a, target_b, extra=None) -> List[Dict]:
    """Per block: cosine similarity (per sample, over heads x tokens x tokens) between the two classes'
    R_A, dA and (dA ⊙ R_A)⁺, and how much relevance enters the block's attention for class a."""
    extra = extra or {}
    ea = relprop.explain(model, inputs, target=target_a, method=TA, **extra)
    eb = relprop.explain(model, inputs, target=target_b, method=TA, **extra)
    rows = []
    for ba, bb in zip(ea.blocks, eb.blocks):
        ma, mb = (ba.gradient * ba.relevance).clamp(min=0), (bb.gradient * bb.relevance).clamp(min=0)
        rows.append({"block": str(ba.index), "cos R_A": float(np.nanmean(_cos(ba.relevance, bb.relevance))),
                     "cos dA": float(np.nanmean(_cos(ba.gradient, bb.gradient))),
                     "cos (dA⊙R_A)⁺": float(np.nanmean(_cos(ma, mb))),
                     "Σ R_A": float(ba.relevance.flatten(1).sum(1).mean()),
                     "[CLS]-row mass of E_h(dA⊙R_A)⁺": float(ma.mean(1)[:, 0, :].sum(-1).mean())})
    return rows


def minority_analysis(model, minority_ds, majority_rationales: torch.Tensor, n: int) -> Dict:
    """Mixed sentences: explain the label (majority) class and the minority class; where the top-1
    token of each method falls, and the [CLS]-row shares of R_A, of E_h dA and of E_h(dA⊙R_A)⁺ on the
    majority keywords, the minority keyword and the other tokens in the two blocks next to the output."""
    b = next(minority_ds.batches(n))
    special, mino_r = b["special_tokens_mask"], b["rationales"]
    maj_r = majority_rationales[:mino_r.shape[0]]
    other_r = ~special & ~mino_r & ~maj_r
    out = {"top1": [], "blocks": []}
    for who, tgt in (("label (majority)", b["majority_labels"]), ("minority", b["labels"])):
        exps = relprop.explain(model, b["inputs"], target=tgt, method=MINORITY_METHODS, special_tokens_mask=special)
        for name, e in zip(MINORITY_METHODS, exps):
            top = e.scores.masked_fill(special, float("-inf")).argmax(1)
            hit = lambda r: float(r.gather(1, top[:, None])[:, 0].float().mean())  # noqa: E731
            out["top1"].append({"explained class": who, "method": name, "top-1 = majority keyword": hit(maj_r),
                                "top-1 = minority keyword": hit(mino_r), "top-1 = other": hit(other_r)})
        ta = exps[0]

        def share(t):
            t = t.clamp_min(0)
            tot = t.sum(1).clamp_min(1e-30)
            return [float(((t * r).sum(1) / tot).mean()) for r in (maj_r, mino_r, other_r)]
        for blk in ta.blocks[-2:]:
            r = share(blk.relevance.mean(1)[:, 0, :])
            m = share((blk.gradient * blk.relevance).clamp(min=0).mean(1)[:, 0, :])
            g = blk.gradient.mean(1)[:, 0, :]
            mean_on = [float(((g * rr).sum(1) / rr.sum(1).clamp_min(1)).mean()) for rr in (maj_r, mino_r, other_r)]
            out["blocks"].append({"explained class": who, "block": str(blk.index),
                                  "R_A: maj / min / other": " / ".join(f"{v:.2f}" for v in r),
                                  "mean E_h dA: maj / min / other": " / ".join(f"{v:+.1e}" for v in mean_on),
                                  "(dA⊙R_A)⁺: maj / min / other": " / ".join(f"{v:.2f}" for v in m)})
    return out


# ------------------------------------------------------------------------------------- 4. concentration
def concentration(vision: Dict, n: int) -> List[Dict]:
    model, folder = vision["model"], vision["folder"]
    b = next(folder.batches(n))
    exps = relprop.explain(model, b["inputs"], method=CONCENTRATION_METHODS)
    gh, gw = exps[0].grid
    h, w = b["masks"].shape[-2:]
    cover = F.adaptive_avg_pool2d(b["masks"][:, None].float(), (gh, gw))[:, 0].flatten(1)  # object share per patch
    rows = [{"method": "(object: patches touched / ≥ half covered)", "effective patches": float((cover > 0).sum(1)
             .float().mean()), "mass on object patches": float((cover >= 0.5).sum(1).float().mean())}]
    for m, e in zip(CONCENTRATION_METHODS, exps):
        s = e.scores.clamp_min(0)
        p = s / s.sum(1, keepdim=True).clamp_min(1e-30)
        ent = -(p * p.clamp_min(1e-30).log()).sum(1)
        rows.append({"method": m, "effective patches": float(ent.exp().mean()),
                     "mass on object patches": float((p * (cover > 0)).sum(1).mean())})
    return rows


# ------------------------------------------------------------------------ 5./6./7. perturbation details
def unit_check(vision: Dict, cfg, n: int) -> List[Dict]:
    model, folder = vision["model"], vision["folder"]
    b = next(folder.batches(n))
    x = b["inputs"]
    exps = relprop.explain(model, x, method=UNIT_METHODS, n_samples=cfg["sg_samples"], n_steps=cfg["ig_steps"])
    rows = []
    for m, e in zip(UNIT_METHODS, exps):
        r = {"method": m}
        for unit, label in (("pixel", "pixels"), ("patch", "patches")):
            for mode in ("positive", "negative"):
                r[f"{mode[:3]}. AUC, {label}"] = E.perturbation_curve(model, x, e, mode=mode, unit=unit,
                                                                      normalization=NORM, batch_size=256).auc
        rows.append(r)
    return rows


def signed_vs_magnitude(vision: Dict, cfg, n: int) -> List[Dict]:
    model, folder = vision["model"], vision["folder"]
    b = next(folder.batches(n))
    x = b["inputs"]
    exps = relprop.explain(model, x, method=SIGNED_VISION, n_samples=cfg["sg_samples"], n_steps=cfg["ig_steps"])
    rows = []
    for m, e in zip(SIGNED_VISION, exps):
        r = {"method": m}
        for label, mp in (("signed", e.map), ("|score|", e.map.abs())):
            for mode in ("positive", "negative"):
                c = E.perturbation_curve(model, x, mp, mode=mode, normalization=NORM, batch_size=256)
                r[f"{mode[:3]}. AUC, {label}"] = c.auc
        r["share of negative map mass"] = float((e.map.clamp(max=0).abs().sum((1, 2)) /
                                                 e.map.abs().sum((1, 2)).clamp_min(1e-30)).mean())
        rows.append(r)
    return rows


def black_baseline(vision: Dict, two, cfg) -> List[Dict]:
    """vit_cx and integrated_gradients with their default baseline (0 in normalized space = mid grey)
    and with black (pixel 0 = -1 normalized), on all metrics of the image table."""
    model, folder = vision["model"], vision["folder"]
    black = torch.tensor(-1.0)  # (0 - 0.5) / 0.5
    rows = []
    for m in ("vit_cx", "integrated_gradients"):
        for label, opts in (("default: 0 in normalized space (grey)", {}), ("black (pixel 0)", {"baseline": black})):
            o = dict(opts)
            if m == "integrated_gradients":
                o["n_steps"] = cfg["ig_steps"]
            if label.startswith("default"):
                main = vision["rows"][m]
                rows.append({"method": m, "baseline": label, "pos. AUC": main["positive_auc"],
                             "neg. AUC": main["negative_auc"], "mIoU": main["miou"], "mAP": main["map"],
                             "2-obj share": main["spec_share"], "2-obj AP own": main["spec_ap_own"]})
                continue
            r = E.evaluate(model, folder, [m], target="predicted", batch_size=cfg["vision_batch"],
                           perturbation_batch_size=256, conservation=False, explain_options=o,
                           progress=False).table()[0]
            s = class_specificity(model, two, [m], o, cfg["vision_batch"])[m]
            rows.append({"method": m, "baseline": label, "pos. AUC": r["positive_auc"], "neg. AUC": r["negative_auc"],
                         "mIoU": r["miou"], "mAP": r["map"], "2-obj share": s["spec_share"],
                         "2-obj AP own": s["spec_ap_own"]})
    return rows


# --------------------------------------------------------------------------------------------- 8. eps
def eps_sweep(model, inputs, special=None, rationale=None, masks=None) -> List[Dict]:
    extra = {"special_tokens_mask": special} if special is not None else {}
    ref = relprop.explain(model, inputs, method=TA, **extra)
    rows = []
    for eps in (0.0, 1e-12, 1e-9, 1e-6, 1e-3, 1e-1):
        e = relprop.explain(model, inputs, method=TA, eps=eps, **extra)
        tau = E.kendall_tau(e, ref) if special is not None else E.kendall_tau(e.scores, ref.scores)
        row = {"eps": f"{eps:g}" + (" (default)" if eps == 1e-9 else ""), "τ vs default": float(np.nanmean(tau)),
               "max |Δ score| / max |score|": float(((e.scores - ref.scores).abs().amax(1) /
                                                    ref.scores.abs().amax(1).clamp_min(1e-30)).max()),
               "conservation error": float(E.conservation_report(e).max_error)}
        if rationale is not None:
            row["P@1"] = float(np.nanmean(E.precision_at_k(e, rationale, 1)))
        if masks is not None:
            row["mAP"] = E.segmentation_scores(e, masks).mean_ap
        rows.append(row)
    return rows


# -------------------------------------------------------------------------------------- 9. conservation
def conservation_and_batch(model, inputs, extra=None, n_single=4) -> Dict:
    extra = extra or {}
    e = relprop.explain(model, inputs, method=TA, **extra)
    rep = E.conservation_report(e)
    cons = e.conservation
    injected = cons.injected.double()
    absorbed_by = {k: float((v.double() / injected).mean()) for k, v in cons.absorbed_by.items()}
    diffs = []
    batch = e.scores.shape[0]
    for i in range(min(n_single, batch)):
        if isinstance(inputs, dict):
            one = {k: (v[i:i + 1] if torch.is_tensor(v) and v.dim() > 0 and v.shape[0] == batch else v)
                   for k, v in inputs.items()}
        else:
            one = inputs[i:i + 1]
        ex = {k: (v[i:i + 1] if torch.is_tensor(v) else v) for k, v in extra.items()}
        s = relprop.explain(model, one, method=TA, **ex).scores
        diffs.append(float((s[0] - e.scores[i]).abs().max() / e.scores[i].abs().max().clamp_min(1e-30)))
    return {"max_rel_error": rep.max_error, "input_share": float((cons.input.double() / injected).mean()),
            "absorbed_share": float((cons.absorbed.double() / injected).mean()), "absorbed_by": absorbed_by,
            "batch_vs_single_max_rel_diff": max(diffs)}


# ------------------------------------------------------------------------------------------- figure
FIGURE_METHODS = [TA, "gradient_rollout", "rollout", "raw_attention", "lrp", "partial_lrp", "attention_gradcam",
                  "attcat", "input_x_gradient", "integrated_gradients", "vit_cx"]


def example_maps(vision: Dict, two, cfg, path: str, n_one: int = 5, n_two: int = 4) -> str:
    """A grid of maps: one-object test images, then two-object images explained for each of their two
    classes (columns), one row per method."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    model, folder = vision["model"], vision["folder"]
    b = next(folder.batches(n_one))
    opts = dict(n_samples=cfg["sg_samples"], n_steps=cfg["ig_steps"])
    e1 = relprop.explain(model, b["inputs"], method=FIGURE_METHODS, **opts)
    x2 = synth.normalize(two["images"][:n_two])
    ea = relprop.explain(model, x2, target=two["classes"][:n_two, 0], method=FIGURE_METHODS, **opts)
    eb = relprop.explain(model, x2, target=two["classes"][:n_two, 1], method=FIGURE_METHODS, **opts)
    cols = [("one", i) for i in range(n_one)] + [(k, i) for i in range(n_two) for k in ("a", "b")]
    fig = Figure(figsize=(1.25 * (len(cols) + 1), 1.25 * (len(FIGURE_METHODS) + 1)))
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(FIGURE_METHODS) + 1, len(cols) + 1, squeeze=False)
    for ax in axes.flat:
        ax.set_axis_off()
    labels = b["labels"]
    for c, (k, i) in enumerate(cols, start=1):
        img = (b["inputs"][i] * 0.5 + 0.5) if k == "one" else two["images"][i]
        cls = int(labels[i]) if k == "one" else int(two["classes"][i, 0 if k == "a" else 1])
        axes[0, c].imshow(img.permute(1, 2, 0).clamp(0, 1).numpy())
        axes[0, c].set_title(("explain " if k != "one" else "") + synth.SHAPES[cls], fontsize=7)
        exps = {"one": e1, "a": ea, "b": eb}[k]
        for r, e in enumerate(exps, start=1):
            mp = e.map[i].numpy()
            lim = max(abs(mp.min()), abs(mp.max())) or 1.0
            if e.signed:
                axes[r, c].imshow(mp, cmap="bwr", vmin=-lim, vmax=lim)
            else:
                axes[r, c].imshow(mp, cmap="inferno")
    for r, m in enumerate(FIGURE_METHODS, start=1):
        axes[r, 0].text(1.0, 0.5, m, fontsize=7, ha="right", va="center", transform=axes[r, 0].transAxes)
    fig.suptitle("Image maps (signed methods: red +, blue -). Left: one-object test images; right: two-object "
                 "images explained for each object's class", fontsize=8)
    fig.savefig(path, dpi=90)
    return path


# ----------------------------------------------------------------------------------------------- all
def run_all(out: str, text: Dict, vision: Dict, data: Dict, cfg: Dict, log) -> str:
    res: Dict = {}
    n_img, n_txt = cfg["check_images"], cfg["check_texts"]
    md = ["## Diagnostics (checks.py)", ""]
    tmodel, tok = text["model"], text["tokenizer"]
    n_text_blocks = tmodel.config.num_hidden_layers
    minority_ds = E.RationaleJSONL(os.path.join(out, "data", "text", "test_minority.jsonl"), tok)
    vmodel = vision["model"]
    n_vis_blocks = len(vmodel.blocks)
    two = data["two"]

    t = time.time()
    res["text_variants"] = text_variants(text, minority_ds, cfg, n_text_blocks)
    res["vision_variants"] = vision_variants(vision, two, cfg, n_vis_blocks)
    tb = next(text["dataset"].batches(n_txt))
    vb = next(vision["folder"].batches(n_img))
    res["inert_text"] = rollout_inertness(tmodel, tb["inputs"], {"special_tokens_mask": tb["special_tokens_mask"]})
    res["inert_vision"] = rollout_inertness(vmodel, vb["inputs"], prefix=1)
    log(f"checks: TA variants and rollout ({time.time() - t:.0f}s)")
    md += ["### 1. Definition variants of transformer_attribution", "",
           f"Text ({text['result'].samples} test sentences; minority P@1 on the mixed ones):", "",
           _md(res["text_variants"], ["variant", "P@1", "token-F1@3", "AOPC", "log-odds", "Kendall-τ", "minority P@1"]),
           "", f"Images ({vision['result'].samples} one-object images; "
               f"{two['images'].shape[0]} two-object images):", "",
           _md(res["vision_variants"], ["variant", "pos. AUC", "neg. AUC", "mIoU", "mAP", "2-obj share",
                                         "2-obj AP own", "2-obj AP other"]), "",
           "### 2. Is the rollout of TA doing anything?", "",
           "Kendall-τ between TA and the first-order sum Σ_b E_h(dA_b⊙R_A,b)⁺[CLS, :] (no products), the largest "
           "relative difference of the scores, and the mean [CLS]-row mass that each block's E_h(dA⊙R_A)⁺ adds to "
           "the identity's 1:", ""]
    for k, name in (("inert_text", f"Text ({n_txt} sentences)"), ("inert_vision", f"Images ({n_img} images)")):
        r = res[k]
        md.append(f"- {name}: τ = {r['tau']:.4f}, max relative difference {r['max_rel_diff']:.1e}, [CLS]-row mass "
                  f"per block (input → output) " + ", ".join(f"{v:.1e}" for v in r["cls_row_mass_per_block"]))
    md.append("")

    t = time.time()
    mixed = [r for r in data["text_test"] if r["mixed"]]
    m_n = min(n_txt, len(mixed))
    mb = next(minority_ds.batches(m_n))
    lab = torch.tensor([r["label"] for r in mixed[:m_n]])
    res["blocks_text"] = block_specificity(tmodel, mb["inputs"], lab, mb["labels"],
                                           {"special_tokens_mask": mb["special_tokens_mask"]})
    n2 = min(n_img, two["images"].shape[0])
    res["blocks_vision"] = block_specificity(vmodel, synth.normalize(two["images"][:n2]), two["classes"][:n2, 0],
                                             two["classes"][:n2, 1])
    # majority-keyword token masks: the same sentences with the label's rationale
    maj_path = os.path.join(out, "data", "text", "test_mixed_majority.jsonl")
    with open(maj_path, "w") as f:
        for r in mixed:
            f.write(json.dumps({"text": r["text"], "label": r["label"], "rationale": r["rationale"]}) + "\n")
    maj_ds = E.RationaleJSONL(maj_path, tok)
    assert torch.equal(maj_ds.inputs["input_ids"], minority_ds.inputs["input_ids"])

    class _WithMajority:  # the minority dataset's batches, plus the majority labels
        def batches(self, size):
            for i, b in enumerate(minority_ds.batches(size)):
                b["majority_labels"] = maj_ds.labels[i * size:i * size + len(b["texts"])]
                yield b
    res["minority"] = minority_analysis(tmodel, _WithMajority(), maj_ds.rationales, m_n)
    log(f"checks: class-specificity ({time.time() - t:.0f}s)")
    cols = ["block", "cos R_A", "cos dA", "cos (dA⊙R_A)⁺", "Σ R_A", "[CLS]-row mass of E_h(dA⊙R_A)⁺"]
    md += ["### 3. Where the class-specificity of TA comes from", "",
           "Per block (0 = next to the input): cosine similarity between the maps of the two classes of one input "
           "(mixed sentences: label vs minority class; two-object images: the two objects' classes), and the "
           "relevance entering the block's attention (class a).", "",
           f"Text ({m_n} mixed sentences):", "", _md(res["blocks_text"], cols), "",
           f"Images ({n2} two-object images):", "", _md(res["blocks_vision"], cols), "",
           f"Mixed sentences ({m_n}): where the top-1 token falls when the label class and when the minority class is "
           "explained:", "",
           _md(res["minority"]["top1"], ["explained class", "method", "top-1 = majority keyword",
                                         "top-1 = minority keyword", "top-1 = other"]), "",
           "Shares of the [CLS] row of TA's ingredients on the majority keywords / the minority keyword / the other "
           "tokens (two blocks next to the output):", "",
           _md(res["minority"]["blocks"], ["explained class", "block", "R_A: maj / min / other",
                                           "mean E_h dA: maj / min / other", "(dA⊙R_A)⁺: maj / min / other"]), ""]

    t = time.time()
    fig = example_maps(vision, two, cfg, os.path.join(out, "maps_vision.png"))
    res["concentration"] = concentration(vision, n_img)
    res["unit"] = unit_check(vision, cfg, n_img)
    res["signed"] = signed_vs_magnitude(vision, cfg, n_img)
    res["black"] = black_baseline(vision, two, cfg)
    log(f"checks: image maps and perturbation details ({time.time() - t:.0f}s)")
    md += [f"### 4. How concentrated the image maps are ({n_img} images; example maps: {os.path.basename(fig)})", "",
           "Effective number of patches exp(entropy) of the positive part of the patch scores, and the share of it on "
           "patches the object touches (first row: the objects' patch counts).", "",
           _md(res["concentration"], ["method", "effective patches", "mass on object patches"]), "",
           f"### 5. Perturbation test removing pixels (default) or whole patches ({n_img} images)", "",
           _md(res["unit"], ["method", "pos. AUC, pixels", "neg. AUC, pixels", "pos. AUC, patches",
                             "neg. AUC, patches"]), "",
           f"### 6. Signed methods in the perturbation tests: signed score vs its magnitude ({n_img} images)", "",
           _md(res["signed"], ["method", "pos. AUC, signed", "neg. AUC, signed", "pos. AUC, |score|",
                               "neg. AUC, |score|", "share of negative map mass"]), "",
           "### 7. Baselines of vit_cx and integrated_gradients: grey (default) vs black (all test images)", "",
           _md(res["black"], ["method", "baseline", "pos. AUC", "neg. AUC", "mIoU", "mAP", "2-obj share",
                              "2-obj AP own"]), ""]

    t = time.time()
    res["eps_text"] = eps_sweep(tmodel, tb["inputs"], special=tb["special_tokens_mask"], rationale=tb["rationales"])
    res["eps_vision"] = eps_sweep(vmodel, vb["inputs"], masks=vb["masks"])
    res["conservation_text"] = conservation_and_batch(tmodel, tb["inputs"],
                                                      {"special_tokens_mask": tb["special_tokens_mask"]})
    res["conservation_vision"] = conservation_and_batch(vmodel, vb["inputs"])
    log(f"checks: eps, conservation and batch invariance ({time.time() - t:.0f}s)")
    md += [f"### 8. The eps stabilizer (TA on {n_txt} sentences / {n_img} images, against the default eps=1e-9)", "",
           "Text:", "", _md(res["eps_text"], ["eps", "τ vs default", "max |Δ score| / max |score|",
                                               "conservation error", "P@1"]), "",
           "Images:", "", _md(res["eps_vision"], ["eps", "τ vs default", "max |Δ score| / max |score|",
                                                   "conservation error", "mAP"]), "",
           "### 9. Conservation (chefer2021) and batch invariance of TA on the trained models", ""]
    for k, name in (("conservation_text", "Text"), ("conservation_vision", "Images")):
        c = res[k]
        top = sorted(c["absorbed_by"].items(), key=lambda kv: -abs(kv[1]))[:3]
        md += [f"- {name}: max relative conservation error {c['max_rel_error']:.1e}; of the injected relevance "
               f"{c['input_share']:.3f} reaches the input and {c['absorbed_share']:.3f} is absorbed by constants "
               f"({', '.join(f'{n}: {v:.3f}' for n, v in top)}); one sample alone vs in the batch: max relative "
               f"difference {c['batch_vs_single_max_rel_diff']:.1e}."]
    md.append("")

    with open(os.path.join(out, "checks.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)
    text_md = "\n".join(md)
    with open(os.path.join(out, "checks.md"), "w") as f:
        f.write(text_md + "\n")
    return text_md
