"""The node-by-node decomposition (relprop.graph.node_decompose) makes the graph torch's whole-program
``run_decompositions`` makes, op for op, and steps aside where it does not apply.

The reference is torch's own pass on the same export with the same table; the comparison is of the
graph relprop walks (the specialization at the inputs' sizes), node targets in order, ``sym_size``
reads left out (each piece reads the sizes it needs, the whole pass may read one elsewhere; a
specialization replaces them by integers)."""
import pytest
import torch

import relprop
from relprop.graph.capture import CACHE, CaptureCache
from relprop.graph.export import decomposition_table
from relprop.graph.inputs import bind_inputs, primary_input
from relprop.graph.node_decompose import decompose_nodes

from tests import models
from tests.golden import generate


def _ops(graph) -> list:
    return [str(n.target) for n in graph.nodes
            if n.op == "call_function" and n.target is not torch.ops.aten.sym_size.int]


def _walked_graphs(model, kwargs, primary):
    """The specialized graph of ``model`` on ``kwargs`` captured with each decomposition pass, and the
    capture events (which pass ran)."""
    out = {}
    for how in ("nodes", "whole"):
        events = []
        captured = CaptureCache(disk=False, decompose=how).get(model, kwargs, primary, events)
        out[how] = (captured, events[0])
    return out


def _compare(case):
    name, make, inputs, kw = case
    model = make()
    kwargs = bind_inputs(model, inputs(model))  # as explain() binds them (e.g. use_cache=False)
    got = _walked_graphs(model, kwargs, primary_input(kwargs, kw.get("wrt")))
    nodes, whole = got["nodes"], got["whole"]
    if name in WHOLE_PASS:  # the node pass stepped aside: torch's pass ran for both
        assert "decompose (whole program)" in nodes[1].seconds, nodes[1].seconds
    else:
        assert "decompose" in nodes[1].seconds, nodes[1].seconds  # the node pass took the program
    assert "decompose (whole program)" in whole[1].seconds
    assert _ops(nodes[0].graph) == _ops(whole[0].graph), case[0]
    assert nodes[0].program.dynamic_axes() == whole[0].program.dynamic_axes()
    assert [b.name for b in nodes[0].analysis.blocks] == [b.name for b in whole[0].analysis.blocks]


FAST = ("hf_bert", "timm_vit_tiny", "hf_llama")
#: zoo models the node pass leaves to torch's pass: HF Swin pools with adaptive_avg_pool1d, whose
#: decomposition restrides in place (as_strided_), which only a functionalized whole-program trace removes
WHOLE_PASS = ("hf_swin", "hf_swin_padded")


@pytest.mark.parametrize("case", [c for c in generate.cases() if c[0] in FAST], ids=lambda c: c[0])
def test_the_graph_relprop_walks_is_the_whole_pass_graph(case):
    _compare(case)


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in generate.cases() if c[0] not in FAST], ids=lambda c: c[0])
def test_the_zoo_graphs_are_the_whole_pass_graphs(case):
    _compare(case)


def _export(fn_module, *args):
    with torch.no_grad():
        return torch.export.export(fn_module, args, strict=False)


class Pieces(torch.nn.Module):
    """Calls the pass rewrites in different ways: a reshape of a transposed view (a clone and a view),
    fused attention (math attention, its probabilities a node), an op of several outputs (unbind), a
    transpose (a permute), an op the table keeps (linear)."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 24)

    def forward(self, x):
        q, k, v = self.proj(x).reshape(x.shape[0], x.shape[1], 3, 2, 4).permute(2, 0, 3, 1, 4).unbind(0)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return a.transpose(1, 2).reshape(x.shape[0], x.shape[1], 8)


@pytest.mark.parametrize("dynamic", [False, True])
def test_each_rewrite_matches_the_whole_pass_and_computes_the_same(dynamic):
    torch.manual_seed(0)
    m = Pieces().eval()
    x = torch.randn(2, 5, 8)
    shapes = {"x": {0: torch.export.Dim("b"), 1: torch.export.Dim.AUTO}} if dynamic else None
    with torch.no_grad():
        ep = torch.export.export(m, (x,), strict=False, dynamic_shapes=shapes)
        ref = ep.run_decompositions(decomposition_table())
        ep = torch.export.export(m, (x,), strict=False, dynamic_shapes=shapes)
        assert decompose_nodes(ep, decomposition_table())
    assert _ops(ep.graph) == _ops(ref.graph)
    assert "aten.softmax.int" in _ops(ep.graph) or "aten._softmax.default" in _ops(ep.graph)
    y = torch.randn(3, 7, 8) if dynamic else x
    torch.testing.assert_close(ep.module()(y), m(y), rtol=0, atol=1e-6)


class Counting(torch.nn.Module):
    """Writes a buffer in its forward (a mutation the node pass does not take)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls.add_(1)
        return self.lin(x).transpose(0, 1)


def test_a_mutating_program_is_left_untouched_for_the_whole_pass():
    ep = _export(Counting().eval(), torch.randn(3, 4))
    before = _ops(ep.graph)
    assert not decompose_nodes(ep, decomposition_table())
    assert _ops(ep.graph) == before  # nothing half-rewritten
    cache = CaptureCache(disk=False)
    events = []
    cache.get(Counting().eval(), {"x": torch.randn(3, 4)}, "x", events)
    assert "decompose (whole program)" in events[0].seconds


def test_tiny_bert_explains_the_same_through_either_pass():
    model = models.hf_bert()
    batch = models.text_batch()
    a = relprop.explain(model, batch, target=0)
    relprop.clear_cache(model)
    saved = CACHE.decompose
    CACHE.decompose = "whole"
    try:
        b = relprop.explain(model, batch, target=0)
    finally:
        CACHE.decompose = saved
        relprop.clear_cache(model)
    torch.testing.assert_close(a.scores, b.scores, rtol=0, atol=0)
