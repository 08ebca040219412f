"""Complex arithmetic is the input's value, not a constant (:mod:`relprop.graph.complex_values`): a rotary
embedding computed in complex numbers is explained exactly as the same function written in real arithmetic,
by every method, and every attention block behind it is found; a complex op relprop cannot write in real
form is refused by name by the relevance walk while the gradient methods still run."""
from __future__ import annotations

import warnings

import pytest
import torch

import relprop


def rope_complex(x, freqs):
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * freqs).flatten(-2).type_as(x)


def rope_real(x, cos, sin):
    x2 = x.reshape(*x.shape[:-1], -1, 2)
    a, b = x2[..., 0], x2[..., 1]
    return torch.stack([a * cos - b * sin, a * sin + b * cos], -1).flatten(-2)


class Layer(torch.nn.Module):
    def __init__(self, d, heads, complex_rope, rope):
        super().__init__()
        self.heads, self.complex_rope, self.rope = heads, complex_rope, rope
        self.qkv, self.o, self.norm = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d), torch.nn.LayerNorm(d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm(x)).reshape(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        if self.rope:
            dh = d // self.heads
            angles = torch.arange(t).float()[:, None] / (10000 ** (torch.arange(0, dh, 2).float() / dh))[None]
            if self.complex_rope:
                freqs = torch.polar(torch.ones_like(angles), angles)
                q, k = rope_complex(q, freqs), rope_complex(k, freqs)
            else:
                q, k = rope_real(q, angles.cos(), angles.sin()), rope_real(k, angles.cos(), angles.sin())
        a = (q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5).softmax(-1)
        return x + self.o((a @ v).transpose(1, 2).reshape(b, t, d))


class RotaryNet(torch.nn.Module):
    """Two attention layers with rotary embeddings (``all_rotary``: both; else the second only)."""

    def __init__(self, complex_rope, all_rotary=True):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(50, 16)
        self.layers = torch.nn.ModuleList([Layer(16, 2, complex_rope, all_rotary), Layer(16, 2, complex_rope, True)])
        self.head = torch.nn.Linear(16, 3)

    def forward(self, input_ids):
        h = self.emb(input_ids)
        for layer in self.layers:
            h = layer(h)
        return self.head(h.mean(1))


def _explain(model, x, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return relprop.explain(model, x, target=1, **kw)


IDS = {"input_ids": torch.randint(5, 50, (2, 6), generator=torch.Generator().manual_seed(0))}
METHODS = [("rollout", {}), ("gradient_rollout", {}), ("input_x_gradient", {}), ("transformer_attribution", {}),
           ("lrp", {"preset": "attnlrp"}), ("lrp", {"preset": "cp_lrp"}),
           ("lrp", {"preset": "attnlrp", "fast_path": False})]


@pytest.mark.parametrize("all_rotary", [True, False])
@pytest.mark.parametrize("method, kw", METHODS)
def test_complex_rotary_explains_as_its_real_form(all_rotary, method, kw):
    complex_model, real_model = RotaryNet(True, all_rotary).eval(), RotaryNet(False, all_rotary).eval()
    real_model.load_state_dict(complex_model.state_dict())
    torch.testing.assert_close(complex_model(**IDS), real_model(**IDS))
    a, b = _explain(complex_model, IDS, method=method, **kw), _explain(real_model, IDS, method=method, **kw)
    assert len(a.blocks or []) == len(b.blocks or [])
    if method != "lrp":  # every attention block, the rotary ones included
        assert len(a.blocks) == 2
    scale = float(b.scores.abs().max())
    assert float((a.scores - b.scores).abs().max()) <= 1e-5 * scale + 1e-7
    if a.conservation is not None:
        assert float(a.conservation.error.max()) < 1e-4


def test_no_complex_value_is_left_in_the_walked_graph():
    from relprop.graph.capture import capture
    c = capture(RotaryNet(True).eval(), IDS, "input_ids")
    live = c.analysis.live
    assert not [n for n in live if getattr(n.meta.get("val"), "is_complex", lambda: False)()]
    assert len(c.analysis.blocks) == 2


class Magnitude(torch.nn.Module):
    """Reads the magnitude of a complex value (no real form in relprop's rewrite)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head = torch.nn.Embedding(50, 8), torch.nn.Linear(4, 3)

    def forward(self, input_ids):
        z = torch.view_as_complex(self.emb(input_ids).reshape(*input_ids.shape, 4, 2))
        return self.head((z * (1 + 2j)).abs().mean(1))


def test_a_complex_op_without_real_form_is_named_or_explained_by_gradients():
    model = Magnitude().eval()
    e = _explain(model, IDS, method="input_x_gradient")
    emb = model.emb(IDS["input_ids"]).detach().requires_grad_(True)
    z = torch.view_as_complex(emb.reshape(2, 6, 4, 2))
    model.head((z * (1 + 2j)).abs().mean(1))[:, 1].sum().backward()
    torch.testing.assert_close(e.scores, (emb.grad * emb).sum(-1))
    with pytest.raises(relprop.RelpropError, match=r"aten\.abs"):
        _explain(model, IDS, method="lrp", preset="attnlrp", fast_path=False)
