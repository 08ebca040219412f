"""``relprop explain --text`` and the demo: explain a text classifier's predictions, in the terminal
and as an HTML page."""
from __future__ import annotations

import os
from typing import Dict, List, Optional

from ..errors import InputError, MethodError
from ..viz import blocks as vblocks
from ..viz import image as vimg
from ..viz import text as vtext
from .common import EXIT_OK, CliError, chunks, prepare_out, resolve_class
from .images import class_label
from .loading import Loaded, class_scores, early_target, method_label, run_methods


def explain_texts(loaded: Loaded, texts: List[str], names: List[str], args, counterfactual=None,
                  title: str = "relprop explain", header: Optional[List[str]] = None) -> int:
    from rich.console import Console
    console = Console(highlight=False, soft_wrap=True)
    early_target(loaded, args.target)
    if counterfactual is not None and str(counterfactual).lower() not in ("second", "runner-up"):
        early_target(loaded, counterfactual)
    out = prepare_out(args.out)
    merge = not args.no_merge
    tok = loaded.tokenizer
    for line in header or [f"model: {loaded.name}   method{'s' if len(names) > 1 else ''}: "
                           + ", ".join(method_label(n, loaded) for n in names)]:
        console.print(line)
    sections: Dict[str, List[str]] = {n: [] for n in names}
    method_exp = {}
    written = []
    skipped: Dict[str, str] = {}
    for s, e in chunks(len(texts), args.batch_size):
        batch = texts[s:e]
        enc = tok(batch, padding=True, truncation=True, return_tensors="pt")
        inputs = {k: v for k, v in enc.items() if k in ("input_ids", "attention_mask", "token_type_ids")}
        logits = class_scores(loaded.model, inputs)
        n = logits.shape[1]
        probs = logits.softmax(-1)
        target = resolve_class(args.target, loaded.labels, n) if args.target is not None else None
        cf_target = None
        if counterfactual is not None:
            if str(counterfactual).lower() in ("second", "runner-up"):
                if n < 2:
                    raise CliError("--counterfactual second needs a model with at least 2 classes")
                explained = logits.argmax(-1) if target is None else [target] * len(batch)
                cf_target = []
                for j in range(len(batch)):  # the best-scoring class other than the explained one
                    other = logits[j].clone()
                    other[int(explained[j])] = float("-inf")
                    cf_target.append(int(other.argmax()))
            else:
                cf_target = resolve_class(counterfactual, loaded.labels, n, "--counterfactual")
        exps = run_methods(loaded, inputs, target, names)
        cfs = run_methods(loaded, inputs, cf_target, names) if cf_target is not None else [None] * len(exps)
        rows = vtext.token_strings(tok, inputs["input_ids"])
        for j in range(len(batch)):
            i = s + j
            console.print()
            console.print(f"[bold]{i + 1}.[/bold] {batch[j]}")
            pred = int(logits[j].argmax())
            t = int(exps[0].target[j])
            def how(k):
                extra = (f"cos {float(logits[j, k]) / loaded.cosine_scale:.3f}" if loaded.cosine_scale
                         else f"p={float(probs[j, k]):.3f}")
                return f"[bold]{class_label(loaded.labels, k)}[/bold] (score {float(logits[j, k]):.4g}, {extra})"
            line = f"   predicted: {how(pred)}" + ("" if t == pred else f"; explained: {how(t)}")
            console.print(line)
            for exp, cf in zip(exps, cfs):
                for role, ex in (("", exp), ("counterfactual ", cf)):
                    if ex is None:
                        continue
                    toks = vtext.tokens_of(ex, j, rows[j], merge)
                    tc = int(ex.target[j])
                    label = f"{role}{class_label(loaded.labels, tc)}" if role else class_label(loaded.labels, tc)
                    console.print(f"   {ex.method} → {label}: ", end="")
                    console.print(vtext.rich_text([x for x in toks if not x.special]))
                    if args.top:
                        best = ", ".join(f"{x.text} {vtext.signed_score(x.score)}"
                                         for x in vtext.top_tokens(toks, args.top))
                        console.print(f"      top: {best}")
            if out is not None:
                for exp, cf in zip(exps, cfs):
                    sections[exp.method].append(vtext.sample_html(
                        exp, j, rows[j], labels=loaded.labels, counterfactual=cf, merge_words=merge,
                        caption=f"{i + 1}. {batch[j]}",
                        extra=("" if loaded.cosine_scale else f", p={float(probs[j, t]):.3f}") + (
                            "" if t == pred else f" — predicted {class_label(loaded.labels, pred)}")))
                    method_exp[exp.method] = exp
                # the per-block picture shows the quantity the method aggregates per block (R_h for LRP,
                # ∇h ⊙ h for CAT/AttCAT, the query's row of Ā_b for the rollout-style methods)
                shown = [e for e in exps if vblocks.method_source(e.method) is not None]
                for e in shown:
                    suffix = "" if e is shown[0] else f"_{e.method}"
                    try:
                        fig = vblocks.blocks_figure(e, rows[j], j, labels=loaded.labels,
                                                    source=vblocks.method_source(e.method))
                    except (InputError, MethodError) as err:  # no records (fast path, folded) or no row
                        skipped.setdefault(e.method, str(err))
                        continue
                    written.append(vimg.save_figure(fig, os.path.join(out, f"text{i + 1}_blocks{suffix}.png")))
    if out is not None:
        html = vtext.page_html([vtext.section_html(method_exp[n], sections[n]) for n in names if n in method_exp],
                               title=title, note=f"model: {loaded.name}"
                               + (f". Why {loaded.why}" if loaded.why and loaded.default_method in names
                                  and loaded.preset in (None, loaded.default_options.get("preset")) else ""))
        path = os.path.join(out, "explanation.html")
        with open(path, "w", encoding="utf-8") as f:
            f.write(html)
        written.insert(0, path)
    console.print()
    for w in written:
        console.print(f"wrote {w}")
    for method, reason in skipped.items():
        console.print(f"no per-block picture for {method}: {reason}")
    return EXIT_OK
