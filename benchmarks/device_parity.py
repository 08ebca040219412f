"""The same zoo model explained on the CPU and on another device (CUDA by default) gives the same scores.

For each zoo architecture (tests/zoo.py: tiny random configs) and each of five methods, the model is
explained on the CPU in float32, then a copy moved to ``--device`` with its inputs; the script prints
max |scores_cpu − scores_device| / max |scores_cpu| per method (TF32 off, so both sides compute in
float32). On CUDA this exercises the fused attention kernels that ``torch.export`` records there
(``aten._scaled_dot_product_efficient_attention`` and friends), which relprop decomposes into math
attention (relprop/graph/decompositions.py).

    PYTHONPATH=.:tests python benchmarks/device_parity.py                       # the default list
    PYTHONPATH=.:tests python benchmarks/device_parity.py llama gpt2_lm --device cuda
"""
from __future__ import annotations

import argparse
import copy
import time

import torch

import relprop
import zoo

DEFAULT = ["bert", "deberta_v2", "llama", "gpt2_lm", "mistral", "mixtral", "mamba", "timm_vit_gap", "timm_cait",
           "timm_pit", "hf_vit", "hf_vitmae", "clip_image", "bigbird_sparse"]
METHODS = [("transformer_attribution", {}), ("lrp", {"preset": "attnlrp"}), ("gradient_rollout", {}),
           ("attcat", {}), ("integrated_gradients", {"n_steps": 8})]


def _to(x, device):
    if isinstance(x, dict):
        return {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in x.items()}
    return x.to(device)


def compare(name: str, device: str) -> str:
    entry = zoo.ZOO[name]
    torch.manual_seed(0)
    model = entry.build().eval()
    x = entry.inputs(model, 2, 0)
    kw = {"wrt": entry.wrt} if entry.wrt else {}
    moved, xd = copy.deepcopy(model).to(device), _to(x, device)
    cells = []
    for method, opts in METHODS:
        try:
            a = relprop.explain(model, x, target=entry.target, method=method, **opts, **kw)
        except relprop.RelpropError as err:
            cells.append(f"{method}: refused on the CPU too ({type(err).__name__})")
            continue
        b = relprop.explain(moved, xd, target=entry.target, method=method, **opts, **kw)
        assert b.scores.device.type == torch.device(device).type
        d = (a.scores - b.scores.cpu()).abs().max().item() / max(a.scores.abs().max().item(), 1e-30)
        cells.append(f"{method}: {d:.1e}")
    return "; ".join(cells)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", default=DEFAULT, help="zoo architectures (tests/zoo.py)")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    for name in args.names:
        t0 = time.time()
        try:
            line = compare(name, args.device)
        except Exception as err:  # noqa: BLE001 - one architecture's failure is reported, the others still run
            line = f"FAILED {type(err).__name__}: {str(err)[:300]}"
        print(f"{name} ({time.time() - t0:.0f} s): {line}", flush=True)


if __name__ == "__main__":
    main()
