"""Relevance rules written as modified gradients, for the one-backward fast path.

Arras et al. (2025, "Close Look at Decomposition-based XAI-Methods for Transformer Language
Models", the "Input × Gradient framework" of AttnLRP's library) observe that a chain of ε-rules is a
chain of Jacobian-vector products: if every tensor t carries the relevance R_t = t ⊙ g_t, then the
ε-rule of a linear map z = W x + b, R_x = x ⊙ Wᵀ (R_z / z), is x ⊙ Wᵀ g_z: the ordinary gradient.
Only the ops whose rule is *not* their gradient need a modified backward.

The stabilizer ε of the ε-rule, R_x = x ⊙ Wᵀ (R_z / (z + ε·sign z)), is not in the gradient: the
interpreter applies it at every ε-rule node, so the fast path does too
(:func:`epsilon_stabilized`): the gradient reaching the node's output is multiplied by
z / (z + ε·sign z), which turns x ⊙ Wᵀ g_z (g_z = R_z / z) into the interpreter's
x ⊙ Wᵀ (R_z / (z + ε·sign z)), and the seed at the model's outputs is the exact R / y. The identity
rule's ratio f(x) / x is exact as well (no ε: the interpreter's R_x = R_y has none). Fast path and
interpreter then agree to float rounding for every ε.

==========================  ====================================================================
gradient form               backward (g: incoming gradient)
==========================  ====================================================================
:func:`identity_rule`       g · f(x) / x: the identity rule R_x = R_y (AttnLRP Eq. 9)
:func:`function_identity`   the same for a function written out op by op (its input and output)
:func:`epsilon_stabilized`  g · z / (z + ε·sign z) at the output z of an ε-rule node (Eq. 8's ε)
:func:`uniform_product`     g / 2 to both factors: the uniform rule (AttnLRP Eq. 7, Props. 3.2-3.3)
:func:`constant_operand`    no gradient into one operand: it is a constant of the linearization
                            (a normalizing statistic, AttnLRP Prop. 3.4; CP-LRP's attention)
:func:`layer_norm_const_std` LayerNorm with the standard deviation held constant (AttnLRP Prop. 3.4)
:func:`group_norm_const_std` GroupNorm with each group's standard deviation held constant (same)
:func:`rms_norm_const_rms`  RMSNorm with the root mean square held constant (AttnLRP Prop. 3.4)
==========================  ====================================================================

A rule declares its form where it is registered, ``@rule(op, preset=..., gradient_form=form)``
(stored in its :class:`relprop.rules.spec.RuleSpec`); the form is a
:class:`relprop.rules.spec.GradientForm`, whose ``replace(node, live, eps) -> callable | None``
returns a replacement for ``node.target`` (same arguments, same forward value) or None when the
plain op (its ordinary gradient) *is* the rule.
:mod:`relprop.engine.fast_path` executes a captured graph with these replacements, and one
``torch.autograd.grad`` then gives relevance = input × gradient. Rules without a declared form make
the fast path unavailable; the rule-by-rule walk (:mod:`relprop.engine.walk`) stays the reference.
A form of an ε-rule also declares ``lost(node, args, out, relevance, eps)`` (a field of the
form), the relevance its stabilizer keeps, which the walk books as absorbed.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Callable, Optional

import torch
from torch.autograd import Function

from ..graph.host_reads import scope
from ..graph.torch_fixes import safe_target
from .spec import GradientForm, RuleSpec, as_form, as_spec
from .stabilize import SPARSE_ROW, on_nonzero_rows, safe_divide

def gradient_form(form: GradientForm):
    """Decorator, under ``@rule``: the rule as a :class:`RuleSpec` declaring the modified-gradient
    ``form``; the same as ``@rule(op, preset=..., gradient_form=form)``, which the built-in rules
    use."""
    def attach(fn) -> RuleSpec:
        return as_spec(fn, gradient_form=form)
    return attach


@GradientForm
def plain(node, live, eps):
    """The op's own gradient is the rule (ε-rule on linear maps, sums, routing; AttnLRP Eq. 8)."""
    return None


# ------------------------------------------------------------------------------------------------
# autograd functions
# ------------------------------------------------------------------------------------------------
class _IdentityRule(Function):
    """y = f(x) forward; backward g · f(x) / x (exact; 0 where x = 0), so that x ⊙ ĝ_x = y ⊙ g_y = R_y."""

    @staticmethod
    def forward(ctx, x, fn, eps):
        y = fn(x)
        ctx.save_for_backward(safe_divide(y, x, 0.0))
        return y

    @staticmethod
    def backward(ctx, g):
        (ratio,) = ctx.saved_tensors
        return g * ratio, None, None


def _stabilizer(z: torch.Tensor, eps: float, scale: float = 1) -> torch.Tensor:
    """The ε-rule's factor s z / (s z + ε·sign z) = |s z| / (|s z| + ε) on a gradient (fewer passes
    over the tensor than safe_divide(z, z, ε)); 0/0 (z = 0 with ε = 0) and inf/inf (z not finite)
    are NaN, set to 0 as safe_divide does."""
    den = (z * scale).abs_() if scale != 1 else z.abs()
    return torch.nan_to_num_(den.div_(den + eps), nan=0.0)


class _FunctionIdentity(Function):
    """``y``, the output of an element-wise function of ``x`` computed op by op, as the output of
    the function; backward g · y / x to ``x`` (0 where x = 0), nothing to ``y``: the identity rule
    of the whole function (:func:`function_identity`)."""

    @staticmethod
    def forward(ctx, x, y):
        ctx.save_for_backward(safe_divide(y, x, 0.0))
        return y.view_as(y)

    @staticmethod
    def backward(ctx, g):
        (ratio,) = ctx.saved_tensors
        return g * ratio, None


class _Stabilize(Function):
    """Identity forward; backward g · s z / (s z + ε·sign z) (0 where z = 0 or is not finite): the
    ε-rule's stabilizer on the denominator s·z of a node with output z (s = 1 but for a mean, whose
    ε-rule divides by the sum n·z)."""

    @staticmethod
    def forward(ctx, z, eps, scale):
        ctx.save_for_backward(z)
        ctx.eps, ctx.scale = eps, scale
        return z.view_as(z)

    @staticmethod
    def backward(ctx, g):
        (z,) = ctx.saved_tensors
        return g * _stabilizer(z, ctx.eps, ctx.scale), None, None


#: the rows of a run's output the target reads (``Target.rows``), for :class:`_WideLinear`'s backward,
#: which autograd may run on a thread of its own: set around a run's forward pass (:func:`rows_read`)
_ROWS: contextvars.ContextVar = contextvars.ContextVar("relprop_rows_read", default=None)


@contextlib.contextmanager
def rows_read(rows: Optional[int]):
    """Within this context the forward pass of the fast path knows that the target reads at most
    ``rows`` rows of the model's output (None: not known)."""
    token = _ROWS.set(rows)
    try:
        yield
    finally:
        _ROWS.reset(token)


class _WideLinear(Function):
    """``linear(x, W, b)`` forward, W and b constant; backward the ε-stabilized gradient to x,
    (g · z / (z + ε·sign z)) W, on the rows where g is nonzero (see
    :func:`relprop.rules.stabilize.on_nonzero_rows`): a language model's head explained at one
    position multiplies one row per sample by W instead of every position's. The bound on those rows
    and the call's host reads are taken in the forward pass (the backward may run on another thread)."""

    @staticmethod
    def forward(ctx, x, w, b, eps):
        z = torch.ops.aten.linear.default(x, w, b)
        ctx.save_for_backward(w, z)
        ctx.eps, ctx.rows, ctx.reads = eps, _ROWS.get(), scope()
        return z

    @staticmethod
    def backward(ctx, g):
        w, z = ctx.saved_tensors
        eps = ctx.eps

        def input_gradient(g, z):
            return (g * _stabilizer(z, eps)) @ w
        gx = on_nonzero_rows(input_gradient, g, z, bound=ctx.rows, reads=ctx.reads) \
            if ctx.needs_input_grad[0] else None
        return gx, None, None, None


class _HalfGradient(Function):
    """Identity forward; backward g / 2 (placed on a product's output, it halves the gradient of
    both factors: the uniform rule)."""

    @staticmethod
    def forward(ctx, z):
        return z.view_as(z)

    @staticmethod
    def backward(ctx, g):
        return g * 0.5


class _LayerNormConstStd(Function):
    """``layer_norm`` forward; backward as if the standard deviation were a constant:
    ∂y_j/∂x_i = γ_j / σ · (δ_ij − 1/N) over the normalized dimensions."""

    @staticmethod
    def forward(ctx, x, normalized_shape, weight, bias, eps):
        y, _, rstd = torch.ops.aten.native_layer_norm.default(x, normalized_shape, weight, bias, eps)
        ctx.save_for_backward(rstd, weight)
        ctx.dims = tuple(range(x.dim() - len(normalized_shape), x.dim()))
        return y

    @staticmethod
    def backward(ctx, g):
        rstd, weight = ctx.saved_tensors
        u = g * weight if weight is not None else g
        gx = (u - u.mean(ctx.dims, keepdim=True)) * rstd
        return gx, None, None, None, None


class _GroupNormConstStd(Function):
    """``native_group_norm`` forward; backward as if each group's standard deviation were a
    constant: ∂y_j/∂x_i = γ_j / σ_g · (δ_ij − 1/N_g) within a group g of N_g elements."""

    @staticmethod
    def forward(ctx, x, weight, bias, n, c, hw, groups, eps):
        y, mean, rstd = torch.ops.aten.native_group_norm.default(x, weight, bias, n, c, hw, groups, eps)
        ctx.save_for_backward(rstd, weight)
        ctx.groups = groups
        ctx.mark_non_differentiable(mean, rstd)
        return y, mean, rstd

    @staticmethod
    def backward(ctx, g, _g_mean=None, _g_rstd=None):
        rstd, weight = ctx.saved_tensors
        shape = g.shape
        u = g * weight.reshape((1, -1) + (1,) * (g.dim() - 2)) if weight is not None else g
        u = u.reshape(shape[0], ctx.groups, -1)
        gx = (u - u.mean(-1, keepdim=True)) * rstd.reshape(shape[0], ctx.groups, 1)
        return gx.reshape(shape), None, None, None, None, None, None, None


class _RMSNormConstRMS(Function):
    """``rms_norm`` forward; backward as if the root mean square were a constant: γ g / rms."""

    @staticmethod
    def forward(ctx, x, normalized_shape, weight, eps):
        y = torch.ops.aten.rms_norm.default(x, normalized_shape, weight, eps)
        dims = tuple(range(x.dim() - len(normalized_shape), x.dim()))
        e = eps if eps is not None else torch.finfo(x.dtype).eps
        rrms = torch.rsqrt(x.pow(2).mean(dims, keepdim=True) + e)
        ctx.save_for_backward(rrms, weight)
        return y

    @staticmethod
    def backward(ctx, g):
        rrms, weight = ctx.saved_tensors
        gx = g * rrms
        if weight is not None:
            gx = gx * weight
        return gx, None, None, None


# ------------------------------------------------------------------------------------------------
# forms
# ------------------------------------------------------------------------------------------------
@GradientForm
def identity_rule(node, live, eps):
    """Element-wise non-linearity with the identity rule (AttnLRP Eq. 9): backward g · f(x)/x."""
    op = safe_target(node.target)

    def call(x, *args, **kwargs):
        return _IdentityRule.apply(x, lambda t: op(t, *args, **kwargs), eps)
    return call


@GradientForm
def function_identity(node, live, eps):
    """An element-wise function of one tensor written out op by op (a region of
    :mod:`relprop.graph.elementwise`) with the identity rule (AttnLRP Eq. 9). Unlike the forms of
    single ops, its replacement is called as ``call(x, y)`` with the function's input ``x`` and
    its output ``y`` computed by the graph, and returns ``y`` with backward g · y / x to ``x``."""
    def call(x, y):
        return _FunctionIdentity.apply(x, y.detach())
    return call


def stabilize(z: torch.Tensor, eps: float, scale: float = 1) -> torch.Tensor:
    """``z`` unchanged, its gradient multiplied by s z / (s z + ε·sign z) (see :class:`_Stabilize`)."""
    return _Stabilize.apply(z, eps, scale)


def epsilon_stabilized(form: Callable = plain, scale: Optional[Callable] = None) -> GradientForm:
    """A form factory for the ε-rule nodes: ``form``'s replacement (the plain op where it gives
    None) with the ε-rule's stabilizer on the output's gradient, so that the modified gradient
    equals the interpreter's R / (z + ε·sign z) (module docstring). ``scale(node, args, z)`` gives s when
    the rule's denominator is s·z (a mean: the sum of the pooled elements, s = n)."""
    def stabilized(node, live, eps):
        op = form(node, live, eps) or safe_target(node.target)

        def call(*args, **kwargs):
            z = op(*args, **kwargs)
            if isinstance(z, (tuple, list)):  # (y, statistics...) or (y, indices): y carries the relevance
                return type(z)([stabilize(t, eps) if i == 0 else t for i, t in enumerate(z)])
            return stabilize(z, eps, scale(node, args, z) if scale is not None else 1)
        return call

    def lost(node, args, out, relevance, eps):
        """The relevance the ε-rule's stabilizer keeps from the node's inputs: R ⊙ ε / (|s z| + ε)
        per output element (all of R where s z = 0), the amount a conservation ledger books as
        absorbed by the stabilizer (Σ of the shares of every operand is Σ R ⊙ |s z| / (|s z| + ε))."""
        z = out[0] if isinstance(out, (tuple, list)) else out
        r = relevance[0] if isinstance(relevance, (tuple, list)) else relevance
        if not torch.is_tensor(z) or not torch.is_tensor(r):
            return None
        den = (z * scale(node, args, z)).abs() if scale is not None else z.abs()
        kept = torch.nan_to_num(den / (den + eps), nan=0.0)
        return r * (1 - kept)
    return GradientForm(stabilized, lost=lost, inner=as_form(form))


def _epsilon_linear(node, live, eps):
    """``aten.linear`` under the ε-rule (AttnLRP Eq. 8): :func:`epsilon_stabilized`'s replacement,
    except that a layer with at least :data:`relprop.rules.stabilize.SPARSE_ROW` outputs and a
    constant weight and bias (a language model's head) runs as :class:`_WideLinear`, whose
    backward skips the rows its gradient does not reach (same relevance to float rounding)."""
    dense = _EPSILON_PLAIN(node, live, eps)
    if any(live[1:3]):
        return dense

    def call(x, w, b=None):
        if w.dim() != 2 or w.shape[0] < SPARSE_ROW:
            return dense(x, w, b)
        return _WideLinear.apply(x, w.detach(), b.detach() if torch.is_tensor(b) else b, eps)
    return call


@GradientForm
def uniform_product(node, live, eps):
    """Product of two live factors with the uniform rule (AttnLRP Eq. 7, Props. 3.2–3.3): the
    gradient of both factors halved."""
    op = safe_target(node.target)

    def call(*args, **kwargs):
        return _HalfGradient.apply(op(*args, **kwargs))
    return call


def half_gradient(z: torch.Tensor) -> torch.Tensor:
    """``z`` unchanged, its gradient halved (the uniform rule placed on a product's output)."""
    return _HalfGradient.apply(z)


def constant_operand(position: int):
    """A form factory: argument ``position`` is held constant (detached) for the relevance."""
    def form(node, live, eps):
        op = safe_target(node.target)

        def call(*args, **kwargs):
            if torch.is_tensor(args[position]):
                args = list(args)
                args[position] = args[position].detach()
            return op(*args, **kwargs)
        return call
    return GradientForm(form)


@GradientForm
def layer_norm_const_std(node, live, stabilizer):
    """``aten.layer_norm`` with a constant standard deviation (AttnLRP Prop. 3.4)."""
    def call(input, normalized_shape, weight=None, bias=None, eps=1e-5, cudnn_enable=True):
        return _LayerNormConstStd.apply(input, list(normalized_shape), weight, bias, eps)
    return call


@GradientForm
def group_norm_const_std(node, live, stabilizer):
    """``aten.native_group_norm`` with constant standard deviations (AttnLRP Prop. 3.4); returns
    (y, mean, rstd) like the op, the statistics without gradient."""
    def call(input, weight, bias, n, c, hw, groups, eps):
        return _GroupNormConstStd.apply(input, weight, bias, n, c, hw, groups, eps)
    return call


@GradientForm
def rms_norm_const_rms(node, live, stabilizer):
    """``aten.rms_norm`` with a constant root mean square (AttnLRP Prop. 3.4)."""
    def call(input, normalized_shape, weight=None, eps=None):
        return _RMSNormConstRMS.apply(input, list(normalized_shape), weight, eps)
    return call


_EPSILON_PLAIN = epsilon_stabilized()
#: ``aten.linear`` under the ε-rule (:func:`_epsilon_linear`), booking what the stabilizer keeps as
#: :func:`epsilon_stabilized` does
epsilon_linear_form = GradientForm(_epsilon_linear, lost=_EPSILON_PLAIN.lost, inner=plain)
