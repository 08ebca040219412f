"""Token ids rearranged before their embedding lookup (HF XLNet permutes ``input_ids`` to [tokens,
batch]; a model may transpose, flatten or slice them) are followed: the lookup is commuted with the
rearrangement (:mod:`relprop.graph.id_lookups`), and the scores are per input position, checked against
autograd's gradient × input on the looked-up embeddings and against the same model fed in its own layout."""
from __future__ import annotations

import warnings

import pytest
import torch
import transformers

import relprop
from relprop.graph.capture import capture


def _xlnet():
    torch.manual_seed(0)
    cfg = transformers.XLNetConfig(vocab_size=64, d_model=32, n_layer=2, n_head=4, d_inner=64)
    return transformers.XLNetForSequenceClassification(cfg).eval()


class TransposedIds(torch.nn.Module):
    """Reads its ids sequence-major, drops the last position, and pools: ids.t()[:-1] → lookup."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(40, 8)
        self.mix = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 3)

    def forward(self, input_ids):
        h = self.emb(input_ids.t()[:-1])  # [tokens - 1, batch, 8]
        return self.head(torch.tanh(self.mix(h)).mean(0))

    def on_embeddings(self, e):  # the same model on the looked-up vectors [batch, tokens, 8]
        return self.head(torch.tanh(self.mix(e.transpose(0, 1)[:-1])).mean(0))


def _explain(model, x, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return relprop.explain(model, x, target=1, **kw)


def _ids(batch=2, length=6, seed=0):
    ids = torch.randint(10, 40, (batch, length), generator=torch.Generator().manual_seed(seed))  # no special ids
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def test_xlnet_scores_are_gradient_times_input():
    model, x = _xlnet(), _ids()
    e = _explain(model, x, method="input_x_gradient")
    emb = model.transformer.word_embedding(x["input_ids"]).detach().requires_grad_(True)
    model(inputs_embeds=emb, attention_mask=x["attention_mask"]).logits[:, 1].sum().backward()
    assert torch.allclose(e.scores, (emb.grad * emb).sum(-1), atol=1e-6, rtol=1e-4)


def test_xlnet_lrp_conserves_and_is_batch_invariant():
    model, x = _xlnet(), _ids(batch=3)
    walked = _explain(model, x, method="lrp", preset="attnlrp", fast_path=False)
    assert float(walked.conservation.error.max()) < 1e-4
    fast = _explain(model, x, method="lrp", preset="attnlrp")
    assert torch.allclose(fast.scores, walked.scores, atol=1e-5, rtol=1e-4)
    one = _explain(model, {k: v[1:2] for k, v in x.items()}, method="lrp", preset="attnlrp")
    assert torch.allclose(one.scores[0], fast.scores[1], atol=1e-5, rtol=1e-4)
    moved = dict(x, input_ids=x["input_ids"].clone())
    moved["input_ids"][0, 2] = 5  # one position changed: that position's score moves
    changed = _explain(model, moved, method="lrp", preset="attnlrp")
    assert not torch.allclose(changed.scores[0, 2], fast.scores[0, 2])


def test_xlnet_rollout_reads_both_blocks():
    model, x = _xlnet(), _ids()
    e = _explain(model, x, method="rollout")
    assert tuple(e.scores.shape) == (2, 6) and len(e.blocks) == 2


def test_transposed_sliced_ids_score_each_input_position():
    model = TransposedIds().eval()
    ids = _ids(batch=2, length=5)["input_ids"]
    e = _explain(model, {"input_ids": ids}, method="input_x_gradient")
    emb = model.emb(ids).detach().requires_grad_(True)
    model.on_embeddings(emb)[:, 1].sum().backward()
    reference = (emb.grad * emb).sum(-1)
    assert torch.allclose(e.scores, reference, atol=1e-6)
    assert torch.all(e.scores[:, -1] == 0)  # the dropped position drives nothing
    lrp = _explain(model, {"input_ids": ids}, method="lrp", preset="attnlrp", fast_path=False)
    assert float(lrp.conservation.error.max()) < 1e-4


@pytest.mark.parametrize("layout_kept", [True, False])
def test_lookup_is_commuted_only_where_the_layout_changes(layout_kept):
    """A lookup of the ids in their own layout (a plain embedding) stays one node reading the input;
    a rearranged one reads the input after the rewrite, its rearrangement following it."""
    aten = torch.ops.aten

    class Plain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.head = torch.nn.Embedding(40, 8), torch.nn.Linear(8, 3)

        def forward(self, input_ids):
            return self.head(self.emb(input_ids.view(input_ids.shape[0], -1)).mean(1))

    model = (Plain() if layout_kept else TransposedIds()).eval()
    c = capture(model, {"input_ids": _ids(2, 5)["input_ids"]}, "input_ids")
    primary = next(n for n, kind, tgt in c.bindings if kind == "user")
    lookups = [n for n in c.graph.nodes if n.target is aten.embedding.default]
    assert len(lookups) == 1
    assert (lookups[0].args[1] is primary) == (not layout_kept)
    assert lookups[0] in c.analysis.sources
