"""The model-family adapters (relprop.models): the registry, the plain model's no-op adapter, a new toy
family added as docs/extending.md shows it (its explanation equals the unwrapped model's, sample by sample
and for the batch), and the spine's independence from families (the api layer reads no model_type and
names no family)."""
import ast
import re
from pathlib import Path

import pytest
import torch

import models
import relprop
from relprop.models import ADAPTERS, PLAIN, adapter_for, families, unregister
from test_extending import code_blocks

API = Path(relprop.__file__).resolve().parent / "api"
#: families relprop knows, by the names their code would use: none may appear in the api layer's code
FAMILY_WORDS = re.compile(r"qwen|llava|idefics|smolvlm|paligemma|gemma|anyres|vlm|tiled|clip|siglip|mllama|"
                          r"pixtral|internvl|model_type", re.I)


def _code_strings_and_names(path: Path):
    """The identifiers, attribute names and non-docstring string constants of a module (comments and
    docstrings are documentation, not the code's knowledge)."""
    tree = ast.parse(path.read_text())
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docstrings.add(id(first.value))
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            yield node.lineno, node.id
        elif isinstance(node, ast.Attribute):
            yield node.lineno, node.attr
        elif isinstance(node, ast.alias):
            yield node.lineno if hasattr(node, "lineno") else 0, node.name
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.lineno, node.module
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            yield node.lineno, node.value


def test_the_api_layer_names_no_family():
    found = [f"{p.name}:{line}: {text!r}" for p in sorted(API.glob("*.py"))
             for line, text in _code_strings_and_names(p) if FAMILY_WORDS.search(text)]
    assert not found, "family knowledge belongs in relprop/models (an adapter): " + "; ".join(found)
    # the same test finds family knowledge where it is: it is not vacuous
    assert any(FAMILY_WORDS.search(t) for _, t in _code_strings_and_names(Path(families.__file__)))


def test_a_plain_model_takes_the_no_op_adapter():
    bert = models.hf_bert()
    assert adapter_for(bert) is PLAIN and adapter_for(models.timm_vit_tiny()) is PLAIN
    batch = models.text_batch()
    adapted = PLAIN.prepare(bert, batch, [], None)
    assert adapted.model is bert and adapted.inputs is batch and adapted.wrt is None and adapted.layout is None
    assert not PLAIN.splits(bert, batch) and PLAIN.generation is None
    assert PLAIN.explain_generation(relprop.explain, bert, None, batch, 1, "lrp", None, None, None, None, {}, 1,
                                    None) is None


def test_the_known_families_are_registered_most_specific_first():
    assert ADAPTERS.index(families.QWEN_VL) < ADAPTERS.index(families.UNKNOWN_VLM)
    assert ADAPTERS[-1] is families.UNKNOWN_VLM  # the generic vision-language adapter is asked last
    assert {families.QWEN_VL.generation, families.TILED_VLM.generation, families.ANYRES_VLM.generation} == {"steps"}
    assert families.IMAGE_TOKEN_VLM.generation == "batched"

    class Config:
        model_type = "qwen2_vl"
    fake = torch.nn.Linear(1, 1)
    fake.config = Config()
    assert adapter_for(fake) is families.QWEN_VL


@pytest.fixture()
def toy_family():
    """The toy family of docs/extending.md, "Adding a model family", registered; unregistered afterwards."""
    scope = {}
    exec(compile(code_blocks("## Adding a model family")[0], "docs/extending.md", "exec"), scope)
    yield scope
    unregister(scope["adapter"])


def test_a_new_family_is_one_adapter_and_one_registry_row(toy_family):
    bert = models.hf_bert()
    batch = models.text_batch(lengths=(6, 6))
    tagged = toy_family["TaggedClassifier"](bert)
    assert adapter_for(tagged) is toy_family["adapter"] and adapter_for(bert) is PLAIN
    scope = {"relprop": relprop, "TaggedClassifier": toy_family["TaggedClassifier"], "bert": bert, "batch": batch}
    exec(compile(code_blocks("## Adding a model family")[1], "docs/extending.md", "exec"), scope)
    exp = scope["exp"]
    plain = relprop.explain(bert, batch, target=1, method="lrp")
    # the family's batch, explained sample by sample and joined, is the unwrapped model's batch
    assert exp.scores.shape == plain.scores.shape
    assert torch.allclose(exp.scores, plain.scores, atol=1e-5, rtol=1e-4)
    assert "tag: reviews" in exp.notes and any("sample by sample" in n for n in exp.notes)
    one = relprop.explain(tagged, {"input_ids": batch["input_ids"][:1], "attention_mask": batch["attention_mask"][:1],
                                   "tag": "one"}, target=1, method="lrp")
    assert torch.allclose(one.scores[0], plain.scores[0], atol=1e-5, rtol=1e-4) and "tag: one" in one.notes


def test_an_unregistered_family_is_no_longer_adapted(toy_family):
    tagged = toy_family["TaggedClassifier"](models.hf_bert())
    unregister(toy_family["adapter"])
    assert adapter_for(tagged) is PLAIN
    with pytest.raises(relprop.RelpropError):  # the plain spine cannot take a string input nor a batch of 2
        relprop.explain(tagged, {**models.text_batch(lengths=(6, 6)), "tag": "x"}, target=1, method="lrp")
