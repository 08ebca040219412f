"""What a rule sees of the node it explains: :class:`RuleContext`."""
from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import torch
import torch.fx


@dataclasses.dataclass
class RuleContext:
    """Everything a relevance rule may read about one graph node.

    Attributes
    ----------
    node : the ``torch.fx.Node`` being explained.
    args, kwargs : the node's arguments with every node replaced by its forward value.
    out : the node's forward output.
    live : one entry per positional argument: True if the argument depends on the explained input
        (relevance given to it keeps flowing), False for constants (parameters, buffers, masks,
        Python numbers: relevance given to them is absorbed), a list of those for list arguments.
    batch_dim : the dimension of ``out`` that indexes samples (None if ``out`` has none).
    batch_size : number of samples.
    eps : stabilizer added to denominators (``relprop.rules.stabilize.safe_divide``).
    preset : name of the active preset.
    options : extra per-call options (``explain(..., rule_options={...})``).
    """

    node: torch.fx.Node
    args: tuple
    kwargs: dict
    out: Any
    live: tuple
    batch_dim: Optional[int]
    batch_size: int
    eps: float = 1e-9
    preset: str = "chefer2021"
    options: dict = dataclasses.field(default_factory=dict)

    # -- provenance -----------------------------------------------------------------------------
    @property
    def module_path(self) -> str:
        """Dotted path of the innermost module the node came from ('' at top level)."""
        return module_path(self.node)

    # -- per-sample statistics ------------------------------------------------------------------
    def sample_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum of ``t`` (shaped like :attr:`out`) over everything but the batch: shape [batch].

        DESIGN §2: no statistic ever crosses the batch dimension.
        """
        if self.batch_dim is None:
            raise RuntimeError(f"node {self.node.name} has no batch dimension; cannot sum per sample")
        t = t.movedim(self.batch_dim, 0)
        # a batch dimension may fold k groups per sample, batch-major (Swin's [batch·windows, ...])
        return t.reshape(self.batch_size, -1).sum(1)

    def per_sample(self, v: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """Reshape a [batch] vector so it broadcasts along :attr:`batch_dim` of ``like`` (repeated
        k times per sample where that dimension holds k·batch groups, batch-major)."""
        shape = [1] * like.dim()
        n = like.shape[self.batch_dim]
        if n != v.shape[0] and n % v.shape[0] == 0:
            v = v.repeat_interleave(n // v.shape[0])
        shape[self.batch_dim] = v.shape[0]
        return v.reshape(shape)

    def live_tensor_args(self) -> Sequence[int]:
        """Positions of positional arguments that are input-dependent tensors."""
        return [i for i, (a, l) in enumerate(zip(self.args, self.live)) if l is True and torch.is_tensor(a)]


def module_path(node: torch.fx.Node) -> str:
    """The innermost ``nn_module_stack`` entry of ``node`` ('' if none)."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path, _ = list(stack.values())[-1]
    return _clean_path(path)


def module_type(node: torch.fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return "top level"
    _, typ = list(stack.values())[-1]
    return typ if isinstance(typ, str) else getattr(typ, "__qualname__", str(typ))


def module_paths(node: torch.fx.Node) -> list:
    """Every enclosing module path of ``node``, outermost first."""
    stack = node.meta.get("nn_module_stack") or {}
    return [_clean_path(p) for p, _ in stack.values()]


def _clean_path(path: str) -> str:
    # non-strict export writes paths like "L['self'].blocks[3].attn" in some versions
    if path.startswith("L['self']"):
        path = path[len("L['self']"):].lstrip(".")
        path = path.replace("[", ".").replace("]", "").replace("'", "")
    return path
