"""Record what ``relprop.explain`` returns on the tiny test models, every method, into a golden file.

The golden file pins the library's numbers across refactorings: :mod:`tests.test_golden` explains
the same models again and compares every tensor of every Explanation with the recorded one, bit
for bit when the environment is the one that recorded it (same torch, transformers and timm
versions, CPU capability and thread count), to float32 rounding otherwise.

Run from the repository root (it overwrites the file; do so only when a change of numbers is
intended, and say why in the commit message)::

    python tests/golden/generate.py                          # every case
    python tests/golden/generate.py --check                  # compare with the file instead of writing it
    python tests/golden/generate.py --check --rounding       # ... to float32 rounding only (1e-3 of the scale;
                                                             # elsewhere than the recording's environment, also
                                                             # 16 times this machine's float32 rounding)
    python tests/golden/generate.py --update lrp partial_lrp # re-record these call labels only
    python tests/golden/generate.py --check --file OTHER     # compare with a file another checkout recorded here

``--update LABEL ...`` re-records the given call labels (a method name, or a variant such as
``lrp@attnlrp``) in every case (``--only`` narrows the cases) and leaves every other record as it
was: the same objects, pickled to the same bytes (checked before the file is written). It refuses
when this environment is not the one the file was recorded in, so that one file never mixes two.

Outputs of the sampling methods use few samples (``n_samples=3``, ``n_steps=3``) to stay small.
"""
from __future__ import annotations

import argparse
import os
import pickle
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # tests/ (models.py)
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # the checkout's relprop, not an installed one

import models  # noqa: E402

import relprop  # noqa: E402

GOLDEN = os.path.join(HERE, "explain_outputs.pkl.gz")
#: random projections kept per tensor (with its sha256 and float64 sums): enough to tell a change of
#: numbers from float rounding without storing the tensors themselves
PROJECTIONS = 4
#: fields of an Explanation compared (tensors; conservation and blocks are flattened below)
FIELDS = ("scores", "map", "mask", "matrix", "input_relevance", "target", "target_scores", "logits")
BLOCK_FIELDS = ("attention", "gradient", "relevance", "hidden", "hidden_gradient", "hidden_relevance", "value",
                "features", "features_gradient", "out_proj_weight")
SAMPLING_OPTIONS = {"smoothgrad": {"n_samples": 3}, "integrated_gradients": {"n_steps": 3}}


def save(data: dict, path: str = None) -> None:
    path = path or GOLDEN
    import gzip
    with gzip.open(path, "wb") as f:
        pickle.dump(data, f, protocol=4)


def load(path: str = None) -> dict:
    path = path or GOLDEN
    import gzip
    import pickle
    with gzip.open(path, "rb") as f:
        return pickle.load(f)


def environment() -> dict:
    """What decides whether two runs can agree bit for bit."""
    import timm
    import transformers
    return {"torch": torch.__version__, "transformers": transformers.__version__, "timm": timm.__version__,
            "cpu": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads()}


def _clip_similarity_to_text(j):
    return lambda o: o.logits_per_image[:, j]


def _clip_similarity_to_image(i):
    return lambda o: o.logits_per_text[:, i]


def cases():
    """(case name, model factory, inputs factory, explain keywords) for every model of the zoo."""
    out = []
    for name, make in models.VISION.items():
        out.append((name, make, models.image_batch, {}))
    for name, make in models.TEXT.items():
        out.append((name, make, lambda m: models.text_batch(), {}))
    for name, make in models.SWIN.items():
        out.append((name, make, models.swin_images, {}))
    out.append(("hf_clip_image", models.hf_clip, lambda m: models.clip_batch(),
                {"wrt": "pixel_values", "target": _clip_similarity_to_text(1)}))
    out.append(("hf_clip_text", models.hf_clip, lambda m: models.clip_batch(),
                {"target": _clip_similarity_to_image(0)}))
    for name, make in models.DECODERS.items():
        kw = {} if "cls" in name else {"target": "next_token"}
        out.append((name, make, lambda m: models.decoder_batch(), kw))
    for name, make in models.SIZES.items():
        out.append((name, make, models.sized_images, {}))
    return out


#: extra (label, explain keywords) per case beyond one call per method
VARIANTS = [
    ("lrp@lrp", {"method": "lrp", "preset": "lrp"}),  # the paper's plain-LRP baseline (lrp's default is attnlrp)
    ("lrp@attnlrp", {"method": "lrp", "preset": "attnlrp"}),
    ("lrp@attnlrp/interpreter", {"method": "lrp", "preset": "attnlrp", "fast_path": False}),
    ("lrp@cp_lrp", {"method": "lrp", "preset": "cp_lrp"}),
    ("lrp@cp_lrp/interpreter", {"method": "lrp", "preset": "cp_lrp", "fast_path": False}),
    ("transformer_attribution/memory=low", {"method": "transformer_attribution", "memory": "low"}),
    ("transformer_attribution/memory=high", {"method": "transformer_attribution", "memory": "high"}),
    ("transformer_attribution/start_block=1,normalize_rows", {"method": "transformer_attribution",
                                                              "start_block": 1, "normalize_rows": True}),
]


def fingerprint(t: torch.Tensor, keep: bool = False) -> dict:
    """What the golden file keeps of a tensor: shape, dtype, the sha256 of its bytes (bit identity),
    float64 sum, sum of absolute values, L2 norm and :data:`PROJECTIONS` projections on fixed random
    vectors (closeness when the bytes differ); with ``keep`` (the scores) the tensor itself too."""
    import hashlib
    t = t.detach().cpu().contiguous()
    d = t.double().flatten()
    g = torch.Generator().manual_seed(d.numel())
    proj = torch.randn(PROJECTIONS, d.numel(), generator=g, dtype=torch.float64) @ d if d.numel() else d.new_zeros(0)
    return {"shape": tuple(t.shape), "dtype": str(t.dtype),
            "sha256": hashlib.sha256(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"").hexdigest(),
            "stats": [float(d.sum()), float(d.abs().sum()), float(d.norm())],
            "projections": proj.tolist(), "values": t.double().tolist() if keep else None}


def flatten(exp) -> dict:
    """Every tensor of an Explanation under a stable key (as :func:`fingerprint`)."""
    out = {}
    for f in FIELDS:
        v = getattr(exp, f)
        if torch.is_tensor(v):
            out[f] = v
    c = exp.conservation
    if c is not None:
        out["conservation.injected"] = c.injected
        out["conservation.input"] = c.input
        out["conservation.absorbed"] = c.absorbed
        for i, bc in enumerate(c.blocks):
            out[f"conservation.block{i}.in"] = bc.relevance_in
            out[f"conservation.block{i}.out"] = bc.relevance_out
            out[f"conservation.block{i}.absorbed"] = bc.absorbed
    for i, b in enumerate(exp.blocks):
        for f in BLOCK_FIELDS:
            v = getattr(b, f)
            if torch.is_tensor(v):
                out[f"block{i}.{f}"] = v
    out = {k: fingerprint(v, keep=k == "scores") for k, v in out.items()}
    out["meta"] = {"preset": exp.preset, "modality": exp.modality, "grid": exp.grid,
                   "prefix_tokens": exp.prefix_tokens, "signed": exp.signed, "class_specific": exp.class_specific,
                   "blocks": [(b.index, b.name, b.layer) for b in exp.blocks]}
    return out


def calls() -> list:
    """(label, explain keywords) of every recorded call: one per method, then :data:`VARIANTS`."""
    return [(m, {"method": m, **SAMPLING_OPTIONS.get(m, {})}) for m in relprop.methods()] + VARIANTS


def _cast(x, dtype):
    """``x`` (a tensor, or a dict or list of them) with its floating-point tensors in ``dtype``."""
    if torch.is_tensor(x):
        return x.to(dtype) if x.is_floating_point() else x
    if isinstance(x, dict):
        return {k: _cast(v, dtype) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_cast(v, dtype) for v in x)
    return x


def record(case, progress=print, labels=None, dtype=None) -> dict:
    """{label: flattened Explanation, or ("error", class name)} for one case (only ``labels`` if given;
    ``dtype``: the model and its floating-point inputs in that dtype, e.g. float64)."""
    name, make, inputs_of, kw = case
    model = make()
    x = inputs_of(model)
    if dtype is not None:
        model, x = model.to(dtype), _cast(x, dtype)
    results = {}
    for label, extra in calls():
        if labels is not None and label not in labels:
            continue
        try:
            exp = relprop.explain(model, x, **kw, **extra)
            results[label] = flatten(exp)
        except relprop.RelpropError as e:
            results[label] = ("error", type(e).__name__)
    progress(f"{name}: {sum(not isinstance(v, tuple) for v in results.values())} results, "
             f"{sum(isinstance(v, tuple) for v in results.values())} refusals")
    return results


def generate() -> dict:
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))  # as tests/conftest.py
    return {"environment": environment(), "cases": {c[0]: record(c) for c in cases()}}


#: methods whose numbers may jump, not drift, when float rounding changes (ViT-CX clusters feature
#: maps with a distance threshold): compared by shape only when the environment differs
DISCRETE = ("vit_cx",)


def compare(expected: dict, got: dict, exact: bool, rtol: float = 1e-3, rounding=None) -> list:
    """Differences between two recordings of one case (an empty list when they agree): bit for bit
    (the sha256 of every tensor) when ``exact``, else the float64 summaries agree to ``rtol`` of the
    tensor's scale (its sum of absolute values), and the :data:`DISCRETE` methods by shape only.
    ``rounding``: {(label, field): how far float32 rounding moves the summaries, as a fraction of the
    scale} (:func:`float32_rounding`): a field may then differ by up to :data:`ROUNDING_FACTOR` times that."""
    problems = []
    for label in expected:
        e, g = expected[label], got.get(label)
        if g is None:
            problems.append(f"{label}: not recorded now")
            continue
        if isinstance(e, tuple) or isinstance(g, tuple):
            if e != g:
                problems.append(f"{label}: was {e if isinstance(e, tuple) else 'a result'}, "
                                f"now {g if isinstance(g, tuple) else 'a result'}")
            continue
        if e.keys() != g.keys():
            problems.append(f"{label}: fields {sorted(set(e) ^ set(g))} differ")
            continue
        for k, v in e.items():
            w = g[k]
            if k == "meta":
                if v != w:
                    problems.append(f"{label}.{k}: {v} != {w}")
                continue
            if v["shape"] != w["shape"] or v["dtype"] != w["dtype"]:
                problems.append(f"{label}.{k}: {v['shape']} {v['dtype']} != {w['shape']} {w['dtype']}")
                continue
            if v["sha256"] == w["sha256"]:
                continue
            detail = ""
            if v["values"] is not None and w["values"] is not None:
                diff = (torch.tensor(v["values"]) - torch.tensor(w["values"])).abs().max().item()
                detail = f" (max abs diff {diff:.3g})"
            if exact:
                problems.append(f"{label}.{k}: not bit-identical{detail}")
                continue
            if label in DISCRETE:
                continue
            scale = max(v["stats"][1], 1e-30)
            worst = _worst(v, w)
            if worst > max(rtol, ROUNDING_FACTOR * (rounding or {}).get((label, k), 0.0)) * scale:
                problems.append(f"{label}.{k}: summaries differ by {worst / scale:.3g} of the tensor's scale{detail}")
    return problems


#: how many times its float32 rounding on this machine a field may differ from a recording made on
#: another CPU (measured: up to 8.7 times, :func:`float32_rounding`)
ROUNDING_FACTOR = 16


def _worst(v: dict, w: dict) -> float:
    """The largest difference of two recorded tensors' float64 summaries."""
    return max(abs(a - b) for a, b in zip(v["stats"] + v["projections"], w["stats"] + w["projections"]))


def float32_rounding(case, got: dict, labels) -> dict:
    """{(label, field): how far this machine's float32 recording ``got`` of ``case`` lies from its
    float64 recording, in summaries, as a fraction of the float64 tensor's scale}, for ``labels``.
    On another CPU (another vector width, so other orders of float sums) float32 rounding moves a
    random-weight model's relevance by a like amount: some ε-stabilized divisions are by nearly 0
    (``lrp`` on the zoo's ViT-Base moves by 2-6 % between float32 and float64 on one machine; AVX-512
    against the AVX2 recording: 0.5-0.6 times its float32-float64 difference there, up to 8.7 times on
    DeiT-Small and CLIP's image tower, whose float32-float64 differences are 4e-4 and 2e-4)."""
    ref = record(case, progress=lambda s: None, labels=set(labels), dtype=torch.float64)
    out = {}
    for label in labels:
        e, g = ref.get(label), got.get(label)
        if isinstance(e, dict) and isinstance(g, dict):
            for k, v in e.items():
                if k != "meta" and k in g and v["shape"] == g[k]["shape"]:
                    out[(label, k)] = _worst(v, g[k]) / max(v["stats"][1], 1e-30)
    return out


def compare_elsewhere(expected: dict, got: dict, case) -> list:
    """:func:`compare` of a recording ``got`` of ``case`` made in another environment than ``expected``
    (another CPU, other library versions): to 1e-3 of each tensor's scale, and where a field differs
    by more, to :data:`ROUNDING_FACTOR` times the float32 rounding this machine measures for it
    (:func:`float32_rounding`)."""
    problems = compare(expected, got, False)
    if problems:
        labels = {p.split(".")[0].split(":")[0] for p in problems}
        problems = compare(expected, got, False, rounding=float32_rounding(case, got, labels))
    return problems


def update(labels, only=None) -> int:
    """Re-record ``labels`` in every case (or the cases in ``only``), keep every other record as it is."""
    import pickle
    known = [label for label, _ in calls()]
    unknown = [label for label in labels if label not in known]
    if unknown:
        print(f"unknown call labels {unknown}; the labels are {known}")
        return 2
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    golden = load()
    if golden["environment"] != environment():
        print(f"refusing to update: the golden file was recorded in {golden['environment']}, this is "
              f"{environment()}; re-record the whole file (python tests/golden/generate.py) or update it there")
        return 1
    before = {(c, label): pickle.dumps(rec, protocol=4) for c, recs in golden["cases"].items() for label, rec in
              recs.items()}
    changed = []
    for case in cases():
        if only and case[0] not in only:
            continue
        new = record(case, progress=lambda s: None, labels=set(labels))
        for label in labels:
            old = golden["cases"][case[0]].get(label)
            if pickle.dumps(old, protocol=4) != pickle.dumps(new[label], protocol=4):
                changed.append(f"{case[0]}/{label}")
            golden["cases"][case[0]][label] = new[label]
        print(f"{case[0]}: re-recorded {', '.join(labels)}")
    save(golden)
    reread = load()  # every record not re-recorded pickles to the bytes it had before
    kept = {k: v for k, v in before.items() if not ((not only or k[0] in only) and k[1] in labels)}
    for (c, label), blob in kept.items():
        if pickle.dumps(reread["cases"][c][label], protocol=4) != blob:
            raise AssertionError(f"{c}/{label} changed although it was not re-recorded")
    if reread["environment"] != golden["environment"] or set(reread["cases"]) != set(golden["cases"]):
        raise AssertionError("the file's environment or list of cases changed")
    print(f"wrote {GOLDEN}: {len(changed)} records changed ({', '.join(changed) or 'none'}); "
          f"{len(kept)} other records kept byte for byte")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="compare with the golden file instead of writing it")
    p.add_argument("--rounding", action="store_true",
                   help="with --check: compare to float32 rounding even where bit-identity is expected (a "
                        "change of arithmetic that should change numbers by rounding only)")
    p.add_argument("--only", nargs="*", help="case names (default: every case)")
    p.add_argument("--update", nargs="+", metavar="LABEL",
                   help="re-record only these call labels (e.g. lrp partial_lrp) and keep every other record")
    p.add_argument("--file", help="another golden file to write or check against (e.g. one recorded by another "
                                   "checkout in this environment, to compare two versions of the code)")
    args = p.parse_args(argv)
    if args.file:
        global GOLDEN
        GOLDEN = os.path.abspath(args.file)
    if args.update:
        return update(args.update, args.only)
    if not args.check:
        data = generate()
        save(data)
        print(f"wrote {GOLDEN} ({os.path.getsize(GOLDEN) / 2**20:.1f} MiB) in environment {data['environment']}")
        return 0
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    golden = load()
    same = golden["environment"] == environment()
    exact = same and not args.rounding
    print(f"golden environment {golden['environment']}; now {environment()}; "
          f"{'bit-identical' if exact else 'to float32 rounding'} comparison")
    failed = 0
    for case in cases():
        if args.only and case[0] not in args.only:
            continue
        got = record(case, progress=lambda s: None)
        problems = compare(golden["cases"][case[0]], got, exact) if same else \
            compare_elsewhere(golden["cases"][case[0]], got, case)
        n = len(golden["cases"][case[0]])
        print(f"{case[0]}: {n - len({p.split(':')[0].split('.')[0] for p in problems})}/{n} calls identical"
              + ("" if not problems else "\n  " + "\n  ".join(problems[:20])))
        failed += bool(problems)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
