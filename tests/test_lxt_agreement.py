"""``explain(method="lrp", preset="attnlrp")`` equals AttnLRP as its authors compute it with LXT
(Achtibat et al., ICML 2024; PyPI ``lxt``, applied as its README does: ``tests/lxt_reference.py``)
on tiny random LLaMA, Qwen2, Gemma-3 and GPT-2 models: the token scores (the input relevance
summed over the embedding size) correlate at Pearson >= 0.999 and differ by at most 1e-3 of the
largest score, for the fast path and the rule-by-rule walk. This pins the two conventions AttnLRP
and LXT share: relevance starts at the explained logit's value, sign included (``Preset.seed``),
and an activation written out op by op (GPT-2's tanh-GELU) gets the identity rule of the whole
function. The mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE), which LXT 2.1 does
not patch, are compared with LXT's functions applied as LXT's repository applies them to Qwen3-MoE
(``tests/lxt_reference.py``): uniform rule on the gate weights, the router's own gradient.
Skipped when ``lxt`` is not installed (``pip install lxt``; CI installs it).
"""
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

import llm_models
import relprop

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("lxt") is None, reason="lxt is not installed"),
              pytest.mark.slow]  # a subprocess running LXT, and eight language models captured

DECODERS = ("llama", "qwen2", "gemma3", "gpt2")
MOE = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
MODELS = DECODERS + MOE
MIN_PEARSON = 0.999
MAX_RELATIVE_DIFFERENCE = 1e-3


@pytest.fixture(scope="module")
def lxt():
    """LXT's relevance on every model, computed in a process of its own (LXT patches transformers)."""
    script = os.path.join(os.path.dirname(__file__), "lxt_reference.py")
    done = subprocess.run([sys.executable, script, *MODELS], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.mark.parametrize("name, fast_path", [(n, f) for n in DECODERS for f in (True, False)]
                         + [(n, True) for n in MOE], ids=lambda v: v if isinstance(v, str) else
                         ("fast_path" if v else "interpreter"))
def test_attnlrp_equals_lxt(name, fast_path, lxt, capsys):
    theirs = lxt[name]
    model = llm_models.build(name)
    e = relprop.explain(model, llm_models.batch(), method="lrp", preset="attnlrp", target="next_token",
                        fast_path=fast_path)
    assert e.logits[:, -1].argmax(-1).tolist() == theirs["tokens"]
    assert torch.allclose(e.target_scores, torch.tensor(theirs["logits"]), rtol=1e-4, atol=1e-6)
    ref = torch.tensor(theirs["relevance"], dtype=torch.float64)
    ours = e.scores.double()
    pearson = float(torch.corrcoef(torch.stack([ours.flatten(), ref.flatten()]))[0, 1])
    rel = float((ours - ref).abs().max() / ref.abs().max())
    with capsys.disabled():
        print(f"\n{name} ({'fast path' if fast_path else 'interpreter'}): Pearson {pearson:.7f}, "
              f"max |diff| / max |R| {rel:.2e}, sums {ours.sum(-1).tolist()} vs logits {theirs['logits']}")
    assert pearson >= MIN_PEARSON
    assert rel <= MAX_RELATIVE_DIFFERENCE
