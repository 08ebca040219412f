"""What explaining a dataset costs: texts of varied lengths, every capture included.

A user explains real data, whose lengths rarely repeat. In one process, for one model, this
benchmark generates ``--texts`` texts whose lengths follow a review-like spread (log-normal, median
about 40 tokens, clipped to 8–256; seeded, offline) and measures, as sums over the dataset:

* ``fwd+bwd``: one forward and one backward pass of the explained score per text (the unit);
* per method, **cold**: the dataset explained after forgetting every captured graph of the model
  (``relprop.clear_cache(model)``; the disk cache is off unless ``--disk-cache``), so every capture
  the method needs is paid inside the total; **warm**: the same dataset again right after.

Both ways a user runs a dataset: ``--mode single`` (one text per call) and ``--mode batch16``
(padded batches of 16 in dataset order, right-padded, with the attention mask). Goals
(issue 26): cold ≤ 2 × warm for every method; cold ≤ 3 × fwd+bwd for transformer_attribution,
lrp under AttnLRP and gradient_rollout.

``--before N`` also runs each method cold on the first N texts with the capture of the previous
release (the batch axis dynamic, every other axis fixed: a new export for every new length),
beside the same N texts with the dynamic capture, in the same process.

    python benchmarks/throughput.py --model bert|demo|llama [--texts 64] [--mode single,batch16]
        [--methods transformer_attribution,lrp@attnlrp,gradient_rollout,integrated_gradients]
        [--threads 1] [--before 8] [--disk-cache DIR] [--seed 0]

Models: ``bert`` is BERT-base (random weights, 2 labels); ``demo`` the real all-MiniLM-L6-v2
checkpoint relprop ships (the demo's zero-shot classifier); ``llama`` a LLaMA-style decoder
(random weights, 8 layers of width 512, next-token targets).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import transformers

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import relprop  # noqa: E402
from relprop import demo  # noqa: E402
from relprop.graph import capture, disk_cache, export  # noqa: E402
from relprop.targets import next_token  # noqa: E402

METHODS = "transformer_attribution,lrp@attnlrp,gradient_rollout,integrated_gradients"
IG_STEPS = 8


def lengths(n: int, seed: int, low: int = 8, high: int = 256):
    """Review-like token counts: log-normal with median ~40 (SST-2 sentences to IMDB paragraphs)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.exp(torch.randn(n, generator=g) * 0.8 + 3.7)
    return [int(v) for v in x.round().clamp(low, high)]


def build(name: str):
    """(model, vocabulary range of ordinary ids, tokenizer or None, language model?)"""
    torch.manual_seed(0)
    if name == "bert":
        cfg = transformers.BertConfig(num_labels=2, attn_implementation="sdpa")
        return transformers.BertForSequenceClassification(cfg).eval(), (1000, 20000), None, False
    if name == "demo":
        model, tok = demo.load()
        return model, (1000, tok.vocab_size - 1), tok, False
    if name == "llama":
        cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                                       num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=512,
                                       attn_implementation="sdpa")
        return transformers.LlamaForCausalLM(cfg).eval(), (3, 31999), None, True
    raise SystemExit(f"unknown model {name!r}: bert, demo or llama")


def texts(n: int, seed: int, vocab, tokenizer):
    g = torch.Generator().manual_seed(seed + 1)
    out = []
    for length in lengths(n, seed):
        ids = torch.randint(vocab[0], vocab[1], (length,), generator=g)
        if tokenizer is not None:  # [CLS] ... [SEP], as the tokenizer makes them
            ids[0], ids[-1] = tokenizer.cls_token_id, tokenizer.sep_token_id
        out.append(ids)
    return out


def batches(samples, mode: str):
    size = 1 if mode == "single" else int(mode.replace("batch", ""))
    for i in range(0, len(samples), size):
        chunk = samples[i:i + size]
        width = max(len(s) for s in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros(len(chunk), width, dtype=torch.long)
        for r, s in enumerate(chunk):
            ids[r, :len(s)] = s
            mask[r, :len(s)] = 1
        yield {"input_ids": ids, "attention_mask": mask}


def target_for(lm: bool, batch):
    return next_token(batch["attention_mask"]) if lm else 0


def fwd_bwd(model, batch, lm: bool):
    out = model(**batch, **({"use_cache": False} if lm else {}))
    logits = out.logits if hasattr(out, "logits") else out
    if lm:
        logits = next_token(batch["attention_mask"])(logits.unsqueeze(0) if logits.dim() == 2 else logits)
        logits.sum().backward()
    else:
        logits[:, 0].sum().backward()
    model.zero_grad(set_to_none=True)


def split(label: str):
    method, _, preset = label.partition("@")
    opts = {"preset": preset} if preset else {}
    if method == "integrated_gradients":
        opts["n_steps"] = IG_STEPS
    return method, opts


def pass_over(model, samples, mode, lm, method, opts):
    t = time.perf_counter()
    for batch in batches(samples, mode):
        relprop.explain(model, batch, target=target_for(lm, batch), method=method, **opts)
    return time.perf_counter() - t


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="bert")
    p.add_argument("--texts", type=int, default=64)
    p.add_argument("--mode", default="single,batch16")
    p.add_argument("--methods", default=METHODS)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--before", type=int, default=0, help="also time the old per-length capture on N texts")
    p.add_argument("--disk-cache", default=None, help="a directory for the disk cache (default: off)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    disk_cache.set_cache_dir(args.disk_cache)
    import warnings
    warnings.simplefilter("ignore")
    model, vocab, tok, lm = build(args.model)
    samples = texts(args.texts, args.seed, vocab, tok)
    ls = sorted(len(s) for s in samples)
    print(f"# {args.model}: {len(samples)} texts, {len(set(ls))} distinct lengths, min {ls[0]} median "
          f"{ls[len(ls) // 2]} max {ls[-1]}, {sum(ls)} tokens; {args.threads} thread(s); torch {torch.__version__}")
    print("| mode | method | fwd+bwd s | cold s | warm s | cold / warm | cold / fwd+bwd | warm / fwd+bwd | exports | "
          "sizes |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for mode in args.mode.split(","):
        for label in args.methods.split(","):
            method, opts = split(label)
            t = time.perf_counter()
            for batch in batches(samples, mode):
                fwd_bwd(model, batch, lm)
            base = time.perf_counter() - t
            relprop.clear_cache(model)
            traces, specs = capture.CACHE.captures, capture.CACHE.specializations
            cold = pass_over(model, samples, mode, lm, method, opts)
            exports = capture.CACHE.captures - traces
            sizes = capture.CACHE.specializations - specs
            warm = pass_over(model, samples, mode, lm, method, opts)
            print(f"| {mode} | {label} | {base:.1f} | {cold:.1f} | {warm:.1f} | {cold / warm:.2f} | "
                  f"{cold / base:.2f} | {warm / base:.2f} | {exports} | {sizes} |", flush=True)
    if args.before:
        few = samples[:args.before]
        print(f"\n# the first {len(few)} texts ({len(set(len(s) for s in few))} distinct lengths), one at a time, "
              "cold: the previous capture (one export per length) against the dynamic one")
        print("| method | previous s | dynamic s | previous exports | dynamic exports | previous / dynamic |")
        print("|---|---:|---:|---:|---:|---:|")
        for label in args.methods.split(","):
            method, opts = split(label)
            row = []
            for attempts in (export.ATTEMPTS[1:], export.ATTEMPTS):
                relprop.clear_cache(model)
                export_before = capture.CACHE.traces
                capture.CACHE.attempts = attempts
                try:
                    seconds = pass_over(model, few, "single", lm, method, opts)
                    row.append((seconds, capture.CACHE.traces - export_before))
                finally:
                    capture.CACHE.attempts = export.ATTEMPTS
            (old, n_old), (new, n_new) = row
            print(f"| {label} | {old:.1f} | {new:.1f} | {n_old} | {n_new} | {old / new:.1f} |", flush=True)


if __name__ == "__main__":
    main()
