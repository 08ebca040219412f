"""Kernels and host syncs of one warm ``explain()`` call, per method, against one forward+backward pass.

Counted, not timed (:mod:`relprop.tools.launch_count`: every aten op the call dispatches, views and
metadata reads left out; a host sync is an op whose result the host waits for), as on an accelerator
(``Tuning(host_reads="end")``, the default there; on the CPU relprop reads values where that saves
memory, as a host read costs no round trip there). Random weights, 1
thread, batch 1, after the capture and two warm-up calls. The models: a LLaMA-style decoder (4 layers,
width 512, 8 heads, 4 key-value heads), BERT (4 layers, width 768) and timm ViT-B/16 (4 blocks), at
``--tokens`` tokens (the ViT at 224 × 224: 197). LXT 2.1's AttnLRP (``benchmarks/peers.py``) is
counted where it applies. ``--where`` prints the relprop lines that issue each method's syncs.

    python benchmarks/launches.py [--models llama,bert,vit] [--methods ...] [--tokens 128] [--where]
"""
from __future__ import annotations

import argparse
import os
import sys

import timm
import torch
import transformers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import relprop  # noqa: E402
import relprop.targets  # noqa: E402
from relprop.tools.launch_count import count, table  # noqa: E402

#: method@preset rows, the issue's table first
METHODS = ("transformer_attribution", "lrp@attnlrp", "lrp@cp_lrp", "gradient_rollout", "rollout", "raw_attention",
           "lrp", "lrp@chefer2021", "attention_gradcam", "attcat", "grads", "input_x_gradient", "partial_lrp")
FWD_BWD = "one forward+backward (weight gradients)"
LXT = "LXT 2.1 AttnLRP (peers.py)"


def build(name: str, tokens: int):
    """(model, inputs, target for explain, target for the plain passes, description)."""
    torch.manual_seed(0)
    if name == "llama":
        cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1376, num_hidden_layers=4,
                                       num_attention_heads=8, num_key_value_heads=4,
                                       max_position_embeddings=max(256, tokens))
        model = transformers.LlamaForCausalLM(cfg).eval()
        x = {"input_ids": torch.randint(3, cfg.vocab_size, (1, tokens)),
             "attention_mask": torch.ones(1, tokens, dtype=torch.long)}
        return model, x, relprop.targets.next_token(x["attention_mask"], token=7), 7, \
            f"LLaMA-style decoder, 4 layers, width 512, {tokens} tokens"
    if name == "bert":
        cfg = transformers.BertConfig(num_hidden_layers=4, num_labels=2)
        model = transformers.BertForSequenceClassification(cfg).eval()
        x = {"input_ids": torch.randint(1000, 30000, (1, tokens)),
             "attention_mask": torch.ones(1, tokens, dtype=torch.long)}
        return model, x, 1, 1, f"BERT, 4 layers, width 768, {tokens} tokens"
    model = timm.create_model("vit_base_patch16_224", pretrained=False, depth=4).eval()
    return model, torch.randn(1, 3, 224, 224), 1, 1, "timm ViT-B/16, 4 blocks, 197 tokens"


def fwd_bwd(model, x, target):
    out = model(**x) if isinstance(x, dict) else model(x)
    logits = out.logits if hasattr(out, "logits") else out
    (logits[:, -1, target] if logits.dim() == 3 else logits[:, target]).sum().backward()
    model.zero_grad(set_to_none=True)


def lxt_call(name, model, x, target):
    import peers
    if name == "llama":
        return lambda: peers.lxt_llama(model, x, target)
    if name == "vit":
        return lambda: peers.lxt_vit(model, x, target)
    return None


#: the calls as on an accelerator: every host read at the end of the call (the CPU's default reads values
#: where they save memory, as a host read costs no round trip there: relprop.Tuning(host_reads="auto"))
ON_A_DEVICE = relprop.Tuning(host_reads="end")


def explain_call(model, x, target, spec, tuning=ON_A_DEVICE):
    method, _, preset = spec.partition("@")
    kw = {"preset": preset} if preset else {}
    return lambda: relprop.explain(model, x, target=target, method=method, tuning=tuning, **kw)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="llama,bert,vit")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--where", action="store_true", help="print the relprop lines that issue the syncs")
    p.add_argument("--top", type=int, default=0, help="print each call's most frequent kernels")
    args = p.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("RELPROP_PROGRESS", "off")
    for name in args.models.split(","):
        model, x, target, plain_target, what = build(name, args.tokens)
        calls = {FWD_BWD: lambda: fwd_bwd(model, x, plain_target)}
        for spec in args.methods.split(","):
            calls[spec] = explain_call(model, x, target, spec)
        lxt = lxt_call(name, model, x, plain_target)
        if lxt is not None:
            calls[LXT] = lxt
        rows, refusals = {}, {}
        for k, fn in calls.items():
            try:
                fn()
                fn()  # capture and two warm-up calls
            except relprop.RelpropError as e:
                refusals[k] = str(e).splitlines()[0]
                continue
            rows[k] = count(fn, where=args.where, frames=3)
        print(f"\n### {what}; torch {torch.__version__}, 1 thread\n")
        print("\n".join(table(rows, FWD_BWD, LXT if LXT in rows else None)))
        for k, why in refusals.items():
            print(f"- {k}: refused ({why[:160]})")
        for k, c in rows.items():
            if args.top:
                print(f"- {k}: " + ", ".join(f"{op} {n}" for op, n in c.by_op.most_common(args.top)))
            if args.where and c.sync_sites:
                print(f"- syncs of {k}:")
                for site, n in c.sync_sites.most_common():
                    print(f"    {n:4d}  {site}")


if __name__ == "__main__":
    main()
