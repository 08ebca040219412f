"""Selective state-space layers (Mamba, Jamba) explained as MambaLRP defines it (Jafari, Montavon,
Müller & Eberle, NeurIPS 2024; ``relprop.graph.selective_scan``).

The reference is MambaLRP written out from the paper, as gradient × input of a Mamba forward pass
whose three non-conservative parts are changed the way its authors' code changes them: the SiLU
activations get the identity rule (``x · (silu(x) / x).detach()``), the selection parameters Ā, B̄
and C of the scan are constants (``.detach()``), and the gate product ``y ⊙ silu(z)`` the half
rule (``y/2 + (y/2).detach()``); RMSNorm's statistic is a constant. Everything else keeps its
gradient, i.e. the ε-rule (the linear layers, the causal convolution, the D skip, the residuals).
It is computed on the tiny HF ``MambaForCausalLM`` by replacing each mixer's and norm's
``forward`` on the instances (put back afterwards) and seeding the target logit's value.

``explain(method="lrp", preset="attnlrp")`` equals it (fast path and rule-by-rule walk), conserves
relevance (the zero initial state of the scan, held constant, absorbs nothing), and the finder of
selection parameters marks exactly the scan's products.
"""
import types

import pytest
import torch
import torch.nn.functional as F

import llm_models
import relprop
from relprop.api import prepare
from relprop.graph.selective_scan import selection_parameters

aten = torch.ops.aten


def _identity_silu(x):
    """SiLU with the identity rule: forward silu(x), gradient silu(x) / x."""
    y = F.silu(x)
    return x * (y / torch.where(x == 0, torch.ones_like(x), x)).detach()


def _half(y):
    """The half rule on a product's output: forward y, gradient / 2."""
    return y / 2 + (y / 2).detach()


def mambalrp_mixer(self, hidden_states, cache=None, attention_mask=None, **kwargs):
    """MambaLRP's mixer (NeurIPS 2024, §4), written from the paper's equations."""
    n = hidden_states.shape[1]
    projected = self.in_proj(hidden_states).transpose(1, 2)
    x, z = projected.chunk(2, dim=1)
    x = _identity_silu(self.conv1d(x)[..., :n])                                   # [b, d, n]
    params = self.x_proj(x.transpose(1, 2))
    dt, B, C = torch.split(params, [self.time_step_rank, self.ssm_state_size, self.ssm_state_size], dim=-1)
    dt = F.softplus(self.dt_proj(dt)).transpose(1, 2)                              # [b, d, n]
    A = -torch.exp(self.A_log.float())                                            # [d, s]
    a_bar = torch.exp(A[None, :, None, :] * dt[..., None]).detach()               # [b, d, n, s]
    b_bar = (dt[..., None] * B[:, None, :, :]).detach()                           # [b, d, n, s]
    C = C.detach()                                                                # [b, n, s]
    h = torch.zeros(x.shape[0], x.shape[1], A.shape[1])
    ys = []
    for t in range(n):
        h = a_bar[:, :, t] * h + b_bar[:, :, t] * x[:, :, t, None]
        ys.append((h * C[:, None, t, :]).sum(-1))
    y = torch.stack(ys, -1) + x * self.D[None, :, None]
    y = _half(y * _identity_silu(z))
    return self.out_proj(y.transpose(1, 2))


def rmsnorm_constant_rms(self, hidden_states):
    rms = torch.rsqrt(hidden_states.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return self.weight * (hidden_states * rms.detach())


def mambalrp(model, x):
    """Per sample and position, MambaLRP's relevance of the predicted next token's logit."""
    patched = []
    for m in model.modules():
        name = type(m).__name__
        if name == "MambaMixer":
            m.forward = types.MethodType(mambalrp_mixer, m)
        elif name == "MambaRMSNorm":
            m.forward = types.MethodType(rmsnorm_constant_rms, m)
        else:
            continue
        patched.append(m)
    try:
        emb = model.get_input_embeddings()(x["input_ids"]).detach().requires_grad_(True)
        logits = model(inputs_embeds=emb, use_cache=False).logits[:, -1]
        score = logits.gather(1, logits.argmax(-1, keepdim=True)).squeeze(1)
        (g,) = torch.autograd.grad(score.sum(), emb)
        return (emb * g).sum(-1).detach(), score.detach()
    finally:
        for m in patched:
            del m.forward


@pytest.fixture(scope="module")
def mamba():
    return llm_models.build("mamba")


@pytest.mark.slow
@pytest.mark.parametrize("fast_path", [True, False], ids=["fast_path", "interpreter"])
def test_attnlrp_on_mamba_is_mambalrp(mamba, fast_path, capsys):
    x = llm_models.batch()
    ref, score = mambalrp(mamba, x)
    e = relprop.explain(mamba, x, target="next_token", method="lrp", preset="attnlrp", fast_path=fast_path)
    torch.testing.assert_close(e.target_scores, score)
    rel = float((e.scores - ref).abs().max() / ref.abs().max())
    with capsys.disabled():
        print(f"\nMamba, lrp@attnlrp ({'fast path' if fast_path else 'interpreter'}) vs MambaLRP: "
              f"max |diff| / max |R| {rel:.2e}")
    assert rel < 1e-4
    if not fast_path:
        c = e.conservation
        torch.testing.assert_close(c.injected, score)
        assert float(c.error.max()) < 1e-4, c


@pytest.mark.slow
def test_selection_parameters_are_the_scans_products(mamba):
    """Per mixer and step t of the unrolled scan: Ā_t ⊙ h_{t−1}, C_t h_t and the state's first
    update; once per mixer: B̄ ⊙ x. Nothing else is held constant."""
    captured = prepare(mamba, llm_models.batch(), None).captured
    held = selection_parameters(captured.graph, captured.analysis.live)
    steps, layers = 7, 2
    kinds = {}
    for node in held:
        kinds[node.target] = kinds.get(node.target, 0) + 1
    assert kinds[aten.matmul.default] == steps * layers  # C_t h_t
    assert kinds[aten.mul.Tensor] == (steps - 1) * layers + layers  # Ā_t ⊙ h_{t−1} (t ≥ 1), B̄ ⊙ x
    assert kinds[aten.add.Tensor] == layers  # the first state: Ā_0 ⊙ 0 + B̄_0 x_0
    assert set(kinds) == {aten.matmul.default, aten.mul.Tensor, aten.add.Tensor}


@pytest.mark.slow
def test_no_selective_scan_no_constants():
    """A transformer has no selective scan: nothing is held constant."""
    model = llm_models.build("llama")
    captured = prepare(model, llm_models.batch(), None).captured
    assert selection_parameters(captured.graph, captured.analysis.live) == {}


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["attnlrp", "cp_lrp"])
def test_jamba_conserves(preset):
    """Jamba: Mamba mixers, attention and MoE layers in one model."""
    model = llm_models.build("jamba")
    x = llm_models.batch()
    walk = relprop.explain(model, x, target="next_token", method="lrp", preset=preset, fast_path=False)
    fast = relprop.explain(model, x, target="next_token", method="lrp", preset=preset)
    assert float(walk.conservation.error.max()) < 1e-4, walk.conservation
    assert float((fast.scores - walk.scores).abs().max()) < 1e-5 * float(walk.scores.abs().max())
