"""relprop against the authors' released code (hila-chefer/Transformer-Explainability) on identical weights.

Builds random-weight models (a timm ViT and a HuggingFace BERT), copies the same weights into the
authors' models (``baselines/ViT/ViT_orig_LRP.py``, ``ViT_LRP.py``, ``ViT_new.py``;
``BERT_explainability/modules/BERT/BERT_cls_lrp.py`` over ``BERT_orig_lrp.py``, and
``BertForSequenceClassification.py`` over ``BERT.py``), runs their full LRP, partial LRP
(``last_layer``), attention Grad-CAM, rollout, raw attention and Transformer Attribution and
relprop's methods of the same names on the same inputs, and prints markdown tables: per model and
method, the Pearson correlation and the max relative difference max|a - b| / max|b| (b: theirs)
over the compared positions, per sample.

    mkdir -p /tmp/te && git --git-dir=<mirror of their repository> archive HEAD | tar -x -C /tmp/te
    pip install einops                                    # their code imports it (relprop does not)
    python benchmarks/authors_reference.py --checkout /tmp/te               # tiny models
    python benchmarks/authors_reference.py --checkout /tmp/te --size base   # ViT-B/16, BERT-base shapes

Three configurations, one table each: float32 with the stabilizer ε = 1e-9 on both sides (as
shipped); float64 with ε = 1e-9 (float rounding out of the way: what is left is where the two place
ε); float64 with ε = 0 on both sides (their ``safe_divide`` without its 1e-9 in this process: what is
left is a difference of rules). Their own float32-vs-float64 difference is printed beside the
float32 table: the noise floor of that table.

Their code is imported unchanged. What this process adapts around it, on CPU: ``Tensor.cuda`` is
the identity while their generators run (they move tensors to the GPU unconditionally); their BERT
classes get the three ``transformers`` 3.5 methods that newer releases dropped (``init_weights``,
here a no-op since the weights are copied in; ``get_extended_attention_mask``, the additive
0/-10000 mask of 3.5; ``get_head_mask``, no head mask); ``gensim`` (imported by a module their BERT
classifier imports, unused here) is stubbed; their ViT LRP models' final LayerNorm gets timm's
eps=1e-6 (their constructor leaves 1e-5). Their generators explain one sample at a time
(``cam[0]``), so each image and each text runs alone through their code; relprop explains the
images as one batch, and the texts alone and as one padded batch.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import math
import os
import sys
import types

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import relprop  # noqa: E402

SIZES = {
    "tiny": {"vit": dict(embed_dim=192, depth=4, num_heads=3, num_classes=10),
             "bert": dict(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                          intermediate_size=128, max_position_embeddings=128, num_labels=2),
             "lengths": (14, 9, 20)},
    "base": {"vit": dict(embed_dim=768, depth=12, num_heads=12, num_classes=1000),
             "bert": dict(vocab_size=30522, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                          intermediate_size=3072, max_position_embeddings=512, num_labels=2),
             "lengths": (40, 24, 64)},
}
CONFIGS = [("float32, ε = 1e-9 on both sides (as shipped)", torch.float32, 1e-9),
           ("float64, ε = 1e-9 on both sides", torch.float64, 1e-9),
           ("float64, ε = 0 on both sides", torch.float64, 0.0)]
CLS, SEP, PAD = 2, 3, 0
#: (model, method) rows the goals apply to: Pearson >= 0.999 and max rel. diff <= 1e-3
GOAL_ROWS = {"lrp", "lrp (encoder input)", "partial_lrp"}
LAYER_MODULES = ("modules.layers_lrp", "modules.layers_ours", "BERT_explainability.modules.layers_lrp",
                 "BERT_explainability.modules.layers_ours")


# ------------------------------------------------------------------ their code, on CPU
@contextlib.contextmanager
def their_run(eps: float):
    """While their generators run: ``Tensor.cuda`` returns the tensor itself, and with ``eps == 0``
    their ``safe_divide`` divides without adding 1e-9 (still 0 where the denominator is 0)."""
    cuda = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *a, **k: self
    layers = [importlib.import_module(m) for m in LAYER_MODULES]
    kept = [m.safe_divide for m in layers]
    if eps == 0:
        for m in layers:
            m.safe_divide = lambda a, b: a / b.masked_fill(b == 0, 1) * (b != 0)
    try:
        yield
    finally:
        torch.Tensor.cuda = cuda
        for m, fn in zip(layers, kept):
            m.safe_divide = fn


def _additive_mask(self, attention_mask, input_shape, device=None):
    """transformers 3.5's extended mask: [batch, 1, 1, keys], 0 where attended, -10000 elsewhere."""
    keep = attention_mask[:, None, None, :].to(self.dtype)
    return (1.0 - keep) * -10000.0


def authors(checkout: str) -> types.SimpleNamespace:
    """Their modules, imported from ``checkout`` with the shims listed in the module docstring."""
    if not os.path.isdir(os.path.join(checkout, "baselines", "ViT")):
        sys.exit(f"{checkout} is not a work tree of hila-chefer/Transformer-Explainability (no baselines/ViT)")
    sys.path.insert(0, os.path.abspath(checkout))
    for name in ("gensim", "gensim.models"):
        sys.modules.setdefault(name, types.ModuleType(name))
    sys.modules["gensim.models"].KeyedVectors = None
    mods = {k: importlib.import_module(v) for k, v in {
        "vit_orig": "baselines.ViT.ViT_orig_LRP", "vit_ours": "baselines.ViT.ViT_LRP",
        "vit_new": "baselines.ViT.ViT_new",
        "vit_gen": "baselines.ViT.ViT_explanation_generator",
        "bert_orig": "BERT_explainability.modules.BERT.BERT_orig_lrp",
        "bert_ours": "BERT_explainability.modules.BERT.BERT",
        "cls_orig": "BERT_explainability.modules.BERT.BERT_cls_lrp",
        "cls_ours": "BERT_explainability.modules.BERT.BertForSequenceClassification",
        "bert_gen": "BERT_explainability.modules.BERT.ExplanationGenerator"}.items()}
    for key in ("bert_orig", "bert_ours", "cls_orig", "cls_ours"):
        for cls in (mods[key].BertModel if key.startswith("bert") else mods[key].BertForSequenceClassification,):
            cls.init_weights = lambda self: None
            cls.get_extended_attention_mask = _additive_mask
            cls.get_head_mask = lambda self, head_mask, n: [None] * n
    return types.SimpleNamespace(**mods)


# ------------------------------------------------------------------ models with identical weights
def randomize(model: torch.nn.Module, seed: int) -> None:
    """Redraw every parameter: weights N(0, 1/fan_in), embeddings and tokens N(0, 1/2), norm scales
    1 + N(0, 0.1²), biases N(0, 0.1²) — so that attention is not near uniform as at initialization."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and "embed" not in name and "token" not in name:
                std = 1.0 / math.sqrt(p[0].numel())
            elif p.dim() >= 2 or name.endswith(("cls_token", "pos_embed")):
                std = 0.5 ** 0.5
            else:
                std = 0.1
            scale = p.dim() == 1 and "norm" in name.lower() and name.endswith("weight")
            p.copy_(torch.randn(p.shape, generator=g) * std + (1.0 if scale else 0.0))


def load_same(theirs: torch.nn.Module, state: dict, dtype) -> torch.nn.Module:
    missing, unexpected = theirs.load_state_dict(state, strict=False)
    params = {n for n, _ in theirs.named_parameters()}
    if [m for m in missing if m in params] or unexpected:
        raise RuntimeError(f"weights do not match: missing {missing}, unexpected {unexpected}")
    return theirs.to(dtype).eval()


def vit_models(A, spec: dict, seed: int, dtype, redraw: bool):
    import timm
    torch.manual_seed(seed)
    ours = timm.create_model("vit_base_patch16_224", pretrained=False, **spec).eval()
    if redraw:
        randomize(ours, seed)
    state = ours.state_dict()
    kw = dict(img_size=224, patch_size=16, mlp_ratio=4, qkv_bias=True, **spec)
    orig = load_same(A.vit_orig.VisionTransformer(**kw), state, dtype)
    attr = load_same(A.vit_ours.VisionTransformer(**kw), state, dtype)
    new = load_same(A.vit_new.VisionTransformer(norm_layer=functools.partial(torch.nn.LayerNorm, eps=1e-6), **kw),
                    state, dtype)
    for m in (orig, attr):
        m.norm.eps = ours.norm.eps
    return ours.to(dtype), orig, attr, new


def bert_models(A, spec: dict, seed: int, dtype, redraw: bool):
    import transformers
    torch.manual_seed(seed)
    ours = transformers.BertForSequenceClassification(
        transformers.BertConfig(attn_implementation="eager", **spec)).eval()
    if redraw:
        randomize(ours, seed)
    state = ours.state_dict()
    cfg = transformers.BertConfig(return_dict=False, **spec)
    return ours.to(dtype), load_same(A.cls_orig.BertForSequenceClassification(cfg), state, dtype), \
        load_same(A.cls_ours.BertForSequenceClassification(cfg), state, dtype)


# ------------------------------------------------------------------ comparison
def pearson(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().flatten(), b.detach().double().flatten()
    a, b = a - a.mean(), b - b.mean()
    den = a.norm() * b.norm()
    return float((a @ b) / den) if den > 0 else float("nan")


def max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def minmax(t: torch.Tensor) -> torch.Tensor:
    """Their Grad-CAM's final rescaling to [0, 1] (all-zero stays all-zero here; theirs gives NaN)."""
    span = t.max() - t.min()
    return (t - t.min()) / span if span > 0 else torch.zeros_like(t)


def measure(a, b):
    """(Pearson, max rel. diff), or None when both maps are all 0 (their Grad-CAM then gives NaN)."""
    a, b = torch.nan_to_num(a.detach().double()), torch.nan_to_num(b.detach().double())
    if not a.abs().max() and not b.abs().max():
        return None
    return pearson(a, b), max_rel(a, b)


def run_vit(A, spec, n, seed, dtype, eps, redraw, targets=None):
    """Rows (model, method, preset, positions, relprop's maps, theirs) for the ViT, and the targets."""
    ours, orig, attr, new = vit_models(A, spec, seed, dtype, redraw)
    x = torch.randn(n, 3, 224, 224, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    if targets is None:
        with torch.no_grad():
            targets = ours(x).argmax(-1).tolist()
    names = ["lrp", "partial_lrp", "transformer_attribution", "raw_attention", "attention_gradcam", "rollout"]
    mine = dict(zip(names, relprop.explain(ours, x, method=names, target=targets, fast_path=False, eps=eps)))
    lrp_orig, lrp_attr, base = A.vit_gen.LRP(orig), A.vit_gen.LRP(attr), A.vit_gen.Baselines(new)
    theirs = {k: [] for k in names}
    with their_run(eps):
        for i, t in enumerate(targets):
            xi = x[i:i + 1]
            theirs["lrp"].append(lrp_orig.generate_LRP(xi, index=t, method="full")[0])
            theirs["partial_lrp"].append(lrp_orig.generate_LRP(xi, index=t, method="last_layer"))
            theirs["transformer_attribution"].append(
                lrp_attr.generate_LRP(xi, index=t, method="transformer_attribution", start_layer=0)[0])
            theirs["raw_attention"].append(lrp_attr.generate_LRP(xi, index=t, method="last_layer_attn"))
            theirs["attention_gradcam"].append(base.generate_cam_attn(xi, index=t).flatten())
            theirs["rollout"].append(base.generate_rollout(xi, start_layer=0)[0])
    rows = []
    for k in names:
        if k == "lrp":
            got, where = [mine[k].input_relevance[i].sum(0) for i in range(n)], "pixels (224×224)"
        elif k == "attention_gradcam":
            got, where = [minmax(mine[k].scores[i]) for i in range(n)], "patches (196), relprop's map min-max rescaled"
        else:
            got, where = list(mine[k].scores), "patches (196)"
        rows.append(("ViT", k, mine[k].preset or "-", where, got, theirs[k]))
    return rows, targets


def texts(lengths, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.cat([torch.tensor([CLS]), torch.randint(4, vocab, (L - 2,), generator=g), torch.tensor([SEP])])
            for L in lengths]


def padded(seqs):
    n = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), n), PAD, dtype=torch.long)
    mask = torch.zeros(len(seqs), n, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)], mask[i, :len(s)] = s, 1
    return ids, mask


def bert_relprop(model, ids, mask, targets, layers, eps):
    """relprop's maps for one batch: {method: [batch, positions]} (lrp at two places)."""
    kw = {"input_ids": ids, "attention_mask": mask}
    names = ["lrp", "partial_lrp", "raw_attention", "attention_gradcam", "rollout"]
    exps = dict(zip(names, relprop.explain(model, kw, method=names, target=targets, fast_path=False, eps=eps)))
    out = {"lrp (encoder input)": exps["lrp"].blocks[0].hidden_relevance.sum(-1),
           "lrp (word embeddings)": exps["lrp"].scores}
    for k in names[1:]:
        out[k] = exps[k].scores
    # their Grad-CAM rescales the whole [tokens, tokens] map to [0, 1] (relprop leaves that out): do it here
    gc, real = exps["attention_gradcam"].matrix, mask.sum(1).tolist()
    out["attention_gradcam"] = torch.stack([torch.nn.functional.pad(minmax(gc[i, :n, :n])[0], (0, gc.shape[-1] - n))
                                            for i, n in enumerate(real)])
    out["transformer_attribution"] = relprop.explain(model, kw, method="transformer_attribution", target=targets,
                                                     start_block=layers - 1, normalize_rows=True, eps=eps).scores
    return out


def run_bert(A, spec, lengths, seed, dtype, eps, redraw, targets=None):
    ours, orig, attr = bert_models(A, spec, seed, dtype, redraw)
    seqs = texts(lengths, spec["vocab_size"], seed + 2)
    layers = spec["num_hidden_layers"]
    if targets is None:
        with torch.no_grad():
            targets = [int(ours(input_ids=s[None]).logits.argmax(-1)) for s in seqs]
    g_orig, g_attr = A.bert_gen.Generator(orig), A.bert_gen.Generator(attr)
    ids, mask = padded(seqs)
    theirs = {}
    with their_run(eps):
        for i, (s, t) in enumerate(zip(seqs, targets)):
            one_ids, one_mask = s[None], torch.ones(1, len(s), dtype=torch.long)
            one = {"lrp": g_orig.generate_full_lrp(one_ids, one_mask, index=t),
                   "partial_lrp": g_orig.generate_LRP_last_layer(one_ids, one_mask, index=t),
                   "attention_gradcam": g_orig.generate_attn_gradcam(one_ids, one_mask, index=t),
                   "rollout": g_orig.generate_rollout(one_ids, one_mask, start_layer=0, index=t),
                   "raw_attention": g_orig.generate_attn_last_layer(one_ids, one_mask, index=t),
                   "transformer_attribution": g_attr.generate_LRP(one_ids, one_mask, index=t, start_layer=layers - 1),
                   # their Grad-CAM of the same text padded to the batch's length (padding columns in its mean)
                   "gradcam_padded": g_orig.generate_attn_gradcam(ids[i:i + 1], mask[i:i + 1], index=t)}
            for k, v in one.items():
                theirs.setdefault(k, []).append(v[0].detach())
    alone = [bert_relprop(ours, s[None], torch.ones(1, len(s), dtype=torch.long), [t], layers, eps)
             for s, t in zip(seqs, targets)]
    batch = bert_relprop(ours, ids, mask, targets, layers, eps)
    presets = {"lrp": "lrp", "partial_lrp": "lrp", "transformer_attribution": "chefer2021"}
    where = "text tokens without [CLS]/[SEP]"
    rows = []
    for label, mine in (("BERT, each text alone", lambda k, i: alone[i][k][0]),
                        ("BERT, padded batch", lambda k, i: batch[k][i])):
        for k in ("lrp (encoder input)", "lrp (word embeddings)", "partial_lrp", "transformer_attribution",
                  "raw_attention", "attention_gradcam", "rollout"):
            ref = "lrp" if k.startswith("lrp") else k
            extra = ", relprop's map min-max rescaled" if k == "attention_gradcam" else ""
            extra += f", start_layer={layers - 1}, rows normalized" if k == "transformer_attribution" else ""
            rows.append((label, k, presets.get(ref, "-"), where + extra,
                         [mine(k, i)[1:L - 1] for i, L in enumerate(lengths)],
                         [theirs[ref][i][1:L - 1] for i, L in enumerate(lengths)]))
    rows.append(("BERT, padded batch", "attention_gradcam vs their code on the padded text", "-",
                 where + ", relprop's map min-max rescaled", [batch["attention_gradcam"][i][1:L - 1]
                                                             for i, L in enumerate(lengths)],
                 [theirs["gradcam_padded"][i][1:L - 1] for i, L in enumerate(lengths)]))
    return rows, targets


def fmt(results, i):
    cells = ["= 0 (both all 0)" if r is None else (f"{r[0]:.6f}" if i == 0 else f"{r[1]:.1e}") for r in results]
    return ", ".join(cells)


def print_table(title, rows, floor=None):
    print(f"\n### {title}\n")
    head = "| model | method | relprop preset | compared positions | Pearson per sample | max rel. diff per sample |"
    sep = "|---|---|---|---|---|---|"
    if floor is not None:
        head += " their float32 vs their float64: max rel. diff |"
        sep += "---|"
    print(head + "\n" + sep)
    for j, (model, method, preset, where, mine, theirs) in enumerate(rows):
        res = [measure(a, b) for a, b in zip(mine, theirs)]
        line = f"| {model} | {method} | {preset} | {where} | {fmt(res, 0)} | {fmt(res, 1)} |"
        if floor is not None:
            line += f" {fmt([measure(a, b) for a, b in zip(rows[j][5], floor[j][5])], 1)} |"
        print(line)


def missed_goals(rows):
    out = []
    for model, method, _, _, mine, theirs in rows:
        if method in GOAL_ROWS:
            res = [r for r in (measure(a, b) for a, b in zip(mine, theirs)) if r is not None]
            if any(r[0] < 0.999 or r[1] > 1e-3 for r in res):
                out.append(f"{model}: {method}")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkout", help="a work tree of hila-chefer/Transformer-Explainability")
    p.add_argument("--size", choices=sorted(SIZES), default="tiny")
    p.add_argument("--images", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--weights", choices=("redrawn", "init"), default="redrawn",
                   help="redrawn: every parameter drawn as randomize() says (default); init: the libraries' "
                        "initialization (std 0.02: near-uniform attention, Grad-CAM maps often all 0)")
    args = p.parse_args(argv)
    if not args.checkout:
        print("authors_reference.py needs --checkout PATH: a work tree of the authors' repository "
              "hila-chefer/Transformer-Explainability (e.g. git archive HEAD | tar -x -C PATH), and einops installed "
              "(pip install einops).", file=sys.stderr)
        return 2
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    A = authors(args.checkout)
    size = SIZES[args.size]
    redraw = args.weights == "redrawn"
    print(f"size={args.size}: ViT {size['vit']} on 224×224 images ({args.images}); BERT {size['bert']} on texts of "
          f"{size['lengths']} tokens; {args.weights} weights, seed {args.seed}")
    tables, vt, bt = [], None, None
    for title, dtype, eps in CONFIGS:
        rows, vt = run_vit(A, size["vit"], args.images, args.seed, dtype, eps, redraw, vt)
        more, bt = run_bert(A, size["bert"], size["lengths"], args.seed, dtype, eps, redraw, bt)
        tables.append((title, rows + more))
    for k, (title, rows) in enumerate(tables):
        print_table(title, rows, floor=tables[1][1] if k == 0 else None)
    print("\ngoals (Pearson >= 0.999, max rel. diff <= 1e-3 for lrp — at the encoder input for BERT — and "
          "partial_lrp):")
    for title, rows in tables:
        missed = missed_goals(rows)
        print(f"- {title}: " + ("met" if not missed else "missed for " + "; ".join(missed)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
