"""Cost of ``explain(method="lrp", preset="attnlrp")`` relative to one forward+backward pass.

Issue 8: AttnLRP's input relevance should cost at most 1.3x one forward+backward pass of the same
model (ViT-B/16 at batch 1, BERT-base at 128 tokens, a small LLaMA). ``explain`` computes it as one
modified-gradient backward pass (:mod:`relprop.engine.fast_path`); the rule-by-rule
interpreter (``fast_path=False``, the reference) is timed alongside, and so is ``"cp_lrp"``.
Models have random weights (built from their configs). Timings on a shared CPU are noisy, so every
quantity is measured in the same run, interleaved, and the median of ``--repeats`` runs is reported.
Two baselines: the forward+backward pass of ``bench_engine.py`` (the target score's
``.backward()`` into the parameters), and a forward+backward pass to the input only (no parameter
gradients: the cost of Input × Gradient), which is the stricter comparison.

    python benchmarks/bench_attnlrp.py [--repeats 5] [--no-interpreter] [--tiny]
"""
from __future__ import annotations

import argparse
import statistics
import time

import timm
import torch
import transformers

import relprop
from relprop.graph.capture import CACHE


def forward_backward(model, inputs, target):
    out = model(**inputs) if isinstance(inputs, dict) else model(inputs)
    if callable(target):  # the same score explain() explains (e.g. the next-token logit)
        target(out).sum().backward()
    else:
        logits = out.logits if hasattr(out, "logits") else out
        logits[:, target].sum().backward()
    model.zero_grad(set_to_none=True)


def input_gradient(model, inputs, target):
    """forward+backward to the input only (pixels, or the word embeddings): what Input × Gradient
    costs, with no parameter gradients (the parameters' flags are restored)."""
    flags = [(q, q.requires_grad) for q in model.parameters()]
    try:
        for q, _ in flags:
            q.requires_grad_(False)
        if isinstance(inputs, dict):
            kw = {k: v for k, v in inputs.items() if k != "input_ids"}
            kw["inputs_embeds"] = model.get_input_embeddings()(inputs["input_ids"]).requires_grad_(True)
            x, out = kw["inputs_embeds"], model(**kw)
        else:
            x = inputs.clone().requires_grad_(True)
            out = model(x)
        if callable(target):
            score = target(out)
        else:
            score = (out.logits if hasattr(out, "logits") else out)[:, target]
        torch.autograd.grad(score.sum(), x)
    finally:
        for q, f in flags:
            q.requires_grad_(f)


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def measure(name, model, inputs, target, repeats, interpreter):
    runs = {"attnlrp": lambda: relprop.explain(model, inputs, target=target, method="lrp", preset="attnlrp"),
            "cp_lrp": lambda: relprop.explain(model, inputs, target=target, method="lrp", preset="cp_lrp")}
    if interpreter:
        runs["attnlrp interpreter"] = lambda: relprop.explain(model, inputs, target=target, method="lrp",
                                                              preset="attnlrp", fast_path=False)
    for label, run in runs.items():  # capture (cached afterwards) and warm up
        e = run()
        fast = e.conservation is None
        assert fast == ("interpreter" not in label), f"{label}: the {'fast path' if fast else 'interpreter'} ran"
    ref = relprop.explain(model, inputs, target=target, method="lrp", preset="attnlrp", fast_path=False)
    fast = relprop.explain(model, inputs, target=target, method="lrp", preset="attnlrp")
    diff = float((fast.input_relevance - ref.input_relevance).abs().max() / ref.input_relevance.abs().max())
    traces = CACHE.traces
    forward_backward(model, inputs, target)
    times = {"fwd+bwd": [], "input grad": []}
    times.update({k: [] for k in runs})
    for _ in range(repeats):
        times["fwd+bwd"].append(timed(lambda: forward_backward(model, inputs, target))[0])
        times["input grad"].append(timed(lambda: input_gradient(model, inputs, target))[0])
        for label, run in runs.items():
            times[label].append(timed(run)[0])
    assert CACHE.traces == traces, "explain() traced again on the same input shapes"
    med = {k: statistics.median(v) for k, v in times.items()}
    fb, ig = med["fwd+bwd"], med["input grad"]
    cells = " | ".join(f"{med[k] * 1000:8.1f} ({med[k] / fb:4.2f}x; {med[k] / ig:4.2f}x)" for k in runs)
    print(f"| {name} | {fb * 1000:8.1f} | {ig * 1000:8.1f} | {cells} | {diff:.1e} | "
          f"{float(ref.conservation.error.max()):.1e} |", flush=True)
    return med["attnlrp"] / fb


def llama(tiny):
    torch.manual_seed(0)
    if tiny:
        cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    else:  # a small LLaMA: 8 layers of width 512 (about 60M parameters with the embeddings)
        cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1376,
                                       num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                                       max_position_embeddings=256)
    return transformers.LlamaForCausalLM(cfg).eval(), cfg.vocab_size


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--no-interpreter", action="store_true", help="do not time the rule-by-rule reference")
    p.add_argument("--tiny", action="store_true", help="tiny configs (a smoke test of this script)")
    args = p.parse_args()
    torch.manual_seed(0)
    interp = not args.no_interpreter
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; times in ms "
          "(ratio to fwd+bwd; ratio to fwd+bwd to the input only)")
    head = "| model | fwd+bwd | fwd+bwd, input only | lrp attnlrp | lrp cp_lrp |" + \
        (" lrp attnlrp, interpreter |" if interp else "")
    print(head + " fast vs interpreter (max rel. diff) | conservation error |")
    print("|---|---:|---:|---:|---:|" + ("---:|" if interp else "") + "---:|---:|")
    size = 64 if args.tiny else 224
    vit = timm.create_model("vit_base_patch16_224", pretrained=False, img_size=size,
                            **({"depth": 2} if args.tiny else {})).eval()
    measure(f"timm vit_base_patch16_224 ({size}px), batch 1", vit, torch.randn(1, 3, size, size), 1,
            args.repeats, interp)
    del vit
    cfg = transformers.BertConfig(num_labels=2, **({"num_hidden_layers": 2} if args.tiny else {}))
    bert = transformers.BertForSequenceClassification(cfg).eval()
    ids = {"input_ids": torch.randint(1000, 30000, (1, 128)), "attention_mask": torch.ones(1, 128, dtype=torch.long)}
    measure("BERT-base, 128 tokens, batch 1", bert, ids, 1, args.repeats, interp)
    del bert
    model, vocab = llama(args.tiny)
    ids = {"input_ids": torch.randint(3, vocab, (1, 128)), "attention_mask": torch.ones(1, 128, dtype=torch.long)}
    target = relprop.targets.next_token(ids["attention_mask"], token=7)  # token 7 at the last position
    measure(f"LLaMA ({sum(p.numel() for p in model.parameters()) / 1e6:.0f}M), 128 tokens, batch 1", model, ids,
            target, args.repeats, interp)


if __name__ == "__main__":
    main()
