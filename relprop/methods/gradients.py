"""Input-level gradient methods (survey §2.1): input × gradient, SmoothGrad and
Integrated Gradients.

All three work on the *source* of the captured graph, the tensor relevance and gradients stop at:
the pixels for images, the word embeddings (the output of the embedding lookup of the token ids;
position and segment embeddings are not part of it) for text, or ``inputs_embeds`` when the model
is called with embeddings. An attribution of the source's shape is reduced to

* images: ``"pixels"`` [batch, H, W], the sum over the colour channels (signed); the explanation's
  patch ``scores`` are the sums of that map over each patch;
* text: ``"tokens"`` [batch, positions], the sum over the embedding size (signed).

=========================  ==========================================================================
method                     definition (x: source of one sample, f: target score, ⊙: elementwise)
=========================  ==========================================================================
``input_x_gradient``       Σ_c x ⊙ ∂f/∂x
``smoothgrad``             Σ_c 1/n Σ_s M(x + ε_s), ε_s ~ N(0, σ²), σ = noise_level·(max x − min x),
                           M(z) = z ⊙ ∂f/∂z (default) or ∂f/∂z (Smilkov et al. 2017, Eq. 3)
``integrated_gradients``   Σ_c (x − x₀) ⊙ 1/m Σ_k ∂f/∂x(x₀ + α_k (x − x₀)), α_k = (k + ½)/m
                           (Sundararajan et al. 2017, Eq. 1 and §5, midpoint Riemann sum)
=========================  ==========================================================================

The methods that re-run the model (SmoothGrad, Integrated Gradients, and ViT-CX in
:mod:`relprop.methods.perturbation`) share :class:`Reruns`: it re-runs the cached captured graph
(no new export) on *rows*, copies of samples of the explained batch, ``batch_size`` rows per run.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Union

import torch

from ..engine.session import Session
from ..errors import MethodError
from ..rules.stabilize import promote
from .layout import per_position
from .progress import progress_bar
from .method_registry import method


# ---------------------------------------------------------------- shared helpers

def reduce_source(trace, attribution: torch.Tensor) -> dict:
    """[batch, C, H, W] pixel attributions → ``"pixels"`` (sum over colour channels); [batch, S, C]
    embedding attributions → ``"tokens"`` (sum over the embedding size); [batch, F] features of a
    non-sequence model → ``"tokens"`` as they are."""
    if trace.modality == "vision" and attribution.dim() == 4:
        return {"pixels": attribution.sum(1)}
    if attribution.dim() == 2:  # a flat feature vector per sample: each feature is a position
        return {"tokens": attribution}
    if attribution.dim() == 3 and trace.modality == "embeddings":  # summed over the features, wherever they are
        return {"tokens": per_position(trace, attribution)}
    return {"tokens": attribution.sum(-1)}


def _source(trace, name: str) -> torch.Tensor:
    s = trace.session
    if s is None or s.source_value is None:
        raise MethodError(f"{name} needs a float input (pixels) or a token-embedding lookup to differentiate "
                          "with respect to, and this model's graph has neither. Methods that need only the "
                          "attention maps: raw_attention, rollout, attention_norm.")
    return promote(s.source_value)


def _per_sample(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """[rows] → [rows, 1, ..., 1] broadcastable against ``like`` ([rows, ...])."""
    return t.reshape((-1,) + (1,) * (like.dim() - 1)).to(device=like.device, dtype=like.dtype)


def _valid_positions(trace, source: torch.Tensor) -> Optional[torch.Tensor]:
    """[batch, S] bool of the non-padding positions of a text batch (from its attention mask), or
    None when every position counts (images, or no mask)."""
    if source.dim() != 3:
        return None
    am = trace.session.kwargs.get("attention_mask")
    if torch.is_tensor(am) and tuple(am.shape) == tuple(source.shape[:2]):
        return am.to(source.device) != 0
    return None


class Run:
    """One re-run of :class:`Reruns`: which sample each row copies (``rows``), which of its copies
    (``copies``), whether the row is one (``valid``; a filler row is not), as host lists and as tensors;
    ``whole``: the rows are the explained batch in order."""

    def __init__(self, rows: List[int], copies: List[int], valid: List[bool], whole: bool):
        self.rows_list, self.copies_list, self.valid_list, self.whole = rows, copies, valid, whole
        self.rows = torch.tensor(rows, dtype=torch.long)
        self.copies = torch.tensor(copies, dtype=torch.long)
        self.valid = torch.tensor(valid, dtype=torch.bool)
        self.count = sum(valid)


class Reruns:
    """Re-runs of the cached captured graph on *rows*: row r is a copy of sample ``rows[r]`` of the
    explained batch (whose input a method then perturbs: noise, a path point, a mask).

    When the target is a class index (or one per sample) and the capture takes any batch size
    (``torch.export`` with a dynamic batch dimension), rows of several samples and copies are packed
    ``batch_size`` to a run and scored with ``logits[row, target[rows[r]]]``; a program exported at the
    first call's sizes is replaced by the program for every size for that, where packing saves runs
    (:meth:`relprop.engine.session.Session.for_every_batch`). A callable target is defined on the
    explained batch only (``target(outputs) -> [batch]``), and a model whose batch cannot be made
    dynamic takes only that batch size: then every run carries the explained batch itself, one copy of
    each sample, and ``batch_size`` has no effect. Either way a row only sees its own sample, so results
    do not depend on how samples are batched (up to float rounding).
    """

    def __init__(self, trace, batch_size: int):
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise MethodError(f"batch_size must be a positive int, not {batch_size!r}")
        self.session = trace.session
        self.batch = trace.batch_size
        self.target = trace.target
        self.batch_size = batch_size
        captured = self.session.captured
        self.packed = self.target is not None and bool(getattr(captured, "batch_dynamic", False))

    def plan(self, counts: Sequence[int]) -> List["Run"]:
        """Runs covering ``counts[i]`` copies of each sample i (:class:`Run`: rows, copies, valid, each
        [k]; ``valid`` is False for filler rows, only in the unpacked mode, when counts differ). The plan
        is made on the host from the counts: nothing of it is read back from a device."""
        counts = [int(c) for c in counts]
        runs = []
        if not self.packed and self.target is not None \
                and -(-sum(counts) // self.batch_size) < max(counts, default=0):  # packing saves runs
            generic = self.session.for_every_batch()
            if generic is not None:
                self.session, self.packed = generic, True
        if self.packed:
            pairs = [(i, c) for i in range(self.batch) for c in range(counts[i])]
            for start in range(0, len(pairs), self.batch_size):
                chunk = pairs[start:start + self.batch_size]
                rows, copies = [p[0] for p in chunk], [p[1] for p in chunk]
                runs.append(Run(rows, copies, [True] * len(chunk), rows == list(range(self.batch))))
        else:
            for c in range(max(counts, default=0)):
                runs.append(Run(list(range(self.batch)), [min(c, max(n - 1, 0)) for n in counts],
                                [c < n for n in counts], True))
        return runs

    def session_for(self, run: "Run") -> Session:
        """A session whose batch is the run's rows of the explained batch, scoring each row's own target."""
        if run.whole:
            return self.session
        rows = run.rows
        return self.session.subset(rows, self.target[rows.to(self.target.device)], self.batch)

    def progress(self, total: int, desc: str):
        return progress_bar(total, desc)


# ---------------------------------------------------------------- input × gradient

@method("input_x_gradient",
        description="input × gradient of the target score at the pixels or word embeddings, summed over "
                    "colour channels / embedding size",
        class_specific=True, signed=True,
        reference="survey §2.1 'Input gradient'; Shrikumar et al. 2016 (gradient ⊙ input)",
        needs_relevance=False, needs_blocks=False, needs_input_gradient=True, streams=2, checks_only=True)
def input_x_gradient(trace):
    """x ⊙ ∂f_t/∂x at the source x (pixels, or word embeddings), reduced as the module says:
    images → ``"pixels"`` Σ_c x_c ∂f_t/∂x_c per pixel; text → ``"tokens"`` Σ_k e_k ∂f_t/∂e_k per
    position (e: the word embedding). Signed: positive = raising the input raises the score.
    Uses the gradient of the forward pass already taken (no re-run)."""
    x = _source(trace, "input_x_gradient")
    g = trace.input_gradient
    if g is None:
        raise MethodError("input_x_gradient needs the gradient at the input, which this trace lacks")
    return reduce_source(trace, x * g.to(x))


# ---------------------------------------------------------------- SmoothGrad

def smoothgrad_noise(seed: int, sample_shape: Sequence[int], n: int) -> torch.Tensor:
    """The standard-normal draws ε_s, s = 0..n-1, of one sample of shape ``sample_shape`` (float32,
    CPU): [n, *sample_shape]. They depend on ``seed`` and the shape only, so a sample gets the same
    noise alone or in any batch.

    * an image ([C, H, W]): ``torch.randn((n, C, H, W))`` from a generator seeded with ``seed``;
    * a sequence ([S, C]): position p draws ``torch.randn((n, C))`` from a generator seeded with
      ``seed * 1_000_003 + p``, so the noise of position p does not depend on the sequence length
      (a padded text gets the same noise on its real positions as the text alone).
    """
    g = torch.Generator(device="cpu")
    shape = tuple(int(d) for d in sample_shape)
    if len(shape) == 2:
        out = torch.empty((n,) + shape)
        for p in range(shape[0]):
            g.manual_seed(int(seed) * 1_000_003 + p)
            out[:, p] = torch.randn((n, shape[1]), generator=g)
        return out
    g.manual_seed(int(seed))
    return torch.randn((n,) + shape, generator=g)


@method("smoothgrad",
        description="SmoothGrad: input × gradient (or the gradient) averaged over noisy copies of the input",
        class_specific=True, signed=True,
        reference="Smilkov et al. 2017, 'SmoothGrad: removing noise by adding noise', Eq. 3",
        needs_relevance=False, needs_blocks=False, streams=2, checks_only=True)
def smoothgrad(trace, n_samples: int = 16, noise_level: float = 0.15, multiply_by_input: bool = True,
               batch_size: int = 32, seed: int = 0):
    """SmoothGrad (Smilkov et al. 2017, Eq. 3): M̂(x) = 1/n Σ_{s=1..n} M(x + ε_s), ε_s ~ N(0, σ²),
    reduced like ``input_x_gradient`` (sum over colour channels / embedding size; signed).

    Parameters
    ----------
    n_samples : n, the number of noisy copies per sample (the paper uses 50; 16 by default here
        to keep the cost at 16 forward + backward passes per sample).
    noise_level : σ / (max x − min x), with the max and min taken over each sample's own source
        (all its pixels; for text, the word embeddings of its non-padding positions). The paper's
        recommended range is 10–20%; default 0.15.
    multiply_by_input : M(z) = z ⊙ ∂f_t/∂z, SmoothGrad of input × gradient, evaluated at the noisy
        input z (the paper's Eq. 3 applied to input × gradient, as its §4 combines SmoothGrad with
        other methods). Default True, because the plain gradient summed over an embedding (or over
        the colour channels) is a directional derivative along the all-ones vector, not an
        attribution of the token; with ×input the token score is the first-order contribution of
        the embedding itself, consistent with ``input_x_gradient``. False: M(z) = ∂f_t/∂z, summed
        over the channels / embedding size, signed (the paper visualizes its absolute value; take
        ``.abs()`` yourself if you want that).
    batch_size : noisy copies per re-run of the model; see :class:`Reruns` (with a callable target
        each re-run carries the explained batch, one noisy copy of every sample).
    seed : seed of the noise (see :func:`smoothgrad_noise`): results are reproducible, and a
        sample explains identically alone or in a batch. Every sample of a batch gets the same
        standard-normal draws ε_s, scaled by its own σ.
    """
    if not isinstance(n_samples, int) or n_samples < 1:
        raise MethodError(f"smoothgrad: n_samples must be a positive int, not {n_samples!r}")
    if noise_level < 0:
        raise MethodError(f"smoothgrad: noise_level must be >= 0, not {noise_level!r}")
    x = _source(trace, "smoothgrad")
    b = x.shape[0]
    valid = _valid_positions(trace, x)
    flat = x.reshape(b, -1) if valid is None else None
    if valid is None:
        span = flat.amax(1) - flat.amin(1)
    else:
        big = torch.finfo(x.dtype).max
        span = (torch.where(valid[..., None], x, -big).reshape(b, -1).amax(1)
                - torch.where(valid[..., None], x, big).reshape(b, -1).amin(1))
        span = torch.where(valid.any(1), span, torch.zeros_like(span))
    sigma = noise_level * span  # [batch]
    eps = smoothgrad_noise(seed, x.shape[1:], n_samples).to(x.device)

    reruns = Reruns(trace, batch_size)
    acc = torch.zeros_like(x)
    runs = reruns.plan([n_samples] * b)
    with reruns.progress(n_samples * b, "smoothgrad") as bar:
        for run in runs:
            session = reruns.session_for(run)
            r, c, ok = run.rows.to(x.device), run.copies.to(x.device), run.valid

            def perturb(v, r=r, c=c):
                return v + _per_sample(sigma[r], v) * eps[c].to(v.dtype)

            z, g = session.source_gradient(perturb)
            m = z * g if multiply_by_input else g
            m = m * _per_sample(ok.to(x.device).float(), m)
            acc.index_add_(0, r, m.to(acc))
            bar.update(run.count)
    return reduce_source(trace, acc / n_samples)


# ---------------------------------------------------------------- Integrated Gradients

def _baseline(baseline: Union[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    if isinstance(baseline, str):
        if baseline != "zero":
            raise MethodError(f"integrated_gradients: baseline must be 'zero' or a tensor, not {baseline!r}")
        return torch.zeros_like(x)
    if not torch.is_tensor(baseline):
        raise MethodError(f"integrated_gradients: baseline must be 'zero' or a tensor, not {type(baseline).__name__}")
    try:
        return torch.broadcast_to(baseline.to(device=x.device, dtype=x.dtype), x.shape).clone()
    except RuntimeError:
        raise MethodError(f"integrated_gradients: baseline of shape {tuple(baseline.shape)} does not broadcast "
                          f"to the source's shape {tuple(x.shape)} (pixels [batch, C, H, W] or word embeddings "
                          "[batch, positions, hidden])") from None


@method("integrated_gradients",
        description="Integrated Gradients from a zero (or given) baseline to the input, midpoint Riemann sum",
        class_specific=True, signed=True,
        reference="Sundararajan et al. 2017, 'Axiomatic attribution for deep networks', Eq. 1 and §5 (Riemann sum)",
        needs_relevance=False, needs_blocks=False, streams=2, checks_only=True)
def integrated_gradients(trace, baseline: Union[str, torch.Tensor] = "zero", n_steps: int = 32,
                         batch_size: int = 32):
    """Integrated Gradients (Sundararajan et al. 2017, Eq. 1), approximated by a Riemann sum (§5):
    IG(x) = (x − x₀) ⊙ 1/m Σ_{k=0..m-1} ∂f_t/∂x (x₀ + α_k (x − x₀)), α_k = (k + ½)/m,
    reduced like ``input_x_gradient`` (sum over colour channels / embedding size; signed).

    The paper's §5 writes the right Riemann sum (α_k = k/m, k = 1..m); the midpoint rule used here
    has error O(1/m²) instead of O(1/m) for the same cost, so completeness
    (Σ IG = f(x) − f(x₀), the paper's Prop. 1) holds more tightly at a given ``n_steps``.

    Parameters
    ----------
    baseline : x₀. ``"zero"`` (default): black/zero pixels (for normalized images, the dataset's
        mean colour), or zero word embeddings (position and segment embeddings stay as they are:
        they are not part of the source). Or a tensor broadcastable to the source, e.g. a [C, H, W]
        image or the [hidden] embedding of [PAD].
    n_steps : m, the number of points on the straight path (default 32; the paper suggests 20 to
        300 and checking completeness).
    batch_size : path points per re-run of the model; see :class:`Reruns`.
    """
    if not isinstance(n_steps, int) or n_steps < 1:
        raise MethodError(f"integrated_gradients: n_steps must be a positive int, not {n_steps!r}")
    x = _source(trace, "integrated_gradients")
    x0 = _baseline(baseline, x)
    b = x.shape[0]
    alphas = (torch.arange(n_steps, dtype=torch.float64) + 0.5) / n_steps
    alphas = alphas.to(device=x.device, dtype=x.dtype)
    reruns = Reruns(trace, batch_size)
    acc = torch.zeros_like(x)
    with reruns.progress(n_steps * b, "integrated_gradients") as bar:
        for run in reruns.plan([n_steps] * b):
            session = reruns.session_for(run)
            r, c, ok = run.rows.to(x.device), run.copies.to(x.device), run.valid

            def perturb(v, r=r, c=c):
                base = x0[r].to(v.dtype)
                return base + _per_sample(alphas[c], v) * (v - base)

            _, g = session.source_gradient(perturb)
            g = g * _per_sample(ok.to(x.device).float(), g)
            acc.index_add_(0, r, g.to(acc))
            bar.update(run.count)
    attributions = (x - x0) * acc / n_steps
    out = reduce_source(trace, attributions)
    # completeness (the paper's Prop. 1): Σ IG = f(x) − f(x₀); captum's convergence delta is the difference
    at_baseline = trace.session.source_scores(lambda v: x0.to(v.dtype))
    total = attributions.reshape(b, -1).sum(1)
    out["convergence_delta"] = total - (promote(trace.target_scores).to(total) - at_baseline.to(total))
    return out
