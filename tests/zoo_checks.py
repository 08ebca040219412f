"""Checks of one ``relprop.explain`` call on one model of the zoo (``tests/zoo.py``), against
computations that do not use relprop's engine. Shared by ``tests/test_zoo.py`` and
``benchmarks/zoo_report.py``.

The outcome of a (model, method) cell is either a correct result or a :class:`relprop.RelpropError`
that says why; anything else is a failure:

* ``refused``: explain() raised a RelpropError with a message (fine);
* ``crash``: another exception leaked out of explain() (a torch RuntimeError, a TypeError, ...);
* ``wrong``: explain() returned, and one of the checks below failed.

The checks (each failure names the check):

``finite``       scores, matrix and map hold no NaN or inf.
``layout``       one score per input position: text [batch, tokens] with padding masked out and
                 scored 0; images [batch, rows*cols] on the patch grid the entry states.
``blocks``       (rollout-style methods) every token-to-token self-attention block of the model is
                 among ``exp.blocks``, so the rollout includes it.
``query``        (rollout-style methods) the scores are the query-weighted rows of ``exp.matrix``, the
                 query being the uniform mean over the token states the target depends on, found by
                 back-propagating the target through a deep copy of the model to the output of the last
                 block (a forward hook with ``retain_grad``): rows with a non-zero gradient. Also
                 compares ``exp.query`` when relprop exposes it.
``batch``        a batch gives each sample's scores alone (texts trimmed to their length), to 1e-5 of
                 the largest |score| (1e-4 for lrp's signed scores).
``shuffle``      (models that permute their tokens, ViTMAE) other shuffles give the same scores per
                 input patch as the unshuffled input.
``conservation`` (lrp under "attnlrp") the rule-by-rule walk (``fast_path=False``) conserves: injected
                 = input + absorbed to 1e-4 per sample; the default (fast-path) scores equal it.
``untouched``    the model's parameters, buffers, flags, hooks and classes are the same afterwards
                 (also when explain() raised).
"""
from __future__ import annotations

import copy
import dataclasses
import re
import time
import traceback
from typing import Dict, List, Optional, Tuple

import torch

import relprop
from snapshot import assert_same, snapshot
from zoo import METHODS, ZOO, Entry

ROLLOUT_STYLE = ("transformer_attribution", "rollout", "gradient_rollout")
BATCH_TOL = 1e-5  # of the largest |score|
#: lrp's signed relevance: most of it can be absorbed by constants (position embeddings), leaving input
#: scores ~100x smaller than the relevance that flowed through the model, whose float32 rounding they carry
#: (in float64 the batch and the samples agree exactly)
BATCH_TOL_SIGNED = 1e-4
QUERY_TOL = 1e-5
SHUFFLE_TOL = 1e-4  # another token order sums in another order
CONSERVATION_TOL = 1e-4
FAST_PATH_TOL = 1e-4
BATCH = 2
TEXT_KEYS = ("input_ids", "inputs", "attention_mask", "token_type_ids", "position_ids")


class Wrong(AssertionError):
    """A check failed: the message says by how much."""


class Crash(Exception):
    """A non-relprop exception leaked out of a second explain() call of a check."""

    def __init__(self, error: BaseException, where: str):
        super().__init__(f"{where}: {type(error).__name__}: {error}")
        self.error, self.where = error, where


class Refused(Exception):
    """A second explain() call of a check raised a RelpropError although the first call succeeded."""

    def __init__(self, error: BaseException, where: str):
        super().__init__(f"{where} was refused ({type(error).__name__}: {_first_line(error)}) although the "
                         "first call was explained")
        self.error = error


@dataclasses.dataclass
class Outcome:
    model: str
    method: str
    status: str  # "ok" | "refused" | "wrong" | "crash"
    failures: List[str]  # "check: detail", in the order they were found
    error: Optional[BaseException] = None
    trace: str = ""
    seconds: float = 0.0
    where: str = ""  # for a crash in a check's own explain() call: which check and call

    @property
    def passed(self) -> bool:
        return self.status in ("ok", "refused") and not self.failures

    def message(self) -> str:
        """What the test prints: the model, the method and every failed check."""
        head = f"[{self.model} × {self.method}] "
        if self.status == "crash":
            where = f" (the {self.where})" if self.where else ""
            head += f"CRASH: {type(self.error).__name__} leaked out of explain(){where}: {self.error}"
            rest = [f"  also: {f}" for f in self.failures]
            return "\n".join([head] + rest + ["", self.trace])
        lines = [head + f"{len(self.failures)} check(s) failed after explain() "
                 + ("was refused" if self.status == "refused" else "returned")]
        lines += [f"  {f}" for f in self.failures]
        return "\n".join(lines)

    def cell(self, width: int = 90) -> str:
        """The report's cell: ok / refused: ... / WRONG: ... / CRASH: ..."""
        if self.status == "crash":
            where = f"[{self.where}] " if self.where else ""
            text = f"CRASH: {type(self.error).__name__}: {where}{_first_line(self.error)}"
        elif self.failures:
            text = "WRONG: " + "; ".join(self.failures)
        elif self.status == "refused":
            text = f"refused: {type(self.error).__name__}: {_first_line(self.error)}"
        else:
            text = "ok"
        text = text.replace("|", "\\|").replace("\n", " ")
        return text if len(text) <= width else text[:width - 1] + "…"


def _first_line(error: BaseException) -> str:
    s = str(error).strip()
    return s.splitlines()[0] if s else ""


# ------------------------------------------------------------------ models, inputs, targets

_MODELS: Dict[str, torch.nn.Module] = {}


def get_model(name: str) -> torch.nn.Module:
    """Each model of the zoo built once per process (explain() must leave it untouched)."""
    if name not in _MODELS:
        _MODELS[name] = ZOO[name].build()
    return _MODELS[name]


def forward(model, inputs):
    return model(**inputs) if isinstance(inputs, dict) else model(inputs)


def explain(model, inputs, entry: Entry, method: str, where: str, **extra):
    """relprop.explain with the entry's target and explained input; a RelpropError in a check's
    call is :class:`Refused`, any other exception :class:`Crash`."""
    try:
        return relprop.explain(model, inputs, target=entry.target, wrt=entry.wrt, **METHODS[method], **extra)
    except relprop.RelpropError as err:
        raise Refused(err, where) from err
    except Exception as err:  # noqa: BLE001 - what leaks out is the finding
        raise Crash(err, where) from err


def primary(entry: Entry, inputs) -> torch.Tensor:
    if torch.is_tensor(inputs):
        return inputs
    key = entry.wrt or next(k for k in ("input_ids", "pixel_values", "input_values", "input_features") if k in inputs)
    return inputs[key]


def logits_of(outputs) -> torch.Tensor:
    if torch.is_tensor(outputs):
        return outputs
    if torch.is_tensor(getattr(outputs, "logits", None)):
        return outputs.logits
    return outputs[0]


def target_scores(entry: Entry, outputs, inputs) -> torch.Tensor:
    """The [batch] scores the entry's target explains, computed from the model's outputs."""
    t = entry.target
    if callable(t):
        return t(outputs)
    logits = logits_of(outputs)
    if t == "next_token":  # the predicted token's logit at the last real position
        mask = inputs["attention_mask"]
        idx = torch.arange(mask.shape[1])
        last = torch.where(mask.bool(), idx, -1).amax(1)
        rows = logits[torch.arange(logits.shape[0]), last]
        return rows.gather(1, rows.detach().argmax(-1, keepdim=True))[:, 0]
    return logits[:, t]


def sample(entry: Entry, inputs, i: int, batch: int):
    """Sample ``i`` alone; a text trimmed to its real positions (padded on either side)."""
    if torch.is_tensor(inputs):
        return inputs[i:i + 1]
    one = {k: v[i:i + 1] if torch.is_tensor(v) and v.dim() >= 1 and v.shape[0] == batch else v
           for k, v in inputs.items()}
    if entry.modality == "text" and torch.is_tensor(one.get("attention_mask")):
        real = one["attention_mask"][0] != 0
        one = {k: v[:, real] if k in TEXT_KEYS and torch.is_tensor(v) else v for k, v in one.items()}
    return one


# ------------------------------------------------------------------ the reference query

def _first_tensor(out):
    if torch.is_tensor(out):
        return out
    if isinstance(out, (tuple, list)):
        return next((o for o in out if torch.is_tensor(o)), None)
    hidden = getattr(out, "last_hidden_state", None)
    return hidden if torch.is_tensor(hidden) else None


_SUPPORT: Dict[Tuple[str, str], torch.Tensor] = {}


def output_gradient(entry: Entry, model, inputs, layer: str) -> torch.Tensor:
    """d target / d (output of module ``layer``) on a deep copy of the model, captured by a forward
    hook with retain_grad (the last call of the module if it runs several times)."""
    key = (entry.name, layer)
    if key in _SUPPORT:
        return _SUPPORT[key]
    ref = copy.deepcopy(model).eval()
    try:
        module = ref.get_submodule(layer)
    except AttributeError:
        raise Wrong(f"exp.blocks[-1].layer = {layer!r} is not a module of the model") from None
    seen = []

    def hook(mod, args, out):
        t = _first_tensor(out)
        if t is not None and t.requires_grad:
            t.retain_grad()
            seen.append(t)

    handle = module.register_forward_hook(hook)
    try:
        with torch.enable_grad():
            scores = target_scores(entry, forward(ref, inputs), inputs)
            scores.sum().backward()
    finally:
        handle.remove()
    if not seen:
        raise Wrong(f"module {layer!r} produced no differentiable tensor (no token states to read the query from)")
    grad = seen[-1].grad
    grad = torch.zeros_like(seen[-1]) if grad is None else grad.detach()
    _SUPPORT[key] = grad
    return grad


def token_rows(grad: torch.Tensor, batch: int, n_rows: int, layer: str) -> torch.Tensor:
    """[batch, n_rows] bool: which token states of the block output have a non-zero gradient.
    [batch, N, C]; [batch, H, W, C] or [batch, C, H, W] (N = H*W); [k*batch, N, C] (k groups of
    tokens folded into the batch, batch-major) read as [batch, k*N, C]; sequence-major [N, batch, C]."""
    g = grad.abs()
    candidates = []
    if g.dim() == 3 and g.shape[0] == batch:
        candidates.append(g.sum(-1))
    if g.dim() == 4 and g.shape[0] == batch:
        candidates += [g.sum(-1).flatten(1), g.sum(1).flatten(1)]
    if g.dim() == 3 and g.shape[0] != batch and g.shape[1] == batch:  # sequence-major [N, batch, C] (XLNet)
        candidates.append(g.sum(-1).t())
    if g.dim() == 3 and g.shape[0] != batch and g.shape[0] % batch == 0:
        candidates.append(g.reshape(batch, -1, g.shape[-1]).sum(-1))
    fits = [c for c in candidates if c.shape[1] == n_rows]
    if not fits:
        raise Wrong(f"exp.matrix has {n_rows} rows but the output of {layer!r} has shape {tuple(grad.shape)}, "
                    f"not {n_rows} token states of {batch} samples")
    return fits[0] != 0


def describe_rows(rows: torch.Tensor) -> str:
    """'[0]', '[0..15]', '[1, 3, 5]' for a 1-d bool tensor."""
    idx = rows.nonzero()[:, 0].tolist()
    if not idx:
        return "[] (none)"
    if idx == list(range(idx[0], idx[-1] + 1)) and len(idx) > 2:
        return f"[{idx[0]}..{idx[-1]}]"
    return str(idx) if len(idx) <= 6 else f"[{idx[0]}, {idx[1]}, ..., {idx[-1]}] ({len(idx)} rows)"


def _which_rows(matrix: torch.Tensor, got: torch.Tensor, cols: slice, mask: Optional[torch.Tensor]) -> str:
    """What relprop's scores are, when they are a single row or the mean of all rows of the matrix."""
    scale = float(got.abs().max()) or 1.0
    for r in range(matrix.shape[0]):
        ref = matrix[r, cols]
        if mask is not None:
            ref = ref * mask
        if float((ref - got).abs().max()) <= QUERY_TOL * scale:
            return f"row {r}"
    ref = matrix.mean(0)[cols]
    if mask is not None:
        ref = ref * mask
    if float((ref - got).abs().max()) <= QUERY_TOL * scale:
        return "the mean of all rows"
    return "no single row"


# ------------------------------------------------------------------ the checks

def check_finite(exp, **_):
    for field in ("scores", "matrix", "map"):
        t = getattr(exp, field, None)
        if torch.is_tensor(t) and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise Wrong(f"exp.{field} holds {bad} NaN/inf values")


def check_layout(exp, entry: Entry, inputs, **_):
    x = primary(entry, inputs)
    batch = x.shape[0]
    if exp.scores.shape[0] != batch:
        raise Wrong(f"exp.scores has {exp.scores.shape[0]} rows for {batch} samples")
    if entry.modality == "text":
        if tuple(exp.scores.shape) != tuple(x.shape):
            raise Wrong(f"exp.scores has shape {tuple(exp.scores.shape)}, the token ids {tuple(x.shape)}")
        am = inputs.get("attention_mask") if isinstance(inputs, dict) else None
        if torch.is_tensor(am) and tuple(am.shape) == tuple(x.shape):
            pad = am == 0
            if exp.mask is None or bool(exp.mask[pad].any()):
                raise Wrong("padding positions are not masked out (exp.mask True at attention_mask 0)")
            if bool((exp.scores[pad] != 0).any()):
                raise Wrong(f"padding positions score {float(exp.scores[pad].abs().max()):.3g} (not 0)")
    elif entry.grid is not None:
        gh, gw = entry.grid
        if exp.grid is not None and tuple(exp.grid) != (gh, gw):
            raise Wrong(f"exp.grid is {tuple(exp.grid)}, the model's patch grid is {(gh, gw)}")
        if tuple(exp.scores.shape) != (batch, gh * gw):
            raise Wrong(f"exp.scores has shape {tuple(exp.scores.shape)}, not one score per patch of the "
                        f"{gh}x{gw} grid ({(batch, gh * gw)})")


def check_blocks(exp, entry: Entry, method: str, **_):
    if method not in ROLLOUT_STYLE or entry.attention_blocks is None:
        return
    square = [b for b in exp.blocks if b.attention.dim() >= 3 and b.attention.shape[-1] == b.attention.shape[-2]]
    if len(square) < entry.attention_blocks:
        names = ", ".join(f"{b.layer} {tuple(b.attention.shape)}" for b in exp.blocks) or "none"
        raise Wrong(f"{len(square)} of the model's {entry.attention_blocks} self-attention blocks are in exp.blocks "
                    f"(the rollout leaves the others out); recorded: {names}")


def query_support(exp, entry: Entry, model, inputs) -> Tuple[torch.Tensor, str]:
    """[batch, rows of exp.matrix] bool, the token states the target depends on, and the module they
    were read at: the entry's candidates, then the layer of the last token-to-token block relprop
    recorded, then the layer of its last block; the first whose output holds as many token states as
    exp.matrix has rows."""
    m = exp.matrix
    square = [b for b in exp.blocks if b.attention.dim() >= 3 and b.attention.shape[-1] == b.attention.shape[-2]]
    layers = list(entry.query_layers) + [b.layer for b in square[-1:] + exp.blocks[-1:]]
    layers = list(dict.fromkeys(layers))
    if not layers:
        raise Wrong("exp.matrix but no exp.blocks: the last block is unknown")
    misfits = []
    for layer in layers:
        try:
            return token_rows(output_gradient(entry, model, inputs, layer), m.shape[0], m.shape[1], layer), layer
        except Wrong as w:
            misfits.append(str(w))
    raise Wrong("; ".join(misfits))


def check_query(exp, entry: Entry, model, inputs, method: str, **_):
    if method not in ROLLOUT_STYLE:
        return
    m = exp.matrix
    if m is None or m.dim() != 3:
        raise Wrong(f"no [batch, tokens, tokens] exp.matrix (got {None if m is None else tuple(m.shape)})")
    rows, layer = query_support(exp, entry, model, inputs)
    if not bool(rows.any(1).all()):
        raise Wrong(f"the target does not depend on the output of {layer!r} for some sample")
    w = rows.to(m.dtype) / rows.sum(1, keepdim=True).to(m.dtype)
    q = getattr(exp, "query", None)
    if torch.is_tensor(q):
        if tuple(q.shape) != tuple(w.shape):
            raise Wrong(f"exp.query has shape {tuple(q.shape)}, the query over {layer!r}'s tokens {tuple(w.shape)}")
        err = float((q.to(w.dtype) - w).abs().max())
        if err > 1e-6:
            i = int((q.to(w.dtype) - w).abs().amax(1).argmax())
            raise Wrong(f"exp.query of sample {i} differs from the rows the head reads, "
                        f"{describe_rows(rows[i])} (max diff {err:.3g})")
    expected = (w[:, :, None] * m).sum(1)  # [batch, tokens]
    batch, n = exp.scores.shape
    if entry.modality == "vision":
        prefix = expected.shape[1] - n
        if prefix < 0 or exp.prefix_tokens != prefix:
            raise Wrong(f"exp.matrix has {expected.shape[1]} columns for {n} patch scores, "
                        f"exp.prefix_tokens = {exp.prefix_tokens}")
        cols, mask = slice(prefix, None), None
        expected = expected[:, cols]
    else:
        if expected.shape[1] != n:
            raise Wrong(f"exp.matrix has {expected.shape[1]} columns for {n} token scores")
        cols, mask = slice(None), exp.mask
        expected = expected * mask
    # the query row of C is Eq. 14's reading (identity="keep"); the default leaves out the query rows' own
    # identity share (relprop.methods.identity): the same scores off the query rows, no more than them on them
    kept = explain(model, inputs, entry, method, "identity='keep'", identity="keep")
    for i in range(batch):
        got, ref = kept.scores[i], expected[i]
        scale = max(float(ref.abs().max()), float(got.abs().max()), 1e-12)
        err = float((got - ref).abs().max()) / scale
        if err > QUERY_TOL:
            what = _which_rows(m[i], got, cols, None if mask is None else mask[i])
            raise Wrong(f"sample {i}: off by {err:.3g} of the max |score|: the scores are {what} of exp.matrix, "
                        f"the head reads rows {describe_rows(rows[i])} of {layer!r} (their mean is the query)")
    if m.shape[-1] == m.shape[-2] and exp.scores.shape == kept.scores.shape:
        on = (w[:, cols] if entry.modality == "vision" else w) > 0
        if not torch.equal(exp.scores[~on], kept.scores[~on]):
            raise Wrong("the default scores differ from identity='keep' off the query rows")
        scale = max(float(kept.scores.abs().max()), 1e-12)
        if bool((exp.scores[on] > kept.scores[on] + QUERY_TOL * scale).any()) or \
                bool((exp.scores < -QUERY_TOL * scale).any()):
            raise Wrong("the default scores at the query rows are not q·C less a non-negative identity share")


def check_batch(exp, entry: Entry, model, inputs, method: str, **_):
    x = primary(entry, inputs)
    batch = x.shape[0]
    for i in range(batch):
        one = sample(entry, inputs, i, batch)
        alone = explain(model, one, entry, method, f"sample {i} alone")
        a, f = alone.scores[0], exp.scores[i]
        n = a.shape[0]
        if entry.modality == "text":
            am = inputs.get("attention_mask") if isinstance(inputs, dict) else None
            real = am[i] != 0 if torch.is_tensor(am) else torch.arange(f.shape[0]) < n
            if bool((f[~real] != 0).any()):
                raise Wrong(f"sample {i}: padding positions {torch.nonzero(~real).flatten().tolist()} score "
                            f"{float(f[~real].abs().max()):.3g}")
            f = f[real]
        if f.shape != a.shape:
            raise Wrong(f"sample {i}: {tuple(f.shape)} scores in the batch, {tuple(a.shape)} alone")
        scale = max(float(a.abs().max()), float(f.abs().max()), 1e-12)
        err = float((f - a).abs().max()) / scale
        if not err <= (BATCH_TOL_SIGNED if exp.signed else entry.batch_tol or BATCH_TOL):
            raise Wrong(f"sample {i}: the batch's scores differ from the sample's alone by {err:.3g} "
                        f"of the max |score|")


def check_shuffle(exp, entry: Entry, model, inputs, method: str, **_):
    if entry.shuffled is None:
        return
    for seed in (1, 2):
        other = explain(model, entry.shuffled(model, inputs, seed), entry, method, f"shuffle {seed}")
        for i in range(exp.scores.shape[0]):
            got, ref = other.scores[i], exp.scores[i]
            scale = max(float(ref.abs().max()), 1e-12)
            err = float((got - ref).abs().max()) / scale
            if not err <= SHUFFLE_TOL:
                same_values = torch.allclose(got.sort().values, ref.sort().values, rtol=0, atol=SHUFFLE_TOL * scale)
                what = ("; the same values in another order: the scores follow the model's internal token order, "
                        "not the input's patches" if same_values else "")
                raise Wrong(f"shuffle {seed}, sample {i}: off the unshuffled input's scores by {err:.3g} "
                            f"of the max |score|{what}")


def check_conservation(exp, entry: Entry, model, inputs, method: str, **_):
    if METHODS[method].get("preset") != "attnlrp":
        return
    ref = explain(model, inputs, entry, method, "fast_path=False", fast_path=False)
    c = ref.conservation
    if c is None:
        raise Wrong("fast_path=False gave no exp.conservation")
    err = c.error
    if not bool(torch.isfinite(err).all()) or float(err.max()) > CONSERVATION_TOL:
        i = int(torch.nan_to_num(err, nan=float("inf")).argmax())
        raise Wrong(f"sample {i}: injected {float(c.injected[i]):.4g} != input {float(c.input[i]):.4g} + "
                    f"absorbed {float(c.absorbed[i]):.4g} (relative error {float(err[i]):.3g})")
    scale = max(float(ref.scores.abs().max()), 1e-12)
    if exp.scores.shape != ref.scores.shape:
        raise Wrong(f"the default call's scores {tuple(exp.scores.shape)} and fast_path=False's "
                    f"{tuple(ref.scores.shape)} differ in shape")
    diff = float((exp.scores - ref.scores).abs().max()) / scale
    if not diff <= FAST_PATH_TOL:
        raise Wrong(f"the default (fast path) scores differ from fast_path=False's by {diff:.3g} of the max |score|")


CHECKS = [("finite", check_finite), ("layout", check_layout), ("blocks", check_blocks), ("query", check_query),
          ("batch", check_batch), ("shuffle", check_shuffle), ("conservation", check_conservation)]


def run_cell(name: str, method: str) -> Outcome:
    """explain() one zoo model with one method and check the outcome (see the module docstring)."""
    entry = ZOO[name]
    start = time.perf_counter()
    model = get_model(name)
    inputs = entry.inputs(model, BATCH, 0)
    with torch.no_grad():  # models that set attributes in their own forward (Funnel, Wav2Vec2) do so here
        forward(model, inputs)
    before = snapshot(model)
    failures: List[str] = []
    error, trace, status, where = None, "", "ok", ""
    try:
        exp = relprop.explain(model, inputs, target=entry.target, wrt=entry.wrt, **METHODS[method])
    except relprop.RelpropError as err:
        status, error = "refused", err
        if len(str(err).strip()) < 20:
            failures.append(f"refusal: {type(err).__name__} without a message that says why ({str(err)!r})")
        declared = [reason for methods, reason in entry.refusals if re.fullmatch(methods, method)]
        if not declared:
            failures.append(f"undeclared refusal: the zoo entry declares no refusal of this method (a model "
                            f"relprop explains that starts refusing is a regression; a right refusal is declared "
                            f"in tests/zoo.py with its reason): {_first_line(err)}")
        for reason in declared:
            if not re.search(reason, str(err), re.S):
                failures.append(f"reason: the refusal does not say /{reason}/: {_first_line(err)}")
    except Exception as err:  # noqa: BLE001 - what leaks out of explain() is the finding
        status, error, trace = "crash", err, traceback.format_exc()
    else:
        for check, fn in CHECKS:
            try:
                fn(exp=exp, entry=entry, model=model, inputs=inputs, method=method)
            except Wrong as w:
                failures.append(f"{check}: {w}")
            except Refused as r:
                failures.append(f"{check}: {r}")
            except Crash as c:
                status, error, trace = "crash", c.error, "".join(traceback.format_exception(c.error))
                where = f"{check} check's explain(), {c.where}"
                break
    try:
        assert_same(before, snapshot(model))
    except AssertionError as err:
        failures.append(f"untouched: the model changed ({err or 'state differs'})")
    if failures and status == "ok":
        status = "wrong"
    if failures and status == "refused":
        status = "wrong"
    return Outcome(name, method, status, failures, error, trace, time.perf_counter() - start, where)
