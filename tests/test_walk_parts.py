"""The walk's parts, each with one job: the Ledger books the conservation sums, the ValueStore holds
and frees the forward values, the fold hooks are called through their public methods; no module
edits the attributes of the walker or of its parts from outside."""
import re
from pathlib import Path

import pytest
import torch

import models
from relprop.engine.forward import forward
from relprop.engine.ledger import Ledger, sample_sum
from relprop.engine.value_store import ValueStore
from relprop.errors import RelpropError
from relprop.graph.capture import CACHE
from relprop.graph.inputs import bind_inputs
from relprop.graph.nodes import module_paths

PACKAGE = Path(__file__).resolve().parents[1] / "relprop"


@pytest.fixture(scope="module")
def bert():
    model = models.TEXT["hf_bert_eager"]()
    kwargs = bind_inputs(model, models.text_batch(lengths=(4, 6)))
    return model, kwargs, CACHE.get(model, kwargs)


def _forward(bert):
    model, kwargs, captured = bert
    with torch.no_grad():
        env, _ = forward(captured, model, kwargs)
    return env


def test_value_store_frees_each_value_once_the_walk_left_it_unless_read_after(bert):
    captured = bert[2]
    env = _forward(bert)
    store = ValueStore(captured, env)
    order = [n for n in reversed(captured.graph.nodes) if n.op == "call_function" and n in env]
    later = [n for n in order if n in store.needed_later]
    dead = [n for n in order[:-1] if n not in store.needed_later]
    assert later and dead
    for n in order:
        store.entering(n)
    assert all(n in env for n in later)  # the block records read them after the walk
    assert not any(n in env for n in dead)
    with pytest.raises(RelpropError, match="freed before the reverse walk read it"):
        store.value(dead[0])  # not rematerializable: a freed value is a bug, said so


def test_value_store_releases_what_fold_hooks_read_but_never_lets_a_rule_overwrite_it(bert):
    captured = bert[2]
    env = _forward(bert)
    store = ValueStore(captured, env)
    att = captured.analysis.blocks[-1].attention
    assert att in store.needed_later and not store.dead_after(att)
    store.release_after_walk({att})
    assert att not in store.needed_later and not store.dead_after(att)  # still untouchable
    store.entering(att)
    store.entering(next(iter(att.all_input_nodes)))
    assert att not in env


def test_ledger_books_each_share_per_sample_under_its_label_and_block(bert):
    captured = bert[2]
    a = captured.analysis
    ledger = Ledger(a, 2, torch.device("cpu"), torch.float32)
    out = next(n for n in captured.graph.nodes if n.op == "output").args[0]
    out = out[0] if isinstance(out, (list, tuple)) else out
    ledger.inject(out, torch.full((2, 3), 2.0))
    inside = next(n for n in captured.graph.nodes if a.blocks[0].layer in module_paths(n))
    ledger.absorb("bias", torch.tensor([[1.0, 2.0], [3.0, 4.0]]), inside, 0, None)
    ledger.absorb("bias", torch.tensor([[1.0, 0.0], [0.0, 1.0]]), inside, 0, None)
    source = a.sources[0]
    part = torch.ones(2, 6, 8)
    c = ledger.close([(source, part)], "lrp")
    torch.testing.assert_close(c.injected, torch.tensor([6.0, 6.0]))
    torch.testing.assert_close(c.absorbed_by["bias"], torch.tensor([4.0, 8.0]))
    torch.testing.assert_close(c.absorbed, torch.tensor([4.0, 8.0]))
    torch.testing.assert_close(c.input, sample_sum(part, a.batch_dim.get(source), 2))
    assert set(ledger.per_block_absorbed) == {b.layer for b in a.blocks}
    torch.testing.assert_close(ledger.per_block_absorbed[a.blocks[0].layer], torch.tensor([4.0, 8.0]))
    assert all(ledger.per_block_absorbed[b.layer].abs().sum() == 0 for b in a.blocks[1:])


def test_sample_sum_splits_grouped_batches_batch_major():
    t = torch.arange(12.0).reshape(4, 3)  # batch 2, 2 groups per sample (heads folded into the batch)
    torch.testing.assert_close(sample_sum(t, 0, 2), torch.tensor([15.0, 51.0]))
    torch.testing.assert_close(sample_sum(torch.tensor(6.0), None, 2), torch.tensor([3.0, 3.0]))


#: objects of the walk that only their own methods change
PARTS = r"(walker|ledger|store|values|folder|hooks|streamer)"


def test_no_module_edits_the_walk_s_objects_from_outside():
    edit = re.compile(r"^\s*(?:\w+\s*,\s*)*\b(?!self\b)%s\.\w+(?:\[[^\]]*\])?(?:\s*,\s*[\w.]+)*\s*[-+|]?=(?!=)"
                      % PARTS, re.M)
    found = []
    for path in sorted((PACKAGE / "engine").rglob("*.py")):
        text = path.read_text()
        for m in edit.finditer(text):
            found.append(f"{path.name}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0).strip()}")
    assert not found, "attributes of the walk's objects set from outside:\n" + "\n".join(found)
