"""The fused attention core (relprop.graph.fused_attention) and the chunks of rows with an open key
(relprop.graph.key_bounds.rows_open): a core of the form softmax(Q·Kᵀ·s + M)·V is recognized, and the
fused kernel gives the node-by-node numbers where it is used (float64, so that the comparison is not
float32 rounding); where a row has no open key it is not used."""
import dataclasses

import pytest
import torch

import models
import relprop
from fused_cases import F64_MIN, aten, close as _close, cores as _cores, model as _model, \
    same as _same
from relprop.engine import RowChunks, chunked_core
from relprop.engine.chunked_walk import plan_cores
from relprop.graph.attention_core import evaluate_rows
from relprop.graph.capture import CACHE
from relprop.graph.fused_attention import sdpa_form, sdpa_rows
from relprop.graph.inputs import bind_inputs
from relprop.graph.key_bounds import additive_mask, key_bounds, rows_open


# ------------------------------------------------------------------ a. recognition

@pytest.mark.parametrize("name,double,scale", [
    ("llama_sdpa", False, 1.0), ("llama_sdpa", True, 1.0), ("llama_eager", False, 8 ** -0.5),
    ("llama_eager", True, None), ("gpt2_sdpa", False, 1.0), ("gpt2_eager", False, 8 ** -0.5),
    ("gpt2_eager", True, 8 ** -0.5), ("bert_eager", False, 8 ** -0.5), ("bert_sdpa", False, 1.0)])
def test_sdpa_form_recognizes_the_cores_of_the_tiny_models(name, double, scale):
    """Every core of the tiny models is softmax(Q·Kᵀ·s + M)·V with M the additive mask, except
    LLaMA eager in float64: its softmax runs in float32 (``softmax(..., dtype=torch.float32)``, then a
    cast back), which a fused float64 kernel would not reproduce, so the form is None (None is what
    ``scale`` says). An sdpa model's graph decomposes SDPA with Q and Kᵀ each scaled by √s before the
    product, outside the core: its form has s = 1; an eager model's has 1/√8 (head size 8). The
    sdpa cores hold the decomposed safe softmax's row test, the eager ones none."""
    cores = _cores(name, double)
    assert len(cores) == 2
    for core in cores:
        form = sdpa_form(core)
        print(name, double, [str(n.target) for n in core.nodes], form)
        assert sdpa_form(core) is form  # (memoized on the product node)
        if scale is None:
            assert form is None
            assert any(n.target is aten._to_copy.default for n in core.nodes)
            continue
        assert form is not None
        assert (form.q, form.kt, form.v) == (core.nodes[0].args[0], core.nodes[0].args[1], core.nodes[-1].args[1])
        assert form.mask is additive_mask(core) and form.mask is not None
        assert form.scale == pytest.approx(scale, rel=1e-12)
        assert any(n.target is aten.where.self for n in core.nodes) == name.endswith("sdpa")


# ------------------------------------------------------------------ b. sdpa_rows on random operands

B, H, N, D = 2, 4, 9, 8
CHUNKS = [(0, 3), (3, 6), (6, 9), (4, 5)]


def _causal(closed=F64_MIN):
    return torch.zeros(1, 1, N, N, dtype=torch.float64).masked_fill(torch.ones(N, N, dtype=torch.bool).triu(1), closed)


def _masks(kind):
    """The mask's values: causal (finfo.min or -inf), a finite ALiBi-like bias per head (every key
    open), padding broadcast over the query rows ([batch, 1, 1, keys]: keys 6: and 8: closed)."""
    i = torch.arange(N, dtype=torch.float64)
    return {"causal_min": lambda: _causal().expand(B, 1, N, N),
            "causal_inf": lambda: _causal(float("-inf")).expand(B, 1, N, N),
            "alibi": lambda: -torch.arange(1.0, H + 1, dtype=torch.float64).view(1, H, 1, 1) * (i.view(N, 1) - i).abs(),
            "padding": lambda: torch.zeros(B, 1, 1, N, dtype=torch.float64).masked_fill(
                i >= torch.tensor([6.0, 8.0], dtype=torch.float64).view(B, 1, 1, 1), F64_MIN)}[kind]()


def _operands(core, mask, seed=0):
    form = sdpa_form(core)
    g = torch.Generator().manual_seed(seed)
    q, kt, v = (torch.randn(*s, generator=g, dtype=torch.float64) for s in ((B, H, N, D), (B, H, D, N), (B, H, N, D)))
    return {form.q: q, form.kt: kt, form.v: v, form.mask: mask}


@pytest.mark.parametrize("kind", ["causal_min", "causal_inf", "alibi", "padding"])
@pytest.mark.parametrize("name", ["llama_sdpa", "gpt2_eager"])
def test_sdpa_rows_equal_the_node_by_node_chunk(name, kind):
    """sdpa_rows equals evaluate_rows' A·V on each chunk and its keys (those key_bounds keeps: cut on a
    causal mask, all on ALiBi, the last open one on padding). LLaMA sdpa's core has the safe softmax
    and s = 1, GPT-2 eager's none and s = 1/√8. The padding mask ([B, 1, 1, keys]) is read whole: the
    core is given with the mask moved from its split operands to its whole ones."""
    core = _cores(name)[0]
    mask = _masks(kind)
    form = sdpa_form(core)
    if kind == "padding":
        core = dataclasses.replace(core, rows=tuple(n for n in core.rows if n is not form.mask),
                                   whole=core.whole + (form.mask,))
    values = _operands(core, mask).__getitem__
    bounds = key_bounds(core, values, CHUNKS)
    expected = {"causal_min": [3, 6, 9, 5], "causal_inf": [3, 6, 9, 5], "alibi": [N] * 4, "padding": [8] * 4}
    assert bounds == expected[kind]
    assert rows_open(core, values, CHUNKS) == [True] * len(CHUNKS)
    for (lo, hi), kept in zip(CHUNKS, bounds):
        got = sdpa_rows(form, core, values, lo, hi, (kept, N))
        ref = evaluate_rows(core, values, lo, hi, keys=(kept, N))[core.nodes[-1]]
        assert got is not None and got.shape == ref.shape == (B, H, hi - lo, D)
        _close(got, ref, f"{name} {kind} rows {lo}:{hi}", 1e-12)


@pytest.mark.parametrize("name", ["llama_sdpa", "gpt2_eager"])
def test_a_chunk_with_a_fully_masked_row_is_evaluated_node_by_node(name, monkeypatch):
    """Row 4 of sample 1 has no open key: rows_open is False for the chunks that hold it only, and
    core_forward evaluates those node by node (sdpa_rows is not called on them), so its output equals
    the node-by-node evaluation: 0 on that row under LLaMA's decomposed safe softmax (where the fused
    kernel gives the mean of V, uniform weights)."""
    core = _cores(name)[0]
    mask = _causal().expand(B, 1, N, N).clone()
    mask[1, 0, 4, :] = F64_MIN
    values = _operands(core, mask).__getitem__
    assert rows_open(core, values, CHUNKS) == [True, False, True, False]
    fused = []
    spied = chunked_core.sdpa_rows
    monkeypatch.setattr(chunked_core, "sdpa_rows", lambda *a: fused.append(a[3:5]) or spied(*a))
    out = chunked_core.core_forward(core, values, RowChunks(rows=3), fused=True)
    assert fused == [(0, 3), (6, 9)]
    ref = evaluate_rows(core, values, 0, N)[core.nodes[-1]]
    _close(out, ref, name, 1e-12)
    if name == "llama_sdpa":
        assert bool((out[1, :, 4] == 0).all())
        kernel = sdpa_rows(sdpa_form(core), core, values, 3, 6, (N, N))
        assert float(kernel[1, :, 1].abs().max()) > 1e-3  # (what fusing that chunk would have given)


class _ScalarBias(torch.nn.Module):
    """A residual self-attention block whose scores get a Python number added before the softmax: the
    graph holds aten.add.Tensor(scores, 1.0) (a number, not an operand node)."""

    def __init__(self, d=8):
        super().__init__()
        self.qkv, self.o = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, 2, d // 2).permute(2, 0, 3, 1, 4)
        a = torch.softmax(q @ k.transpose(-1, -2) * 0.5 + 1.0, -1)
        return x + self.o((a @ v).transpose(1, 2).reshape(b, n, d))


class _First(torch.nn.Module):
    def forward(self, x):
        return x[:, 0]


def test_a_number_added_to_the_scores_is_not_a_mask_operand():
    """softmax(Q·Kᵀ·s + 1.0)·V: the number is no operand from outside the core. sdpa_form must not
    take it for the mask (a form whose mask is 1.0, not a node, sends core_forward's sdpa_rows to
    value(1.0): KeyError), and a folded run gives the numbers of the node-by-node forward pass."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), _ScalarBias(), _ScalarBias(), _First(),
                                torch.nn.Linear(8, 3)).eval().double()
    x = torch.randn(2, 9, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    runs = []
    for on in (False, True):
        tuning = relprop.Tuning(chunks=RowChunks(rows=3), fused_forward=on)
        runs.append(relprop.explain(model, x, method="transformer_attribution", keep_blocks=False, tuning=tuning))
    _same(runs[1], runs[0], "a number added to the scores")
    for core, _ in plan_cores(CACHE.get(model, bind_inputs(model, x)).analysis).values():
        form = sdpa_form(core)
        assert form is None or form.mask is None or isinstance(form.mask, torch.fx.Node), form


def test_sdpa_rows_refuses_operands_the_kernel_does_not_take():
    """A mask of another dtype than Q, a boolean mask, half-precision operands: None (node by node)."""
    core = _cores("llama_sdpa")[0]
    form = sdpa_form(core)
    ops = _operands(core, _causal().expand(B, 1, N, N))
    assert sdpa_rows(form, core, ops.__getitem__, 0, 3, (3, N)) is not None
    for change in ({form.mask: ops[form.mask].float()}, {form.mask: ops[form.mask] == 0},
                   {n: ops[n].half() for n in (form.q, form.kt, form.v)}):
        assert sdpa_rows(form, core, {**ops, **change}.__getitem__, 0, 3, (3, N)) is None


# ------------------------------------------------------------------ c. the fused forward pass

def _left_padded(lengths=(9, 8, 9)):
    batch = models.decoder_batch(lengths=lengths)
    ids, mask = batch["input_ids"].clone(), batch["attention_mask"].clone()
    for i, n in enumerate(lengths):  # each row's tokens moved to its end
        ids[i], mask[i] = torch.roll(ids[i], N - n), torch.roll(mask[i], N - n)
    return {"input_ids": ids, "attention_mask": mask}


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("padding", ["right", "left"])
def test_core_forward_fused_equals_node_by_node(padding, monkeypatch):
    """LLaMA sdpa (float64), chunks of 3 rows: each call of core_forward in the folded run gives the same
    A·V with the fused forward on and off (to 1e-12), and so does the whole explanation. With left
    padding sample 1's first row is a padding query with no open key: chunk 0:3 of every core is
    evaluated node by node, the others by the kernel; with right padding every chunk is fused."""
    model = _model("llama_sdpa")
    batch = _left_padded() if padding == "left" else models.decoder_batch(lengths=(7, 5, 9))
    forward, spied = chunked_core.core_forward, chunked_core.sdpa_rows
    fused, compared = [], []

    def both(core, value, chunks, compute=None, fused=False):
        ref = forward(core, value, chunks, compute, fused=False)
        got = forward(core, value, chunks, compute, fused=True)
        _close(got, ref, f"core {core.block}", 1e-12)
        compared.append(core.block)
        return got

    monkeypatch.setattr(chunked_core, "sdpa_rows", lambda *a: fused.append(a[3]) or spied(*a))
    monkeypatch.setattr(chunked_core, "core_forward", both)
    three = RowChunks(rows=3)
    relprop.explain(model, batch, method="transformer_attribution", keep_blocks=False,
                    tuning=relprop.Tuning(chunks=three))
    assert sorted(set(compared)) == [0, 1]
    assert sorted(set(fused)) == ([3, 6] if padding == "left" else [0, 3, 6])
    monkeypatch.setattr(chunked_core, "core_forward", forward)
    runs = []
    for on in (True, False):
        runs.append(relprop.explain(model, batch, method="transformer_attribution", keep_blocks=False,
                                    tuning=relprop.Tuning(chunks=three, fused_forward=on)))
    _same(*runs, f"{padding} padding")


# ------------------------------------------------------------------ d. the fused segment walk

