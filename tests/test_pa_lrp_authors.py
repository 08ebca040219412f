"""``"pa_lrp"`` against the PA-LRP authors' own code (YardenBakish/PE-AWARE-LRP, Bakish et al., NeurIPS
2025), run from a checkout whose path is in the environment variable ``PA_LRP_AUTHORS_CHECKOUT`` (the
repository root: ``NLP/lxt/`` and ``modules/layers_ours.py``). Without it the tests skip.

* RoPE: the tiny RoPE model of ``tests/test_pa_lrp.py`` written with the authors' LXT functions as their
  ``NLP/lxt/models/llama_PE.py`` writes the rotation (``lf.add2(lf.mul2(q, cos), lf.mul2(rotate_half(q),
  sin))`` with cos/sin requiring gradients, ``rotate_half`` with ``lf.mul2(x2, -1)``), ε-rule linear maps
  and mean (``lf.linear_epsilon``, ``lf.mean``); relevance as their ``NLP/llama_engine.py`` reads it with
  ``--pe --single-norm --without-abs``: ``input_embeds.grad.sum(-1)`` plus ``cos.grad.sum(-1)`` and
  ``sin.grad.sum(-1)`` (the signed sum; the other flags normalize or take |·| and are not conservative).
  Their ``llama_PE.py`` itself imports transformers 4 internals (``transformers.modeling_attn_mask_utils``)
  and cannot be imported under transformers 5.
* learned position embeddings: their ``modules/layers_ours.Add`` (ε-rule, ``epsilon_rule=True,
  default_op=False``) applied to the tokens and the position embedding of a tiny HF ViT, with the relevance
  entering the first block as relprop's AttnLRP computes it, then ``pos_cam[:, 1:].sum(-1)`` per patch as
  their ``models/model.py`` does (``"full"`` method with ``POS_ENC``); compared with pa_lrp's scores minus
  attnlrp's. (Their ViT's other layers use their own rule mix, not AttnLRP, so only the position step is
  comparable.)

Export a checkout: ``git --git-dir=<mirror> archive HEAD NLP/lxt modules baselines | tar x -C DIR``.
Criteria: Pearson ≥ 0.999 and max relative difference ≤ 1e-3 (of the largest magnitude).
"""
from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch

import models
import relprop
from test_pa_lrp import TinyRope, ids_batch

CHECKOUT = os.environ.get("PA_LRP_AUTHORS_CHECKOUT")
pytestmark = pytest.mark.skipif(not CHECKOUT, reason="set PA_LRP_AUTHORS_CHECKOUT to a checkout of "
                                                     "YardenBakish/PE-AWARE-LRP to compare with the authors' code")


def _import(root: str, name: str):
    """Import module ``name`` from ``root``, then drop it (and the authors' ``lxt``) from sys.modules so that
    the installed LXT stays what other tests import."""
    saved = {k: v for k, v in sys.modules.items() if k == "lxt" or k.startswith(("lxt.", "modules"))}
    for k in saved:
        del sys.modules[k]
    sys.path.insert(0, root)
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(root)
        for k in [k for k in sys.modules if k == "lxt" or k.startswith(("lxt.", "modules"))]:
            del sys.modules[k]
        sys.modules.update(saved)


def agreement(ours: torch.Tensor, theirs: torch.Tensor):
    """(Pearson correlation, max |ours − theirs| / max |theirs|)."""
    a, b = ours.detach().double().flatten(), theirs.detach().double().flatten()
    pearson = float(torch.corrcoef(torch.stack([a, b]))[0, 1])
    return pearson, float((a - b).abs().max() / b.abs().max())


def authors_rope(lf, model, ids, target):
    """PA-LRP of TinyRope with the authors' LXT functions, one sample at a time (their engine runs batch 1)."""
    out = []
    w = model.head.weight.detach()
    for i in range(ids.shape[0]):
        e = model.embed.weight.detach()[ids[i:i + 1]].clone().requires_grad_()
        n = ids.shape[1]
        mix = model.mixing(n, w.dtype)
        cos, sin = (t.to(w.dtype).clone().requires_grad_() for t in model.angles(n))
        x = lf.linear_epsilon(e.transpose(1, 2), mix).transpose(1, 2)
        x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
        rot = torch.cat((lf.mul2(x2, -1), x1), dim=-1)  # their rotate_half
        z = lf.add2(lf.mul2(x, cos), lf.mul2(rot, sin))  # their apply_rotary_pos_emb, cos/sin not detached
        y = lf.linear_epsilon(lf.mean(z, 1, False), w)
        sel = y[0, int(target[i])]
        sel.backward(sel)  # their llama_engine: max_logits.backward(max_logits)
        out.append(e.grad.sum(-1)[0] + cos.grad.sum(-1) + sin.grad.sum(-1))
    return torch.stack(out)


def test_rope_equals_authors():
    lf = _import(os.path.join(CHECKOUT, "NLP"), "lxt.functional")
    model = TinyRope()
    ids = ids_batch(batch=4, n=7)
    target = torch.tensor([0, 1, 2, 0])
    ours = relprop.explain(model, ids, target=target, method="lrp", preset="pa_lrp").scores
    theirs = authors_rope(lf, model, ids, target)
    pearson, rel = agreement(ours, theirs)
    print(f"RoPE (TinyRope, 4 samples x 7 tokens): Pearson {pearson:.6f}, max rel. diff {rel:.2e}")
    assert pearson >= 0.999 and rel <= 1e-3


def test_learned_position_embedding_equals_authors():
    layers = _import(CHECKOUT, "modules.layers_ours")
    vit = models.hf_vit("eager")
    x = models.image_batch(vit, batch=2)
    a = relprop.explain(vit, x, target=[0, 1], method="lrp", preset="attnlrp", fast_path=False, keep_blocks=True)
    p = relprop.explain(vit, x, target=[0, 1], method="lrp", preset="pa_lrp")
    pos = vit.vit.embeddings.position_embeddings.detach().expand(x.shape[0], -1, -1)
    with torch.no_grad():
        h = vit.vit.embeddings(x)
    add = layers.Add()
    add([h - pos, pos])  # their forward hook keeps the operands
    _, pos_cam = add.relprop(a.blocks[0].hidden_relevance.float(), alpha=1, epsilon_rule=True, gamma_rule=False,
                             default_op=False, conv_gamma_rule=False)
    theirs = pos_cam[:, 1:, :].sum(dim=2)  # models/model.py, method "full" with POS_ENC, per patch
    pearson, rel = agreement(p.scores - a.scores, theirs)
    print(f"learned PE (HF ViT, 2 images x 16 patches): Pearson {pearson:.6f}, max rel. diff {rel:.2e}")
    assert pearson >= 0.999 and rel <= 1e-3
