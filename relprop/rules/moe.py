"""Mixture-of-experts layers: the router's top-k, the experts' grouped matrix products, the gates.

A sparse MoE layer (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, Jamba) routes each token to k of E
experts: router logits ``W_r x``, probabilities ``p = softmax(W_r x)``, the k largest ``p``
(``topk``, optionally renormalized to sum 1: ``w = p_topk / Σ p_topk``), and the output
``Σ_k w_k · E_k(x)``. transformers computes the experts of all tokens at once, sorted by expert,
with a grouped matrix product (``transformers::grouped_mm_fallback`` or ``aten._grouped_mm``):
rows ``offs[g−1]:offs[g]`` of the input times expert g's weight.

=========================================  ===================================================
op                                         rule
=========================================  ===================================================
``topk``, ``sort`` (values)                routing (every preset): each selected value's
                                           relevance goes back to where it was taken from;
                                           the indices get none
grouped matrix product of the experts      the preset's linear rule, expert by expert on its
                                           rows (ε-rule in ``"attnlrp"``, LRP-α1β0 in
                                           ``"chefer2021"``, the authors' baseline in ``"lrp"``)
gate weight × expert output                ``"attnlrp"``: the uniform rule (AttnLRP Prop. 3.2),
                                           half to each; ``"cp_lrp"``: the gate weight is a
                                           constant (all to the expert output)
top-k renormalization ``w = p / Σ p``      ``"attnlrp"``: the ε-rule of the whole function
                                           (its gradient × input), R_p = R − w ⊙ Σ R
=========================================  ===================================================

This is how the AttnLRP authors treat the gates in their code: LXT's Mixtral (the model of the
paper's experiments) gives the gate-weight product the uniform rule (``GateWeightMultiplication:
UniformRule``), the renormalization the ε-rule (``NormWeight: EpsilonRule``) and the router's
softmax the softmax rule, and its CP-LRP composite stops relevance at the gate weights; LXT's
efficient Qwen3-MoE patch halves the gradient of the gate-weight product (``divide_gradient``) and
leaves the router's gradient as it is, the same rules as modified gradients. The renormalization is
homogeneous of degree 0 in ``p`` (scaling every ``p`` scales nothing), so its ε-rule passes on
relevance that sums to zero per token: what reaches it is booked as absorbed by the top-k
renormalization (:data:`RENORMALIZATION`), and the router receives a redistribution among the
selected experts.
"""
from __future__ import annotations

import operator

import torch
import torch.fx

from ..errors import UnsupportedOperation
from ..graph.nodes import module_type
from .gradient_forms import epsilon_stabilized
from .spec import GradientForm, as_form
from .linear import linear_formula
from .rule_registry import rule
from .stabilize import promote

aten = torch.ops.aten

#: the label under which the relevance a top-k renormalization does not pass on is booked as absorbed
RENORMALIZATION = "top-k renormalization (the ε-rule of w / Σ w passes on a sum of 0)"
GROUPED_MM = ("transformers::grouped_mm_fallback.default", aten._grouped_mm.default)
_SELECTIONS = (aten.topk.default, aten.sort.default, aten.sort.stable)
#: ops a routing weight may pass through between the top-k and the product with the expert output
_CARRY = frozenset({aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.unsqueeze.default,
                    aten.squeeze.dim, aten.squeeze.dims, aten.index.Tensor, aten._to_copy.default, aten.to.dtype,
                    aten.clone.default, aten.expand.default, aten.div.Tensor, aten.mul.Scalar, aten.permute.default,
                    aten.transpose.int, aten.select.int, aten.slice.Tensor, aten.gather.default,
                    aten.index_select.default, aten.flatten.using_ints, aten.alias.default})


# ------------------------------------------------------------------------------------------------
# top-k and sort: routing
# ------------------------------------------------------------------------------------------------
@rule(*_SELECTIONS, preset="base")
def selection_route(ctx, relevance):
    """``topk`` / ``sort``: (values, indices); the relevance of each value goes back to the position
    it was taken from (the adjoint of the selection, its gradient), the indices get none."""
    x = ctx.args[0]
    values_relevance = relevance[0] if isinstance(relevance, (list, tuple)) else relevance
    indices = ctx.out[1]
    if ctx.node.target is aten.topk.default:
        dim = ctx.args[2] if len(ctx.args) > 2 else ctx.kwargs.get("dim", -1)
    else:
        dim = ctx.args[1] if len(ctx.args) > 1 and isinstance(ctx.args[1], int) else ctx.kwargs.get("dim", -1)
    out = values_relevance.new_zeros(x.shape).scatter_add(dim, indices, values_relevance)
    return (out,) + (None,) * (len(ctx.args) - 1)


# ------------------------------------------------------------------------------------------------
# the experts' grouped matrix products: the preset's linear rule, group by group
# ------------------------------------------------------------------------------------------------
# (and in "attnlrp", which relprop.rules.attnlrp registers it in)
@rule(*GROUPED_MM, preset=("chefer2021", "lrp"), gradient_form=epsilon_stabilized())
def grouped_linear(ctx, relevance):
    """``y[rows of g] = x[rows of g] @ W[g]`` for the groups ending at ``offs`` (the experts of a MoE
    layer, tokens sorted by expert): the active preset's linear rule
    (:func:`relprop.rules.linear.linear_formula`) on each group's rows, the weights constant (the
    ε-rule, AttnLRP Eq. 8, in ``"attnlrp"``). Rows past the last group (none in a full layer) get
    none."""
    x, w = ctx.args[0], ctx.args[1]
    offs = ctx.args[2] if len(ctx.args) > 2 else ctx.kwargs.get("offs")
    bias = ctx.args[3] if len(ctx.args) > 3 else ctx.kwargs.get("bias")
    if ctx.live[1] is True or not torch.is_tensor(offs) or w.dim() != 3 or x.dim() != 2 or bias is not None:
        raise UnsupportedOperation(ctx.node.target, ctx.module_path, module_type(ctx.node), ctx.preset,
                                   detail="relprop's rule takes a 2-d input, constant 3-d expert weights, group "
                                          "offsets and no bias (transformers' MoE experts).")
    formula = linear_formula(ctx)
    x, w = promote(x), promote(w)
    out = torch.zeros_like(x)
    start = 0
    for g, end in enumerate(offs.tolist()):
        if end > start:
            out[start:end] = formula(x[start:end], w[g], relevance[start:end], ctx.eps)
        start = end
    return (out,) + (None,) * (len(ctx.args) - 1)


# ------------------------------------------------------------------------------------------------
# structure: routing weights and their renormalization
# ------------------------------------------------------------------------------------------------
def _selected_values(node) -> bool:
    return (isinstance(node, torch.fx.Node) and node.target is operator.getitem and node.args[1] == 0
            and isinstance(node.args[0], torch.fx.Node) and node.args[0].target is aten.topk.default)


def _selected_indices(node, hops: int = 6) -> bool:
    if not isinstance(node, torch.fx.Node) or hops < 0:
        return False
    if node.target is operator.getitem and node.args[1] == 1 and isinstance(node.args[0], torch.fx.Node) \
            and node.args[0].target is aten.topk.default:
        return True
    return node.target in _CARRY and _selected_indices(node.args[0], hops - 1)


def is_routing_weight(arg, hops: int = 10) -> bool:
    """Whether graph argument ``arg`` is a gate weight of a MoE layer: the values of a router's
    ``topk`` (or gathered at its indices), through reshapes, index maps, casts, a renormalization
    and scalings (at most ``hops`` ops)."""
    if not isinstance(arg, torch.fx.Node) or arg.op != "call_function" or hops < 0:
        return False
    if _selected_values(arg):
        return True
    if arg.target is aten.gather.default and _selected_indices(arg.args[2]):
        return True
    return arg.target in _CARRY and is_routing_weight(arg.args[0], hops - 1)


def renormalized_dims(node: torch.fx.Node):
    """The dims of ``Σ`` when ``node`` is the renormalization ``w / Σ w`` of routing weights (the
    divisor a sum of the numerator, keeping its dims), else None."""
    if node.target is not aten.div.Tensor or len(node.args) < 2:
        return None
    num, den = node.args[0], node.args[1]
    if not isinstance(den, torch.fx.Node) or den.target is not aten.sum.dim_IntList or den.args[0] is not num:
        return None
    keepdim = den.args[2] if len(den.args) > 2 else den.kwargs.get("keepdim", False)
    if not keepdim or not is_routing_weight(num):
        return None
    dims = den.args[1]
    return [dims] if isinstance(dims, int) else list(dims)


def renormalization_shares(w_norm: torch.Tensor, relevance: torch.Tensor, dims):
    """The ε-rule of y = w / Σ_dims w (AttnLRP Eq. 8 on the whole function, as LXT's ``NormWeight``):
    R_w = w ⊙ Jᵀ (R / y) = R − y ⊙ Σ_dims R, and the part it does not pass on, y ⊙ Σ_dims R (its
    sum over ``dims`` is Σ R: R_w sums to 0)."""
    kept = w_norm * relevance.sum(dims, keepdim=True)
    return relevance - kept, kept


def renormalizing(form):
    """A gradient-form factory for ``aten.div.Tensor``: a top-k renormalization keeps its own
    gradient (the ε-rule of the whole function, :func:`renormalization_shares`), any other division
    gets ``form``. Its ``lost`` says what the renormalization does not pass on, booked as absorbed
    under :data:`RENORMALIZATION` (None for any other division)."""
    def divide_form(node, live, eps):
        return None if renormalized_dims(node) is not None else form(node, live, eps)

    def lost(node, args, out, relevance, eps):
        dims = renormalized_dims(node)
        if dims is None:
            return None
        return RENORMALIZATION, renormalization_shares(promote(out), relevance, dims)[1]
    return GradientForm(divide_form, lost=lost, inner=as_form(form))
