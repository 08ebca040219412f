"""The handle that methods use to re-run the captured graph of one explained batch."""
from __future__ import annotations

from typing import Callable, Optional

import torch

from ..graph.capture import CACHE, Captured
from ..graph.export import FIRST_CALL_SIZES
from ..graph.nodes import module_paths
from ..rules.stabilize import promote
from ..targets import fixed
from .forward import forward
from .memory import transient


class Session:
    """One explained batch, re-run on demand: with the source perturbed (SmoothGrad, Integrated
    Gradients), with other inputs (ViT-CX masks), or with one block re-evaluated under an override
    (value zeroing). The target stays the one explained (``score_fn``)."""

    def __init__(self, captured: Captured, model: torch.nn.Module, kwargs: dict, score_fn: Callable,
                 source_value: Optional[torch.Tensor], compute: Optional[torch.dtype] = None):
        self.captured = captured
        self.compute = compute  # the precision of the explained run (Request.compute): re-runs use it too
        self.model = model
        self.kwargs = kwargs
        self.score_fn = score_fn
        self.source_value = source_value  # pixels [B,C,H,W] or word embeddings [B,S,C]
        self._scopes = {}
        #: what :meth:`for_every_batch` had to capture (CaptureEvents; the call's notes say it)
        self.exports: list = []

    @property
    def modality(self):
        return self.captured.analysis.modality

    def subset(self, rows: torch.Tensor, classes: torch.Tensor, batch: int) -> "Session":
        """A session on the samples ``rows`` of this batch of ``batch`` samples (every input with
        ``batch`` rows is indexed by them), scoring ``logits[r, classes[r]]`` for each of its rows."""
        b = batch
        kwargs = {k: (v.index_select(0, rows.to(v.device))
                      if torch.is_tensor(v) and v.dim() > 0 and v.shape[0] == b else v)
                  for k, v in self.kwargs.items()}
        return Session(self.captured, self.model, kwargs, fixed(classes, self.captured.primary).score, None,
                       compute=self.compute)

    def for_every_batch(self) -> Optional["Session"]:
        """This batch on a program that takes every batch size: this session where its program does;
        where the program was exported at the first call's sizes
        (:class:`relprop.graph.capture.CaptureCache`'s ``first_export="static"``), a session on the
        program for every size (exported now, once per model and input structure, as the first call at
        another size would); None where the model's batch cannot be made dynamic."""
        if self.captured.batch_dynamic:
            return self
        if self.captured.program.exported_as != FIRST_CALL_SIZES[0]:
            return None
        events: list = []
        captured = CACHE.get(self.model, self.kwargs, self.captured.primary, events, every_batch=True)
        self.exports.extend(e for e in events if e.kind in ("exported", "loaded"))
        if not captured.batch_dynamic:
            return None
        generic = Session(captured, self.model, self.kwargs, self.score_fn, self.source_value, compute=self.compute)
        generic.exports = self.exports
        return generic

    def source_gradient(self, perturb: Optional[Callable] = None):
        """(source value, d score / d source) with the source replaced by ``perturb(source)``."""
        with torch.enable_grad():
            env, outputs = forward(self.captured, self.model, self.kwargs, compute=self.compute, perturb=perturb,
                                   discard=transient(self.captured))
            scores = self.score_fn(outputs)
            srcs = self.captured.analysis.sources
            grads = torch.autograd.grad(scores.sum(), [env[s] for s in srcs], allow_unused=True)
        g = [torch.zeros_like(env[s]) if gr is None else gr for s, gr in zip(srcs, grads)]
        return promote(env[srcs[0]].detach()), promote(sum(g).detach())

    def source_scores(self, perturb: Callable) -> torch.Tensor:
        """[batch] target scores with the source replaced by ``perturb(source)`` (no gradients)."""
        with torch.no_grad():
            _, outputs = forward(self.captured, self.model, self.kwargs, compute=self.compute, perturb=perturb,
                                 discard=transient(self.captured))
            return promote(self.score_fn(outputs).detach())

    def target_scores(self, **replace) -> torch.Tensor:
        """Target scores with some model inputs replaced (e.g. ``pixel_values=masked``;
        ``primary=`` names the explained input)."""
        kwargs = dict(self.kwargs)
        for k, v in replace.items():
            if k == "primary":
                k = self.captured.primary
            old = kwargs.get(k)
            if torch.is_tensor(v) and torch.is_tensor(old) and v.is_floating_point() and old.is_floating_point():
                v = v.to(old.dtype)  # e.g. float32 masks applied to a half-precision model's pixels
            kwargs[k] = v
        with torch.no_grad():
            _, outputs = forward(self.captured, self.model, kwargs, compute=self.compute,
                                 discard=transient(self.captured))
            return promote(self.score_fn(outputs).detach())

    def block_output_with_value_scaled(self, base_env: dict, block_index: int, scale: torch.Tensor) -> torch.Tensor:
        """Re-evaluate block ``block_index`` with its values V multiplied by ``scale`` (broadcast
        to V, e.g. zero for one token) and return the block's output hidden states."""
        b = self.captured.analysis.blocks[block_index]
        scope = self._scope(block_index)
        v = base_env[b.value]
        with torch.no_grad():
            env, _ = forward(self.captured, self.model, self.kwargs, compute=self.compute,
                             overrides={b.value: v * scale.to(v.dtype)}, env=base_env, only=scope)
        return promote(env[b.output].detach())

    def base_env(self) -> dict:
        """Every node's value on this batch (one forward pass without gradients)."""
        with torch.no_grad():
            env, _ = forward(self.captured, self.model, self.kwargs, compute=self.compute)
        return env

    def _scope(self, block_index):
        if block_index not in self._scopes:
            b = self.captured.analysis.blocks[block_index]
            order = {n: i for i, n in enumerate(self.captured.graph.nodes)}
            start = order[b.value]
            self._scopes[block_index] = {n for n in self.captured.graph.nodes
                                         if order[n] > start and b.layer in module_paths(n) and n.op == "call_function"}
        return self._scopes[block_index]
