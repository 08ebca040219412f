"""The presets relprop defines here, before any rule module registers its rules: ``"base"`` (the
shape-only routing every preset shares), ``"chefer2021"`` and ``"lrp"``. The rule modules fill their tables;
``"attnlrp"``, ``"cp_lrp"`` and ``"pa_lrp"`` are defined with their rules (``relprop.rules.attnlrp``,
``relprop.rules.cp_lrp``, ``relprop.rules.pa_lrp``)."""
from __future__ import annotations

from .preset_table import Preset

BASE = Preset("base", extends=(), description="shape-only routing shared by every preset", seed="gradient",
              rule_kind="structural")
CHEFER2021 = Preset(
    "chefer2021", extends=BASE,
    description="Chefer, Gur & Wolf, CVPR 2021, as its authors' code applies it: LRP-alpha1beta0 linear layers, "
                "normalized residual adds (Lemma 2), halved attention products (Lemma 1), z^B patch embedding")
LRP = Preset(
    "lrp", extends=BASE, conservative=False,
    description="the paper's plain-LRP baseline as the authors' layers_lrp.py computes it: "
                "plain z-rule sums, linear layers and convolutions with separate denominators for x+W+ and x-W-; "
                "NOT conservative (a linear layer fed by both signs returns about twice its relevance)")
