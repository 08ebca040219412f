"""How much the relevance pass amplifies a perturbation of its inputs, on a real checkpoint (offline).

all-MiniLM-L6-v2 (the demo's checkpoint, a 6-block BERT) with a random 2-class head, two texts of up to
500 tokens: the scores of `transformer_attribution` (``query="mean"``) and of `lrp` under the presets
``"lrp"`` (its default on this model), ``"chefer2021"`` and ``"attnlrp"`` (each sample's own maximum), then
for `transformer_attribution` (records kept) each block's attention map A and its relevance R_A
(CVPR 2021 Eq. 9–10, ``exp.blocks[i].relevance``),

1. float32 against float64 (the same weights);
2. float64 against float64 with every weight multiplied by (1 + 1e-7·noise): a perturbation of the size of
   float32's rounding, in a precision whose own rounding is 1e-16, so what moves is the method's
   conditioning, not the arithmetic.

Each figure is max |a − b| / max |b|, b the float64 (unperturbed) result.

    python benchmarks/conditioning.py
"""
import copy
import warnings

import torch
import transformers

import relprop
from relprop.tools.demo import checkpoint_dir

TEXT = " ".join(["The quick brown fox jumps over the lazy dog while the committee debates the budget."] * 30)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b).abs().max() / b.abs().max())


def _explain(model, batch):
    return relprop.explain(model, batch, method="transformer_attribution", target=1, keep_blocks=True, query="mean")


def main() -> None:
    warnings.simplefilter("ignore")
    transformers.logging.set_verbosity_error()
    path = checkpoint_dir()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    torch.manual_seed(0)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        path, attn_implementation="sdpa", num_labels=2).eval()
    batch = tok([TEXT, TEXT[:900]], return_tensors="pt", padding=True, truncation=True, max_length=500)
    e32 = _explain(model, batch)
    m64 = copy.deepcopy(model).double()
    e64 = _explain(m64, batch)
    noisy = copy.deepcopy(m64)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in noisy.parameters():
            p.mul_(1 + 1e-7 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    ep = _explain(noisy, batch)
    print(f"tokens {batch['input_ids'].shape[1]}, samples {batch['input_ids'].shape[0]}")
    print("| scores (the map), worst sample | float32 vs float64 | float64, weights × (1 + 1e-7·noise) |")
    print("|---|---:|---:|")
    runs_of = (("transformer_attribution", None), ("lrp", "lrp"), ("lrp", "chefer2021"), ("lrp", "attnlrp"))
    for method, preset in runs_of:
        kw = {"query": "mean"} if preset is None else {"preset": preset}
        runs = [relprop.explain(m, batch, method=method, target=1, **kw).scores for m in (model, m64, noisy)]
        worst = [max(_rel(r[i], runs[1][i]) for i in range(runs[1].shape[0])) for r in (runs[0], runs[2])]
        print(f"| `{method}`{'' if preset is None else f' under `{preset!r}`'} | {worst[0]:.1e} | {worst[1]:.1e} |")
    print()
    print("| | float32 vs float64 | float64, weights × (1 + 1e-7·noise) |")
    print("|---|---:|---:|")
    print(f"| scores | {_rel(e32.scores, e64.scores):.1e} | {_rel(ep.scores, e64.scores):.1e} |")
    for i, (b32, b64, bp) in enumerate(zip(e32.blocks, e64.blocks, ep.blocks)):
        print(f"| block {i}: A | {_rel(b32.attention, b64.attention):.1e} | {_rel(bp.attention, b64.attention):.1e} |")
        print(f"| block {i}: R_A (sum {float(b64.relevance.sum()):.3f}) | {_rel(b32.relevance, b64.relevance):.1e} "
              f"| {_rel(bp.relevance, b64.relevance):.1e} |")


if __name__ == "__main__":
    main()
