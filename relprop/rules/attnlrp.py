"""The ``"attnlrp"`` preset: AttnLRP (Achtibat et al., "AttnLRP: Attention-Aware Layer-wise
Relevance Propagation for Transformers", ICML 2024).

=========================================  ======================================================
op                                         rule (equation of the paper)
=========================================  ======================================================
linear, addmm, convolution, matmul with    ε-rule (Eq. 8): R_x = x ⊙ Wᵀ (R / z), z including the
a constant operand                         bias; the bias's share b ⊙ R / z is absorbed
add / sub (residuals, position             ε-rule on a sum (Eq. 8): R_u = u ⊙ R / (u + v); a
embeddings, masks, ``+ ε``)                constant operand absorbs its share
sum / mean pooling                         ε-rule on a sum (Eq. 8)
multiplication / division by a constant    linear map without bias: ε-rule = R unchanged
GELU, SiLU, tanh, sigmoid, ReLU, erf,      identity rule (Eq. 9): R_x = R_y
x^p, √x, 1/√x, hardswish, clamp, ...
(element-wise, one input); element-wise
functions written out op by op (gelu_new,
quick_gelu, SiLU, softcapping, softplus)
softmax                                    Prop. 3.1 (Taylor decomposition at x with bias):
                                           R_x = x ⊙ (R − s ⊙ Σ R); the rest is absorbed (bias)
attention products A·V and Q·Kᵀ (two      Prop. 3.3: ε-rule, then the uniform rule (Eq. 7):
live operands)                             each operand gets half
element-wise product of two live tensors   Prop. 3.2: uniform rule, R/2 to each (gated MLPs)
(gates)
LayerNorm, RMSNorm, products/divisions by  Prop. 3.4: the normalizing statistic (σ, the RMS, a
a normalizing statistic                    norm) is a constant and gets no relevance; the rest is
                                           linear: ε-rule (LayerNorm: centering x − mean(x) and
                                           gain; its bias β absorbs β ⊙ R / y; RMSNorm: R_x = R)
BatchNorm (inference), GroupNorm,          registered in :mod:`relprop.rules.norm_layers` and
avg / max pooling, upsampling              :mod:`relprop.rules.pooling`: ε-rule (Eq. 8), GroupNorm
                                           with σ constant (Prop. 3.4)
=========================================  ======================================================

Every rule here is *conservative up to what constants absorb*: per sample, the relevance reaching
the input plus the relevance absorbed by constants (biases, LayerNorm's β, position embeddings,
the class token, masks, the softmax's bias term) equals the relevance injected at the target.

Every rule also declares its modified-gradient form (:mod:`relprop.rules.gradient_forms`), so
that :mod:`relprop.engine.fast_path` computes the same input relevance with one backward
pass. The shape-only routing rules come from ``"base"``. Not part of this preset: the γ-rule that
the AttnLRP authors tune on the linear layers of vision transformers (ε everywhere here).
"""
from __future__ import annotations

import types

import torch

from .convolution import conv_input_adjoint
from .gradient_forms import (constant_operand, epsilon_linear_form, epsilon_stabilized, function_identity,
                             identity_rule, half_gradient, layer_norm_const_std, plain,
                             rms_norm_const_rms, uniform_product)
from .linear import require_constant_weight
from .moe import GROUPED_MM, grouped_linear, is_routing_weight, renormalization_shares, renormalized_dims, renormalizing
from .normalization import is_statistic
from .reductions import pooling_z_rule
from .rule_registry import BASE, ELEMENTWISE_FUNCTION, Preset, rule
from .stabilize import finite, promote, safe_divide

aten = torch.ops.aten

ATTNLRP = Preset(
    "attnlrp", extends=BASE, modified_gradient=True, seed="score",
    description="AttnLRP (Achtibat et al., ICML 2024): epsilon-rule linear layers and sums, identity rule on "
                "element-wise non-linearities and normalization statistics, uniform rule on bilinear products, "
                "the softmax rule of Prop. 3.1; relevance starts at the target logit's value; conservative up to "
                "absorbed (bias) relevance")
PRESET = "attnlrp"


#: half precision upcast to float32 (relevance accumulates in float32 at least; float64 kept)
_f = promote


# ------------------------------------------------------------------------------------------------
# ε-rule: linear maps (Eq. 8)
# ------------------------------------------------------------------------------------------------
def epsilon_formula(x, w, relevance, eps):
    """The ε-rule (Eq. 8) of ``z = x @ w`` without bias (``w`` [in, out]): R_x = x ⊙ (R / z) wᵀ; what
    other rules apply to linear maps that are not ``aten.linear`` (a MoE layer's experts)."""
    return x * (safe_divide(relevance, x @ w, eps) @ w.transpose(-1, -2))


@rule(aten.linear.default, preset=PRESET, gradient_form=epsilon_linear_form, formula=epsilon_formula)
def epsilon_linear(ctx, relevance):
    """``y = x Wᵀ + b``: ε-rule (AttnLRP Eq. 8; Bach et al. 2015 Eq. 58),
    R_x = x ⊙ (R / y) W with y including the bias; the bias absorbs b ⊙ R / y."""
    require_constant_weight(ctx, 1)
    x, w = _f(ctx.args[0]), _f(ctx.args[1])
    s = safe_divide(relevance, _f(ctx.out), ctx.eps)
    out = [x * (s @ w), None]
    if len(ctx.args) > 2:
        b = ctx.args[2]
        out.append(_f(b) * s if torch.is_tensor(b) else None)
    return tuple(out)


@rule(aten.addmm.default, preset=PRESET, gradient_form=epsilon_stabilized())
def epsilon_addmm(ctx, relevance):
    """``y = β b + α x W`` (GPT-2's Conv1D): ε-rule (AttnLRP Eq. 8), the bias absorbs β b ⊙ R / y."""
    require_constant_weight(ctx, 2)
    b, x, w = ctx.args[:3]
    beta = ctx.kwargs.get("beta", 1)
    alpha = ctx.kwargs.get("alpha", 1)
    s = safe_divide(relevance, _f(ctx.out), ctx.eps)
    rx = alpha * _f(x) * (s @ _f(w).t())
    rb = beta * _f(b) * s if torch.is_tensor(b) else None
    return (rb, rx, None)


@rule(aten.convolution.default, preset=PRESET, gradient_form=epsilon_stabilized())
def epsilon_convolution(ctx, relevance):
    """Convolution (the patch embedding): ε-rule (AttnLRP Eq. 8), R_x = x ⊙ convᵀ(R / y, W); the
    bias absorbs b ⊙ R / y. (Not z^B as in ``"chefer2021"``: AttnLRP applies the ε-rule.)"""
    x, w = _f(ctx.args[0]), _f(ctx.args[1])
    p = tuple(ctx.args[3:9])
    s = safe_divide(relevance, _f(ctx.out), ctx.eps)
    rx = x * conv_input_adjoint(s, w, x.shape, p)
    b = ctx.args[2]
    rb = None
    if torch.is_tensor(b):
        rb = _f(b).reshape((1, -1) + (1,) * (s.dim() - 2)) * s
    return (rx, None, rb) + (None,) * (len(ctx.args) - 3)


def epsilon_matmul_shares(a, b, relevance, eps):
    """ε-rule shares of ``z = a @ b`` (AttnLRP Eq. 8 applied to every product a_ji b_ip):
    R_a = a ⊙ (R/z) bᵀ and R_b = b ⊙ aᵀ (R/z); each sums to Σ R where z ≠ 0. Vector operands
    are promoted as ``torch.matmul`` does; shares come back in the (broadcast) operand shapes."""
    a2 = a.unsqueeze(0) if a.dim() == 1 else a
    b2 = b.unsqueeze(-1) if b.dim() == 1 else b
    z = a2 @ b2
    s = safe_divide(relevance.reshape(z.shape), z, eps)
    ra = a2 * (s @ b2.transpose(-1, -2))
    rb = b2 * (a2.transpose(-1, -2) @ s)
    if a.dim() == 1:
        ra = ra.squeeze(-2)
    if b.dim() == 1:
        rb = rb.squeeze(-1)
    return ra, rb


def _matmul_form(node, live, eps):
    both = len(live) > 1 and live[0] is True and live[1] is True
    return uniform_product(node, live, eps) if both else None


@rule(aten.matmul.default, aten.bmm.default, aten.mm.default, preset=PRESET,
      gradient_form=epsilon_stabilized(_matmul_form))
def uniform_matmul(ctx, relevance):
    """Matrix product. Two live operands (A·V, Q·Kᵀ): AttnLRP Prop. 3.3, the ε-rule on every
    product a_ji b_ip followed by the uniform rule (Eq. 7): R_a = a ⊙ (R/z) bᵀ / 2,
    R_b = b ⊙ aᵀ (R/z) / 2. One constant operand: a linear map without bias, ε-rule (Eq. 8) on the
    live operand; the constant gets nothing."""
    a, b = _f(ctx.args[0]), _f(ctx.args[1])
    live_a, live_b = ctx.live[0] is True, ctx.live[1] is True
    if not (live_a or live_b):
        return (None, None)
    ra, rb = epsilon_matmul_shares(a, b, relevance, ctx.eps)
    if live_a and live_b:
        return (ra / 2, rb / 2)
    return (ra, None) if live_a else (None, rb)


# the experts of a MoE layer: the ε-rule on each expert's rows (relprop.rules.moe)
rule(*GROUPED_MM, preset=PRESET, gradient_form=epsilon_stabilized())(grouped_linear)


# ------------------------------------------------------------------------------------------------
# ε-rule: sums (Eq. 8)
# ------------------------------------------------------------------------------------------------
def epsilon_sum(ctx, relevance, sign: float):
    """Shares of ``z = u + sign·α·v`` under the ε-rule (Eq. 8): R_u = u ⊙ R / z, R_v = sign·α·v ⊙ R / z.
    A Python-number operand gets a share too (it is absorbed as a constant)."""
    u, v = ctx.args[0], ctx.args[1]
    alpha = ctx.kwargs.get("alpha", ctx.args[2] if len(ctx.args) > 2 else 1)
    z = _f(ctx.out)
    s = safe_divide(relevance, z, ctx.eps)
    ru = finite(_f(u) * s)
    rv = finite((sign * alpha) * _f(v) * s)
    return (ru, rv) + (None,) * (len(ctx.args) - 2)


@rule(aten.add.Tensor, aten.add.Scalar, preset=PRESET, gradient_form=epsilon_stabilized())
def epsilon_add(ctx, relevance):
    """u + v (residual connections, position embeddings, masks, x + ε): ε-rule (AttnLRP Eq. 8),
    R_u = u ⊙ R / (u + v), R_v = v ⊙ R / (u + v); a constant operand absorbs its share."""
    return epsilon_sum(ctx, relevance, 1.0)


@rule(aten.sub.Tensor, aten.sub.Scalar, preset=PRESET, gradient_form=epsilon_stabilized())
def epsilon_sub(ctx, relevance):
    """u − v, as u + (−v): ε-rule (AttnLRP Eq. 8)."""
    return epsilon_sum(ctx, relevance, -1.0)


def _pooled_count(node, args, z):
    """The ε-rule of a mean divides by the sum of the pooled elements, n times the mean."""
    return args[0].numel() / max(z.numel(), 1) if node.target is aten.mean.dim else 1


@rule(aten.sum.dim_IntList, aten.mean.dim, preset=PRESET, gradient_form=epsilon_stabilized(scale=_pooled_count))
def epsilon_pooling(ctx, relevance):
    """Sum/mean over dimensions (pooling): ε-rule on a sum (AttnLRP Eq. 8), R_i = x_i R / Σ_k x_k."""
    return pooling_z_rule(ctx, relevance)


@rule(aten.mul.Scalar, aten.div.Scalar, aten.neg.default, preset=PRESET, gradient_form=plain)
def epsilon_scaling(ctx, relevance):
    """y = c·x, x / c or −x for a number c: a linear map without bias, whose ε-rule (AttnLRP Eq. 8)
    gives R_x = x c R / (c x) = R."""
    return (relevance,) + (None,) * (len(ctx.args) - 1)


# ------------------------------------------------------------------------------------------------
# identity rule (Eq. 9)
# ------------------------------------------------------------------------------------------------
ELEMENTWISE = (aten.gelu.default, aten.tanh.default, aten.relu.default, aten.silu.default, aten.sigmoid.default,
               aten.erf.default, aten.hardtanh.default, aten.leaky_relu.default, aten.elu.default,
               aten.pow.Tensor_Scalar, aten.rsqrt.default, aten.sqrt.default, aten.hardswish.default,
               aten.hardsigmoid.default, aten.mish.default, aten.clamp.default, aten.clamp_min.default,
               aten.clamp_max.default)


@rule(*ELEMENTWISE, preset=PRESET, gradient_form=identity_rule)
def identity(ctx, relevance):
    """Element-wise non-linearity of one input (GELU, SiLU, tanh, x^p, hardswish, a clamp, ...): the
    identity rule (AttnLRP Eq. 9), R_x = R_y: a function of one variable explains itself entirely by
    it."""
    return (relevance,) + (None,) * (len(ctx.args) - 1)


@rule(ELEMENTWISE_FUNCTION, preset=PRESET, gradient_form=function_identity)
def identity_function(ctx, relevance):
    """An element-wise function of one tensor that the graph computes op by op (tanh-GELU
    ``gelu_new``, ``quick_gelu``, a SiLU written ``x·sigmoid(x)``, softcapping ``c·tanh(x/c)``, a
    softplus; :mod:`relprop.graph.elementwise`): the identity rule of the whole function (AttnLRP
    Eq. 9), R_x = R_y, as LXT applies it to the activation module (``identity_rule_implicit``).
    ``ctx.args`` is ``(x,)``, ``ctx.out`` the function's output."""
    return (relevance,)


# ------------------------------------------------------------------------------------------------
# softmax (Prop. 3.1)
# ------------------------------------------------------------------------------------------------
def softmax_shares(x: torch.Tensor, s: torch.Tensor, relevance: torch.Tensor, dim: int):
    """AttnLRP Prop. 3.1: R_x = x ⊙ (R − s ⊙ Σ_dim R) and the bias term R − R_x (absorbed)."""
    rx = finite(x * (relevance - s * relevance.sum(dim, keepdim=True)))
    return rx, relevance - rx


@rule(aten.softmax.int, aten._softmax.default, aten._safe_softmax.default, preset=PRESET, gradient_form=plain)
def softmax(ctx, relevance):
    """Softmax s = softmax(x): AttnLRP Prop. 3.1 (Deep Taylor decomposition at x, with bias),
    R_x,i = x_i (R_i − s_i Σ_j R_j). What it does not give x is the decomposition's bias term; it
    is returned at the op's (constant) ``dim`` argument, so the engine books it as absorbed.
    In gradient form this is exactly x ⊙ ∂s/∂xᵀ (R / s): the softmax's own gradient."""
    dim = ctx.args[1] if len(ctx.args) > 1 else ctx.kwargs.get("dim", -1)
    rx, bias = softmax_shares(_f(ctx.args[0]), _f(ctx.out), relevance, dim)
    return (rx, bias) + (None,) * (len(ctx.args) - 2)


# ------------------------------------------------------------------------------------------------
# normalization (Prop. 3.4) and products (Prop. 3.2)
# ------------------------------------------------------------------------------------------------
def layer_norm_shares(x, normalized_shape, weight, bias, eps_ln, out, relevance, eps):
    """LayerNorm with σ constant (AttnLRP Prop. 3.4), so y = γ ⊙ (x − mean(x)) / σ + β is linear
    in x; its ε-rule (Eq. 8): R_x,i = x_i Σ_j (γ_j/σ)(δ_ij − 1/N) R_j / y_j; β absorbs β ⊙ R / y."""
    dims = tuple(range(x.dim() - len(normalized_shape), x.dim()))
    rstd = torch.rsqrt(x.var(dims, unbiased=False, keepdim=True) + eps_ln)
    s = safe_divide(relevance, out, eps)
    u = s * weight if weight is not None else s
    rx = x * (u - u.mean(dims, keepdim=True)) * rstd
    rb = bias * s if bias is not None else None
    return rx, rb


@rule(aten.layer_norm.default, preset=PRESET, gradient_form=epsilon_stabilized(layer_norm_const_std))
def layer_norm(ctx, relevance):
    """``layer_norm``: AttnLRP Prop. 3.4 (identity on the standard deviation) with the ε-rule on the
    remaining linear map (centering and gain, Eq. 8); β absorbs β ⊙ R / y. See
    :func:`layer_norm_shares`."""
    args = list(ctx.args) + [None] * (5 - len(ctx.args))
    x, shape, weight, bias = _f(args[0]), args[1], _f(args[2]), _f(args[3])
    eps_ln = args[4] if args[4] is not None else ctx.kwargs.get("eps", 1e-5)
    rx, rb = layer_norm_shares(x, shape, weight, bias, eps_ln, _f(ctx.out), relevance, ctx.eps)
    out = [rx, None, None, rb, None, None]
    return tuple(out[: len(ctx.args)])


@rule(aten.rms_norm.default, preset=PRESET, gradient_form=rms_norm_const_rms)
def rms_norm(ctx, relevance):
    """``rms_norm``: AttnLRP Prop. 3.4, the RMS is a constant, so y = γ ⊙ x / rms is linear without
    bias and its ε-rule (Eq. 8) passes R unchanged: R_x = R_y."""
    return (relevance,) + (None,) * (len(ctx.args) - 1)


def product_kind(ctx) -> str:
    """How AttnLRP splits an element-wise product: ``"constant"`` (at most one live factor),
    ``"statistic0"``/``"statistic1"`` (that factor is a normalizing statistic, Prop. 3.4) or
    ``"uniform"`` (two live factors, Prop. 3.2)."""
    live_a, live_b = ctx.live[0] is True, ctx.live[1] is True
    if not (live_a and live_b):
        return "constant"
    if any(is_routing_weight(a) for a in ctx.node.args[:2]):  # a MoE gate weight: Prop. 3.2, as LXT does
        return "uniform"
    if is_statistic(ctx, 1):
        return "statistic1"
    if is_statistic(ctx, 0):
        return "statistic0"
    return "uniform"


def _runtime_ctx(node, args, live):
    """What :func:`product_kind` reads, for a product about to be computed on ``args``."""
    shape = torch.broadcast_shapes(*[a.shape for a in args[:2] if torch.is_tensor(a)])
    return types.SimpleNamespace(node=node, args=tuple(args), live=live,
                                 out=torch.empty(shape, device="meta"))


def product_form(uniform_call):
    """A gradient-form factory for ``aten.mul.Tensor`` whose two-live-factor case is
    ``uniform_call(a, b) -> product`` (the uniform rule in ``"attnlrp"``)."""
    def form(node, live, eps):
        kinds = {}

        def call(a, b):
            kind = kinds.get("kind")
            if kind is None:  # structural: the same for every call on this graph
                kind = kinds.setdefault("kind", product_kind(_runtime_ctx(node, (a, b), live)))
            if kind == "statistic1":
                return a * b.detach()
            if kind == "statistic0":
                return a.detach() * b
            if kind == "uniform":
                return uniform_call(node, a, b)
            return a * b
        return call
    return form


@rule(aten.mul.Tensor, preset=PRESET, gradient_form=product_form(lambda node, a, b: half_gradient(a * b)))
def uniform_multiply(ctx, relevance):
    """Element-wise product. Two live factors (gates): AttnLRP Prop. 3.2, the uniform rule (Eq. 7),
    R/2 to each. A factor that is a normalizing statistic (RMSNorm written out): Prop. 3.4, it is a
    constant and the other factor gets R. One constant factor: linear without bias, ε-rule = R."""
    kind = product_kind(ctx)
    if kind == "uniform":
        return (relevance / 2, relevance / 2)
    if kind == "statistic1":
        return (relevance, None)
    if kind == "statistic0":
        return (None, relevance)
    if ctx.live[0] is True:
        return (relevance, None)
    if ctx.live[1] is True:
        return (None, relevance)
    return (None, None)


@rule(aten.div.Tensor, preset=PRESET, gradient_form=renormalizing(constant_operand(1)), no_relevance_to={1})
def divide(ctx, relevance):
    """x / d with d a constant or a statistic of the input (a norm, a standard deviation): AttnLRP
    Prop. 3.4, d is a constant, so y = x / d is linear without bias and R_x = R (ε-rule, Eq. 8);
    the divisor gets none. (A constant numerator absorbs R.) The renormalization w / Σ w of a MoE
    router's top-k weights is explained as a whole by the ε-rule, as the AttnLRP authors' code does
    (:func:`relprop.rules.moe.renormalization_shares`)."""
    dims = renormalized_dims(ctx.node)
    if dims is not None and ctx.live[0] is True:
        return (renormalization_shares(_f(ctx.out), relevance, dims)[0], None)
    return (relevance,) + (None,) * (len(ctx.args) - 1)

