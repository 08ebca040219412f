"""Workarounds for torch kernels whose gradient is wrong (``relprop.graph.torch_fixes``).

Inference BatchNorm on CPU, batch of one, gradient strided as after ``flatten(2).transpose(1, 2)``: the
native backward is wrong; relprop's evaluation of the op must give a ⊙ g exactly, and a hybrid model
whose tokens are read that way must explain one image as it explains the same image in a batch.
"""
import torch

import relprop
from relprop.graph.torch_fixes import safe_target

aten = torch.ops.aten


def _bn_args(c=16):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(c, generator=g), torch.randn(c, generator=g), torch.randn(c, generator=g),
            torch.rand(c, generator=g) + 0.5)


def test_batch_norm_gradient_with_a_transposed_gradient_and_one_sample():
    w, b, mean, var = _bn_args()
    x = torch.randn(1, 16, 7, 7, requires_grad=True)
    grad = torch.randn(1, 49, 16).transpose(1, 2).view(1, 16, 7, 7)  # batch stride 16 < 16·49
    expected = grad * (w / torch.sqrt(var + 1e-5))[:, None, None]
    op = aten._native_batch_norm_legit_no_training.default
    y = safe_target(op)(x, w, b, mean, var, 0.1, 1e-5)[0]
    (got,) = torch.autograd.grad(y, x, grad)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(y, op(x, w, b, mean, var, 0.1, 1e-5)[0])


class _ConvBnTokens(torch.nn.Module):
    """A conv stem with BatchNorm whose output is read as tokens (flatten(2).transpose(1, 2))."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 16, 4, stride=4)
        self.norm = torch.nn.BatchNorm2d(16)
        self.head = torch.nn.Linear(16, 5)
        with torch.no_grad():
            self.norm.running_mean.normal_()
            self.norm.running_var.uniform_(0.5, 2.0)
            self.norm.weight.normal_()
            self.norm.bias.normal_()

    def forward(self, x):
        tokens = self.norm(self.conv(x)).flatten(2).transpose(1, 2)
        return self.head(torch.nn.functional.gelu(tokens).mean(1))


def test_one_image_explains_as_in_a_batch_through_batch_norm():
    torch.manual_seed(0)
    model = _ConvBnTokens().eval()
    x = torch.randn(2, 3, 28, 28)
    for fast_path in (True, False):
        both = relprop.explain(model, x, target=1, method="lrp", preset="attnlrp", fast_path=fast_path)
        alone = relprop.explain(model, x[:1], target=1, method="lrp", preset="attnlrp", fast_path=fast_path)
        scale = alone.input_relevance.abs().max()
        assert (both.input_relevance[:1] - alone.input_relevance).abs().max() <= 1e-5 * scale


def test_safe_softmax_substitute_is_bit_identical():
    """aten._safe_softmax as relprop evaluates it (one reduction to find all −inf rows, else the plain
    softmax) gives the kernel's values and gradient bit for bit, with and without such rows."""
    from relprop.graph.torch_fixes import safe_target
    aten = torch.ops.aten
    fast = safe_target(aten._safe_softmax.default)
    assert fast is not aten._safe_softmax.default
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 5, 6, generator=g)
    dead = x.clone()
    dead[0, 1, 2, :] = float("-inf")
    dead[1, 0, :, 3] = float("-inf")
    for t in (x, dead, x.double(), torch.empty(0, 3, 5, 6)):
        for dtype in (None, torch.float64):
            a, b = t.clone().requires_grad_(), t.clone().requires_grad_()
            ya, yb = aten._safe_softmax.default(a, -1, dtype), fast(b, -1, dtype)
            assert torch.equal(ya, yb) and ya.dtype == yb.dtype
            if t.numel():
                seed = torch.randn(ya.shape, generator=g, dtype=ya.dtype)
                ga, = torch.autograd.grad(ya, a, seed)
                gb, = torch.autograd.grad(yb, b, seed)
                assert torch.equal(ga, gb)
    assert not torch.isnan(fast(dead, -1)).any()


def test_deferred_row_test_gives_the_booleans_of_any_not_eq():
    """``any(logical_not(eq(x, c)), dim)`` deferred (PendingEqual, any_pending): the same booleans as
    the explicit ops for c = -inf, +inf and a finite c, with rows entirely c, NaN and mixed rows."""
    from relprop.graph.torch_fixes import any_pending, pending_eq, pending_not
    inf, nan = float("inf"), float("nan")
    for c in (-inf, inf, 0.0, -3.5):
        rows = torch.tensor([[c, c, c], [c, nan, c], [c, 1.0, c], [nan, nan, nan], [-inf, inf, c], [2.0, -1.0, 0.0]])
        x = torch.cat([rows, rows.flip(-1)])[None].expand(2, -1, -1)
        for dim, keep in ((-1, False), (2, True), (1, False)):
            want = aten.any.dim(aten.logical_not.default(aten.eq.Scalar(x, c)), dim, keep)
            got = any_pending(pending_not(pending_eq(x, c)), dim, keep)
            assert torch.equal(got, want), (c, dim, keep)
        # every row's first element differs from c (a causal mask's open first key; NaN; -0 against
        # +0 is equal): answered from the first elements, the same booleans
        for first in ((1.0, nan, -2.0), (-0.0, 1.0, 1.0), (nan, nan, nan)):
            x = torch.full((2, 3, 4), c)
            x[..., 0] = torch.tensor(first)
            x[1, 2, 3] = 5.0
            for dim, keep in ((-1, False), (2, True)):
                want = aten.any.dim(aten.logical_not.default(aten.eq.Scalar(x, c)), dim, keep)
                got = any_pending(pending_not(pending_eq(x, c)), dim, keep)
                assert torch.equal(got, want) and got.shape == want.shape, (c, first, dim, keep)
