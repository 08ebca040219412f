"""mkdocs hook: pages that are generated from the library itself, so they cannot go stale.

A page starting with ``<!-- relprop-readme`` (the home page) is the repository's README.md with its links
made relative to docs/ (a link to a file outside docs/ becomes its path in the repository, as text; a link
to a page of docs/ keeps its #anchor).

``<!-- relprop-methods-table -->`` in a page is replaced by the table of :func:`relprop.methods`
(the same table ``relprop methods --format markdown`` prints).
"""
import os
import re

import relprop

# griffe's warnings about the docstrings docs/api.md renders (a parameter the signature does not have, a
# section it cannot read) fail the --strict build like mkdocs' own: tests/test_api_reference.py says which
# docstring forms render (a name line, then its description indented under it; no Sphinx roles).

MARKER = "<!-- relprop-methods-table -->"
README_MARKER = "<!-- relprop-readme"


def methods_table() -> str:
    """The markdown table of every registered method, from ``relprop.methods()``."""
    rows = ["| method | what it computes | class-specific | signed | reference |", "|---|---|:-:|:-:|---|"]
    for name, info in sorted(relprop.methods().items()):
        cells = [f"`{name}`", info["description"], "yes" if info["class_specific"] else "no",
                 "yes" if info["signed"] else "no", info["reference"]]
        rows.append("| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows) + "\n"


def readme_page(config) -> str:
    """README.md, its links rewritten for a page at the root of docs/."""
    root = os.path.dirname(os.path.abspath(config["config_file_path"]))
    text = open(os.path.join(root, "README.md"), encoding="utf-8").read()
    text = text.replace("[`docs/`](docs/)", "`docs/`").replace("](docs/", "](")
    outside = r"\[([^\]]+)\]\((?!https?:|#)([^)]+)\)"
    return re.sub(outside, lambda m: m.group(0) if os.path.exists(os.path.join(root, "docs", m.group(2).split("#")[0]))
                  else m.group(1) if m.group(1) == f"`{m.group(2)}`" else f"{m.group(1)} (`{m.group(2)}`)", text)


def on_page_markdown(markdown, page, config, files):
    """Fill the generated parts of a page."""
    if markdown.lstrip().startswith(README_MARKER):
        return readme_page(config)
    if MARKER in markdown:
        markdown = markdown.replace(MARKER, methods_table())
    return markdown
