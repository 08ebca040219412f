"""Complex arithmetic written as real arithmetic on the real and imaginary parts.

A rotary embedding computed in complex numbers (Llama 4's text model, Meta's LLaMA code:
``view_as_real(view_as_complex(q.reshape(..., -1, 2)) * freqs_cis)``) is the same function as its real
form ``(q₀ cos − q₁ sin, q₀ sin + q₁ cos)``. relprop's rules and analyses are written for real values, so
:func:`realify_complex` rewrites the exported graph, once per capture: every complex value is replaced by
the pair of its real and imaginary parts (``view_as_complex(x)`` by ``x[..., 0]`` and ``x[..., 1]``, a complex
constant by its two parts), arithmetic on them by its real form ((a + ib)(c + id) = (ac − bd) + i(ad + bc),
sums part by part, ``conj`` negating the imaginary part), rearrangements (views, permutes, slices, casts)
by the same rearrangement of each part, and ``view_as_real(z)`` by ``stack([re, im], -1)``. The relevance
rules then see multiplications, sums and stacks, and explain the complex form exactly as they explain the
real one. A complex value that reaches an op outside that list keeps the complex graph from there on; the
walk then refuses that op by name (rollouts and gradient methods still run: autograd differentiates it).
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
import torch.fx

aten = torch.ops.aten

#: rearrangements applied to each part alike (the first argument is the complex tensor)
_REARRANGE = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default,
              aten.unsqueeze.default, aten.squeeze.dim, aten.permute.default, aten.transpose.int, aten.slice.Tensor,
              aten.select.int, aten.clone.default, aten.contiguous.default, aten.alias.default,
              aten.flatten.using_ints, aten.unflatten.int}
_REAL_OF = {torch.complex64: torch.float32, torch.complex128: torch.float64, torch.complex32: torch.float16}


def _val(n):
    return n.meta.get("val") if isinstance(n, torch.fx.Node) else n


def _is_complex(n) -> bool:
    v = _val(n)
    return isinstance(v, torch.Tensor) and v.is_complex()


def reads_complex(node: torch.fx.Node) -> bool:
    """Whether ``node`` reads or produces a complex value (one :func:`realify_complex` left complex)."""
    return _is_complex(node) or any(_is_complex(a) for a in node.all_input_nodes)


def complex_detail(node: torch.fx.Node) -> str:
    """Why a node on complex values has no rule, in words (empty for a node on real values)."""
    if not reads_complex(node):
        return ""
    return ("It works on complex values. relprop writes complex arithmetic in real form (products, sums, "
            "conjugates, rearrangements, view_as_complex / view_as_real: relprop.graph.complex_values) and "
            "this op is not among them, so no rule of any preset applies to it (nor unsupported='z_rule'); "
            "gradient methods (input_x_gradient, integrated_gradients, the rollouts) still explain the model, "
            "or write the op in real arithmetic in the model.")


def realify_complex(graph: torch.fx.Graph) -> int:
    """Rewrite the complex arithmetic of ``graph`` as real arithmetic (see the module docstring); returns
    how many complex nodes were replaced. New nodes carry fake values and the module stack of the node
    they replace."""
    pairs: Dict[torch.fx.Node, Tuple[torch.fx.Node, torch.fx.Node]] = {}
    fake_mode = next((getattr(_val(n), "fake_mode", None) for n in graph.nodes
                      if getattr(_val(n), "fake_mode", None) is not None), None)
    if fake_mode is None or not any(_is_complex(n) for n in graph.nodes):
        return 0

    def add(at, target, args, kwargs=None):
        with graph.inserting_before(at):
            node = graph.call_function(target, tuple(args), kwargs or {})
        node.meta.update({k: v for k, v in at.meta.items() if k not in ("val", "tensor_meta")})
        vals = [[_val(b) for b in a] if isinstance(a, (list, tuple)) else _val(a) for a in args]
        with fake_mode:
            node.meta["val"] = target(*vals, **(kwargs or {}))
        return node

    def parts(n, at) -> Optional[Tuple]:
        """The (re, im) of operand ``n`` of node ``at``: a rewritten complex node's pair, a complex leaf's
        two parts, a real tensor or number as (n, None)."""
        if n in pairs:
            return pairs[n]
        if not isinstance(n, torch.fx.Node) or not _is_complex(n):
            return (n, None)
        if n.op == "call_function" and n.target is aten.view_as_complex.default:
            return None  # (rewritten before its users)
        r = add(at, aten.view_as_real.default, [n])
        pairs[n] = (add(at, aten.select.int, [r, -1, 0]), add(at, aten.select.int, [r, -1, 1]))
        return pairs[n]

    def mul(at, p, q):
        (a, b), (c, d) = p, q
        if b is None and d is None:
            return None
        if b is None:
            return add(at, aten.mul.Tensor, [c, a]), add(at, aten.mul.Tensor, [d, a])
        if d is None:
            return add(at, aten.mul.Tensor, [a, c]), add(at, aten.mul.Tensor, [b, c])
        re = add(at, aten.sub.Tensor, [add(at, aten.mul.Tensor, [a, c]), add(at, aten.mul.Tensor, [b, d])])
        im = add(at, aten.add.Tensor, [add(at, aten.mul.Tensor, [a, d]), add(at, aten.mul.Tensor, [b, c])])
        return re, im

    count = 0
    done = set()  # complex nodes written in real form, and the view_as_real nodes replaced
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        t = node.target
        if t is aten.view_as_complex.default:
            done.add(node)
            x = node.args[0]
            pairs[node] = (add(node, aten.select.int, [x, -1, 0]), add(node, aten.select.int, [x, -1, 1]))
            continue
        ins = [a for a in node.args if isinstance(a, torch.fx.Node)]
        if not any(a in pairs for a in ins):
            continue
        new = None
        if t is aten.mul.Tensor:
            new = mul(node, parts(node.args[0], node), parts(node.args[1], node))
        elif t in (aten.add.Tensor, aten.sub.Tensor) and len(node.args) == 2 and node.kwargs.get("alpha", 1) == 1:
            p, q = parts(node.args[0], node), parts(node.args[1], node)
            if p[1] is not None and q[1] is not None:
                new = (add(node, t, [p[0], q[0]]), add(node, t, [p[1], q[1]]))
        elif t is aten._conj.default or t is aten.conj_physical.default:
            p = pairs[node.args[0]]
            new = (p[0], add(node, aten.neg.default, [p[1]]))
        elif t in _REARRANGE and node.args[0] in pairs:
            p = pairs[node.args[0]]
            new = tuple(add(node, t, [x] + list(node.args[1:]), dict(node.kwargs)) for x in p)
        elif t is aten._to_copy.default and node.args[0] in pairs and _is_complex(node):
            dtype = _REAL_OF.get(_val(node).dtype)
            kwargs = {k: v for k, v in node.kwargs.items() if k != "dtype"}
            new = tuple(add(node, t, [x], {**kwargs, "dtype": dtype}) for x in pairs[node.args[0]])
        elif t is aten.view_as_real.default and node.args[0] in pairs:
            re, im = pairs[node.args[0]]
            out = add(node, aten.stack.default, [[re, im], -1])
            node.replace_all_uses_with(out)
            done.add(node)
            count += 1
            continue
        if new is None:  # an op relprop cannot write in real form: the complex graph stays from here
            continue
        pairs[node] = new
        done.add(node)
        count += 1
    # what was written in real form and nothing reads any more (users first)
    for node in reversed(list(graph.nodes)):
        if node in done and not node.users:
            graph.erase_node(node)
    return count
