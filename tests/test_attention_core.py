"""The attention core of a block (relprop.graph.attention_core): found on BERT, LLaMA and GPT-2, its
values on chunks of query rows equal the rows of the whole evaluation (the core is row-local), and a
core that mixes query rows is refused with the op that does it."""
import pytest
import torch

import models
from relprop.engine.chunked_core import RowChunks, core_in_row_chunks
from relprop.engine.forward import forward
from relprop.graph.attention_core import evaluate_rows, find_core
from relprop.graph.capture import CACHE
from relprop.graph.inputs import bind_inputs

CASES = {
    "hf_bert_eager": lambda: (models.TEXT["hf_bert_eager"](), models.text_batch(lengths=(7, 5, 9))),
    "hf_llama_eager": lambda: (models.hf_llama("eager"), models.decoder_batch(lengths=(7, 5, 9))),
    "hf_llama_sdpa": lambda: (models.hf_llama("sdpa"), models.decoder_batch(lengths=(7, 5, 9))),
    "hf_gpt2_lm": lambda: (models.hf_gpt2_lm("sdpa"), models.decoder_batch(lengths=(7, 5, 9))),
}


def _captured(name):
    model, batch = CASES[name]()
    kwargs = bind_inputs(model, batch)
    if "use_cache" in model.forward.__code__.co_varnames:
        kwargs["use_cache"] = False
    return model, kwargs, CACHE.get(model, kwargs)


@pytest.mark.parametrize("name", sorted(CASES))
def test_core_in_row_chunks_equals_the_whole_core(name):
    model, kwargs, captured = _captured(name)
    a = captured.analysis
    with torch.no_grad():
        env, _ = forward(captured, model, kwargs)
    assert a.blocks
    for b in a.blocks:
        core, why = find_core(b, a.live)
        assert core is not None, why
        assert {b.scores, b.softmax, b.attention, b.product} <= set(core.nodes)
        assert b.scores.args[0] in core.rows and b.value in core.whole
        for chunk in (1, 2, core.queries):
            parts = [evaluate_rows(core, env.__getitem__, lo, min(lo + chunk, core.queries))
                     for lo in range(0, core.queries, chunk)]
            for node in (b.attention, b.product):
                whole = torch.cat([p[node] for p in parts], -2)
                assert whole.shape == env[node].shape
                torch.testing.assert_close(whole, env[node], rtol=1e-6, atol=1e-6)
            assert all(p[b.attention].shape[-2] <= chunk for p in parts)


class _QueryMixing(torch.nn.Module):
    """One attention block whose scores are centred over the query axis (rows mix)."""

    def __init__(self, d=8, vocab=20):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.q, self.k, self.v = (torch.nn.Linear(d, d) for _ in range(3))
        self.out = torch.nn.Linear(d, 3)

    def forward(self, input_ids):
        h = self.emb(input_ids)
        s = self.q(h) @ self.k(h).transpose(-1, -2)
        s = s - s.mean(dim=-2, keepdim=True)
        return self.out((s.softmax(-1) @ self.v(h))[:, 0])


def test_core_that_mixes_query_rows_is_refused_naming_the_op():
    torch.manual_seed(0)
    model = _QueryMixing().eval()
    kwargs = {"input_ids": torch.randint(0, 20, (2, 6))}
    captured = CACHE.get(model, kwargs)
    (b,) = captured.analysis.blocks
    core, why = find_core(b, captured.analysis.live)
    assert core is None
    assert "mean" in why or "sub" in why or "rows" in why, why


@pytest.mark.parametrize("name", ["hf_bert_eager", "hf_llama_eager", "hf_gpt2_lm"])
def test_core_in_row_chunks_has_the_gradients_of_the_whole_core(name):
    model, kwargs, captured = _captured(name)
    a = captured.analysis
    with torch.no_grad():
        env, _ = forward(captured, model, kwargs)
    g = torch.Generator().manual_seed(0)
    for b in a.blocks:
        core, why = find_core(b, a.live)
        assert core is not None, why
        nodes = core.rows + core.whole
        live = [n for n in nodes if env[n].is_floating_point() and n in a.live]
        assert b.scores.args[0] in live and b.value in live

        def leaves():
            return {n: env[n].detach().clone().requires_grad_(n in live) for n in nodes}

        ref_in = leaves()
        ref = evaluate_rows(core, ref_in.__getitem__, 0, core.queries)[b.product]
        seed = torch.randn(ref.shape, generator=g)
        ref_grads = torch.autograd.grad(ref, [ref_in[n] for n in live], seed)
        for chunk in (1, 3):
            ins = leaves()
            out = core_in_row_chunks(core, ins, RowChunks(rows=chunk))
            torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
            grads = torch.autograd.grad(out, [ins[n] for n in live], seed)
            for n, got, want in zip(live, grads, ref_grads):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"gradient at {n.name}")
