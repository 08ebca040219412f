"""Fast path (one modified-gradient backward) against the interpreter (rule by rule) under the
``"attnlrp"`` and ``"cp_lrp"`` presets, for several ``eps`` and dtypes, on tiny random models.

Prints, per model, preset, eps and dtype, the largest absolute difference of the input relevance
divided by its largest absolute value::

    python benchmarks/fast_path_agreement.py                 # every model, both presets
    python benchmarks/fast_path_agreement.py --models vit eva02 --presets attnlrp
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))  # models.py
sys.path.insert(0, os.path.dirname(HERE))  # the checkout's relprop

import models  # noqa: E402

import relprop  # noqa: E402


def _timm(name, size, **kw):
    import timm
    torch.manual_seed(0)
    m = timm.create_model(name, pretrained=False, num_classes=5, **kw).eval()
    return m, torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(0)), 1


MODELS = {
    "vit": lambda: (models.timm_vit_tiny(), models.image_batch(models.timm_vit_tiny()), 1),
    "vit_avg": lambda: _timm("vit_tiny_patch16_224", 64, img_size=64, depth=2, class_token=False, global_pool="avg"),
    "eva02": lambda: _timm("eva02_tiny_patch14_224", 56, img_size=56, depth=2),
    "bert": lambda: (models.hf_bert("eager"), models.text_batch(), 1),
    "llama": lambda: (models.hf_llama(), models.decoder_batch(), "next_token"),
}


def _cast(x, dtype):
    if torch.is_tensor(x):
        return x.to(dtype) if x.is_floating_point() else x
    return {k: _cast(v, dtype) for k, v in x.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--presets", nargs="*", default=["attnlrp", "cp_lrp"])
    p.add_argument("--eps", nargs="*", type=float, default=[0.0, 1e-9, 1e-6, 1e-3])
    p.add_argument("--dtypes", nargs="*", default=["float32", "float64"])
    args = p.parse_args(argv)
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    print(f"{'model':<8} {'preset':<8} {'dtype':<8} {'eps':>7}  {'max|fast-interp|/max|R|':>24}")
    for name in args.models:
        model, x, target = MODELS[name]()
        for dt in args.dtypes:
            dtype = getattr(torch, dt)
            m = model.to(dtype)
            xx = _cast(x, dtype)
            for preset in args.presets:
                for eps in args.eps:
                    ref = relprop.explain(m, xx, target=target, method="lrp", preset=preset, eps=eps, fast_path=False)
                    fast = relprop.explain(m, xx, target=target, method="lrp", preset=preset, eps=eps)
                    assert fast.conservation is None and ref.conservation is not None
                    scale = float(ref.input_relevance.abs().max())
                    diff = float((fast.input_relevance - ref.input_relevance).abs().max())
                    print(f"{name:<8} {preset:<8} {dt:<8} {eps:>7.0e}  {diff / scale:>24.3g}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
