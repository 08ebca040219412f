"""The ``"cp_lrp"`` preset: conservative propagation (Ali, Schnake, Eberle, Montavon, Müller & Wolf,
"XAI for Transformers: Better Explanations through Conservative Propagation", ICML 2022).

Ali et al. show that Gradient × Input is not conservative through attention heads and LayerNorm
and propose to linearize both locally:

* **LRP-AH** (attention heads): in y_j = Σ_i x_i p_ij the attention probabilities p_ij are held
  constant, so the head is linear in the values x and R_x,i = Σ_j x_i p_ij / Σ_i' x_i' p_i'j · R_j.
  Nothing flows into the softmax, the queries or the keys. Their implementation writes this as
  ``p.detach()``.
* **LRP-LN** (LayerNorm): in y_i = (x_i − mean(x)) / σ the denominator σ is held constant, so the
  layer is linear and R_x,i = Σ_j x_i (δ_ij − 1/N) / Σ_i' x_i' (δ_i'j − 1/N) · R_j (``σ.detach()``).

Everything else is plain LRP on linear maps. This preset therefore extends ``"attnlrp"`` (whose
LayerNorm rule, AttnLRP Prop. 3.4, is LRP-LN with the gain and the bias in the same ε-rule, and
whose linear rules are the ε-rule) and replaces only the attention product A·V. Gated MLPs are
not in Ali et al.'s models; we extend LRP-AH's principle to them as the AttnLRP authors' CP-LRP
implementation does: the gate (the factor that went through the activation) is a constant.
Differences from the ``"attnlrp"`` preset are thus: R_A = 0 (and no relevance in Q, K), and no
relevance into gates.
"""
from __future__ import annotations

import torch
import torch.fx

from ..graph.attention_blocks import SOFTMAX_OPS, TRANSPARENT_OPS
from . import attnlrp
from .gradient_forms import constant_operand, epsilon_stabilized, half_gradient
from .moe import is_routing_weight
from .rule_registry import Preset, rule

aten = torch.ops.aten

CP_LRP = Preset(
    "cp_lrp", extends=attnlrp.ATTNLRP,
    description="CP-LRP (Ali et al., ICML 2022): the attention probabilities and LayerNorm's standard deviation "
                "held constant (LRP-AH, LRP-LN), AttnLRP's epsilon/identity rules elsewhere; gates constant")
PRESET = "cp_lrp"

#: ops between a gate's activation and the product that do not change the value
_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.clone.default,
          aten._to_copy.default, aten.contiguous.default, aten.alias.default, aten.expand.default}
#: activation functions that make a factor a gate
_ACTIVATIONS = {aten.gelu.default, aten.silu.default, aten.sigmoid.default, aten.tanh.default, aten.relu.default,
                aten.erf.default, aten.hardtanh.default, aten.leaky_relu.default, aten.elu.default,
                aten.hardswish.default, aten.hardsigmoid.default, aten.mish.default}


def is_attention(arg, hops: int = 6) -> bool:
    """Whether graph argument ``arg`` is attention probabilities: a softmax output, possibly through
    the ops that :mod:`relprop.graph.analysis` treats as transparent (masking ``where``, copies)."""
    if not isinstance(arg, torch.fx.Node) or arg.op != "call_function" or hops < 0:
        return False
    if arg.target in SOFTMAX_OPS:
        return True
    if arg.target not in TRANSPARENT_OPS:
        return False
    return any(is_attention(m, hops - 1) for m in arg.all_input_nodes)


def attention_position(node: torch.fx.Node):
    """0 or 1: which operand of the product ``node`` is attention probabilities (None if neither)."""
    for i, arg in enumerate(node.args[:2]):
        if is_attention(arg):
            return i
    return None


def _is_gate(arg, hops: int = 4) -> bool:
    if not isinstance(arg, torch.fx.Node) or arg.op != "call_function" or hops < 0:
        return False
    if arg.target in _ACTIVATIONS or is_routing_weight(arg):  # MoE gate weights: constants, as in LXT's CP-LRP
        return True
    return arg.target in _VIEWS and _is_gate(arg.args[0], hops - 1)


def gate_position(node: torch.fx.Node):
    """0 or 1: the factor of an element-wise product that comes out of an activation function
    (the gate of a gated MLP) or is a MoE router's gate weight, when exactly one does; else None."""
    gates = [i for i, arg in enumerate(node.args[:2]) if _is_gate(arg)]
    return gates[0] if len(gates) == 1 else None


def _matmul_form(node, live, eps):
    p = attention_position(node)
    both = len(live) > 1 and live[0] is True and live[1] is True
    if p is not None and both:
        return constant_operand(p)(node, live, eps)
    return attnlrp._matmul_form(node, live, eps)


@rule(aten.matmul.default, aten.bmm.default, aten.mm.default, preset=PRESET,
      gradient_form=epsilon_stabilized(_matmul_form))
def attention_head_matmul(ctx, relevance):
    """A·V with A attention probabilities: Ali et al. (ICML 2022) LRP-AH, A is a constant, so the
    head is linear in V: R_V = V ⊙ Aᵀ (R / z) (the ε-rule of :func:`attnlrp.epsilon_matmul_shares`)
    and A gets nothing. Any other product: the ``"attnlrp"`` rule (:func:`attnlrp.uniform_matmul`)."""
    p = attention_position(ctx.node)
    if p is None or not (ctx.live[0] is True and ctx.live[1] is True):
        return attnlrp.uniform_matmul(ctx, relevance)
    ra, rb = attnlrp.epsilon_matmul_shares(attnlrp._f(ctx.args[0]), attnlrp._f(ctx.args[1]), relevance, ctx.eps)
    return (None, rb) if p == 0 else (ra, None)


def _gated(node, a, b):
    g = gate_position(node)
    if g == 0:
        return a.detach() * b
    if g == 1:
        return a * b.detach()
    return half_gradient(a * b)


@rule(aten.mul.Tensor, preset=PRESET, gradient_form=attnlrp.product_form(_gated))
def gated_multiply(ctx, relevance):
    """Element-wise product of two live factors where one is a gate (it came out of an activation):
    the gate is a constant, as attention probabilities are in Ali et al.'s LRP-AH (ICML 2022), so
    the product is linear in the other factor, which gets all of R. Otherwise (statistics, constant
    factors, two non-gates): the ``"attnlrp"`` rule (:func:`attnlrp.uniform_multiply`)."""
    if attnlrp.product_kind(ctx) == "uniform":
        g = gate_position(ctx.node)
        if g == 0:
            return (None, relevance)
        if g == 1:
            return (relevance, None)
    return attnlrp.uniform_multiply(ctx, relevance)
