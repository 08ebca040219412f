"""No silent untrustworthy relevance: a map whose relevance the rules amplified, or whose books do not
balance, says so.

LRP's conservation (Bach et al. 2015, Eq. 2; CVPR 2021, Lemma 1 and 2; AttnLRP Eq. 3) is a balance:
the relevance injected at the output equals what reaches the input plus what the rules book as
absorbed (biases, constants, stabilizers). Two things go wrong without the picture showing it:

* **the books do not balance** (the ledger's relative error ``|injected − input − absorbed| / |injected|``
  above :data:`OPEN`): the preset's rules create or destroy relevance they do not book (plain LRP's
  ``"lrp"`` preset on a real model, a rule that is not conservative); the warning names the largest
  booked share and the conservative presets;
* **the books balance, by amplification** (the input relevance more than :data:`AMPLIFIED` times the
  injected relevance, or of the opposite sign and larger than it): an ε-rule on a sum that nearly cancels
  (z = a + b with a ≈ −b) hands each side a share many times the output's, and an equal and opposite share
  is booked elsewhere (a bias, a constant), so the ledger closes while the map is dominated by the
  cancellation. The warning names the block where the relevance grows most (the ledger's per-block
  books, ``exp.conservation.blocks``) and the largest absorbed share.

:func:`check` reads its values with the call's other checks (:func:`relprop.graph.host_reads.later`):
no host round trip of its own.
"""
from __future__ import annotations

from typing import List, Optional

import torch

from ..errors import warn
from ..graph.host_reads import later
from ..rules.stabilize import promote

#: the ledger does not close when its relative error exceeds this
OPEN = 0.05
#: the input relevance is amplified when its |sum| exceeds this many times the |injected| relevance
AMPLIFIED = 10.0


def check(method: str, preset: Optional[str], trace, input_relevance, notes: List[str]) -> None:
    """Warn (:class:`relprop.RelpropWarning`) and add a note when some sample's relevance does not balance,
    or balances only by amplification (see the module docstring). ``input_relevance``: the relevance that
    reached the explained input ([batch, ...]); ``trace``: its :class:`relprop.engine.trace.Trace`."""
    c = getattr(trace, "conservation", None)
    injected = c.injected if c is not None else getattr(trace, "injected", None)
    if not torch.is_tensor(input_relevance) or not torch.is_tensor(injected) or input_relevance.dim() < 1:
        return
    batch = injected.shape[0]
    if input_relevance.shape[0] != batch:
        return
    device = injected.device
    reached = promote(input_relevance.detach()).reshape(batch, -1).sum(1).to(device)
    rows = [promote(injected.detach()), reached]
    error = c.error if c is not None else torch.zeros_like(rows[0])
    rows.append(promote(error).to(device))
    labels = list(c.absorbed_by) if c is not None else []
    rows += [_per_sample(c.absorbed_by[k], batch, device) for k in labels]
    blocks = list(c.blocks) if c is not None else []
    for b in blocks:
        rows += [_per_sample(b.relevance_in, batch, device), _per_sample(b.relevance_out, batch, device)]
    values = torch.stack([r.to(rows[0].dtype) for r in rows]).reshape(-1)
    ledger = c is not None

    def read(v):
        def row(i):
            return v[i * batch:(i + 1) * batch]
        inj, got, err = row(0), row(1), row(2)
        absorbed = {k: row(3 + i) for i, k in enumerate(labels)}
        base = 3 + len(labels)
        growth = [(b.name, row(base + 2 * i), row(base + 2 * i + 1)) for i, b in enumerate(blocks)]
        unbalanced = [s for s in range(batch) if ledger and err[s] > OPEN]
        amplified = [s for s in range(batch) if s not in unbalanced and _amplified(inj[s], got[s])]
        if unbalanced:
            s = unbalanced[0]
            message = (f"{method}: the relevance of sample(s) {_few(unbalanced)} does not balance under preset "
                       f"'{preset}': injected {inj[s]:.4g} at the output, {got[s]:.4g} reached the input, "
                       f"{sum(a[s] for a in absorbed.values()):.4g} booked as absorbed (relative error "
                       f"{err[s]:.3g}). {_largest(absorbed, s)}The preset's rules create or lose relevance they do not "
                       "book, so the map's magnitudes (and possibly its signs) are not the output's; the conservative "
                       "presets 'attnlrp' and 'cp_lrp' balance")
            notes.append(message)
            warn(message)
        if amplified:
            s = amplified[0]
            ratio = abs(got[s]) / max(abs(inj[s]), 1e-30)
            flip = (got[s] > 0) != (inj[s] > 0)
            where = _growth(growth, s, ledger)
            message = (f"{method}: the relevance of sample(s) {_few(amplified)} reaching the input is {ratio:.3g}x "
                       f"the relevance injected at the output ({got[s]:.4g} against {inj[s]:.4g}"
                       f"{', of the opposite sign' if flip else ''}) under preset '{preset}'"
                       f"{' while the ledger balances' if ledger else ''}: the rules amplified it (an ε-rule on a "
                       "sum that nearly cancels gives each side a share many times the output's, and the opposite "
                       f"share is booked elsewhere). {where}{_largest(absorbed, s)}Such a map shows the "
                       "cancellation, not what drove the score; compare with a gradient method (input_x_gradient) "
                       "or another preset")
            notes.append(message)
            warn(message)

    later(values, read)


def _per_sample(t, batch: int, device) -> torch.Tensor:
    t = promote(torch.as_tensor(t)).to(device)
    return t.reshape(-1)[:batch] if t.numel() >= batch else t.reshape(-1).expand(batch)


def _amplified(injected: float, reached: float) -> bool:
    if injected == 0 or reached != reached or injected != injected:
        return False
    ratio = abs(reached) / abs(injected)
    return ratio > AMPLIFIED or ((reached > 0) != (injected > 0) and reached != 0 and ratio > 1.0)


def _largest(absorbed: dict, s: int) -> str:
    if not absorbed:
        return ""
    label = max(absorbed, key=lambda k: abs(absorbed[k][s]))
    if absorbed[label][s] == 0:
        return ""
    return f"The largest absorbed share: {absorbed[label][s]:.4g} by {label}. "


def _growth(growth: list, s: int, ledger: bool) -> str:
    """The block whose relevance leaving it (towards the input) is the largest multiple of what entered it
    (without a ledger: where to find it)."""
    best, best_ratio = None, 0.0
    for name, r_in, r_out in growth:
        ratio = abs(r_out[s]) / max(abs(r_in[s]), 1e-30)
        if ratio > best_ratio:
            best, best_ratio = name, ratio
    if not ledger:
        return ("The per-block books (exp.conservation.blocks, kept by the rule-by-rule walk: explain(..., "
                "fast_path=False)) show where it grows. ")
    if best is None or best_ratio <= 1.0:
        return "No attention block multiplies it: it grows outside them. " if growth else ""
    return f"It grows most in block '{best}' ({best_ratio:.3g}x what entered it). "


def _few(samples: list) -> list:
    return samples if len(samples) <= 8 else samples[:8] + ["..."]
