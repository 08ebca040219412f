"""The fast path's wide ε-rule linear (a language model's head) back-propagates only the rows its
gradient reaches (:func:`relprop.rules.stabilize.on_nonzero_rows`, ``_WideLinear``): the same
numbers as without the skip, to float rounding."""
import pytest
import torch
import transformers

import relprop
from relprop.rules import gradient_forms, stabilize


def test_on_nonzero_rows_equals_dense(monkeypatch):
    monkeypatch.setattr(stabilize, "SPARSE_ROW", 8)
    g = torch.zeros(2, 5, 16)
    g[0, 4] = torch.randn(16)
    g[1, 2, 3] = 1.5
    z = torch.randn(2, 5, 16)
    z[0, 4, 0] = 0.0

    def fn(g, z):
        return stabilize.safe_divide(g, z, 1e-3)
    assert torch.equal(stabilize.on_nonzero_rows(fn, g, z), fn(g, z))
    dense = torch.randn(2, 5, 16)  # every row nonzero: evaluated as a whole
    assert torch.equal(stabilize.on_nonzero_rows(fn, dense, z), fn(dense, z))


@pytest.mark.slow
def test_fast_path_llama_same_with_row_skip(monkeypatch):
    """lrp under attnlrp on a tiny LLaMA explained at its last position: the same with the row
    skips on (seed R/y and head, rows of 8+ logits) and off, and equal to the interpreter, to rounding."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16)
    model = transformers.LlamaForCausalLM(cfg).eval()
    ids = {"input_ids": torch.randint(3, 64, (2, 6)), "attention_mask": torch.ones(2, 6, dtype=torch.long)}
    target = relprop.targets.next_token(ids["attention_mask"], token=5)
    off = relprop.explain(model, ids, target=target, method="lrp", preset="attnlrp").input_relevance
    monkeypatch.setattr(stabilize, "SPARSE_ROW", 8)
    monkeypatch.setattr(gradient_forms, "SPARSE_ROW", 8)
    on = relprop.explain(model, ids, target=target, method="lrp", preset="attnlrp").input_relevance
    assert torch.allclose(on, off, rtol=1e-5, atol=1e-7 * float(off.abs().max()))  # row subsets: rounding
    ref = relprop.explain(model, ids, target=target, method="lrp", preset="attnlrp", fast_path=False).input_relevance
    assert torch.allclose(on, ref, rtol=1e-4, atol=1e-6 * float(ref.abs().max()))


def test_wide_linear_head_rows_skipped(monkeypatch):
    """The ε-rule linear of a wide head (≥ SPARSE_ROW outputs) runs as the row-skipping
    _WideLinear: its input gradient equals the dense ε-stabilized gradient, row by row, to rounding,
    and is exactly zero on the rows the gradient does not reach."""
    from relprop.rules import gradient_forms
    monkeypatch.setattr(gradient_forms, "SPARSE_ROW", 8)
    monkeypatch.setattr(stabilize, "SPARSE_ROW", 8)
    torch.manual_seed(1)
    x = torch.randn(2, 5, 4, requires_grad=True)
    w, b, eps = torch.randn(16, 4), torch.randn(16), 1e-2
    g = torch.zeros(2, 5, 16)
    g[:, -1] = torch.randn(2, 16)
    (wide,) = torch.autograd.grad(gradient_forms._WideLinear.apply(x, w, b, eps), x, g)
    z = torch.nn.functional.linear(x, w, b)
    (dense,) = torch.autograd.grad(gradient_forms.stabilize(z, eps), x, g)
    assert torch.allclose(wide, dense, rtol=1e-6, atol=1e-7)
    assert torch.equal(wide[:, :-1], torch.zeros(2, 4, 4))
    # the loop form of the ε-rule (AttnLRP Eq. 8) at the head: R_x = x ⊙ ((g z / (z + ε sign z)) W)
    ref = torch.zeros(2, 5, 4, dtype=torch.float64)
    for s in range(2):
        for i in range(4):
            for j in range(16):
                zz = float(z.detach()[s, -1, j])
                ref[s, -1, i] += float(g[s, -1, j]) * zz / (zz + eps * (1 if zz >= 0 else -1)) * float(w[j, i])
    assert torch.allclose(wide.double(), ref, rtol=1e-5, atol=1e-6)
