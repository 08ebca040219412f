"""Peak memory and time of one call, measured in a fresh child process (shared by
``bench_memory.py`` and ``memory_scaling.py``).

CPU: tracemalloc does not see torch's CPU tensors, so the peak is the resident set size's
high-water mark (VmHWM of /proc/self/status, reset through /proc/self/clear_refs before the
call) less the resident set at the start; the child runs with glibc's mmap threshold lowered
(:data:`MMAP_THRESHOLD`) so that freed tensors go back to the system instead of staying in the
heap. CUDA: ``torch.cuda.max_memory_allocated`` less the memory allocated at the start.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import List, Optional

MMAP_THRESHOLD = str(128 * 1024)


def rss_kib(field: str) -> int:
    """``field`` (e.g. VmRSS, VmHWM) of /proc/self/status, in KiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


class PeakMeter:
    """``with PeakMeter(device) as m: ...`` sets ``m.peak_bytes`` (above the start) and ``m.seconds``
    of the block."""

    def __init__(self, device: str):
        self.cuda = device.startswith("cuda")
        self.peak_bytes = self.seconds = None

    def __enter__(self) -> "PeakMeter":
        import torch
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._base = torch.cuda.memory_allocated()
        else:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self._base = rss_kib("VmRSS") * 1024
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        import torch
        if self.cuda:
            torch.cuda.synchronize()
            self.peak_bytes = torch.cuda.max_memory_allocated() - self._base
        else:
            self.peak_bytes = rss_kib("VmHWM") * 1024 - self._base
        self.seconds = time.perf_counter() - self._t0


def run_child(script: str, args: List[str], for_memory: bool = True) -> tuple[Optional[dict], List[str], str]:
    """Run ``python script --child *args`` in a fresh process, with the lowered mmap threshold
    (``for_memory``: freed tensors leave the resident set at once) or with glibc's defaults (for a
    time: the lowered threshold makes every tensor over 128 KiB fresh memory, faulted in page by
    page, which slows the calls that allocate more); returns (its last JSON line or None, the
    command, its stderr)."""
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    if for_memory:
        env["MALLOC_MMAP_THRESHOLD_"] = MMAP_THRESHOLD
    cmd = [sys.executable, os.path.abspath(script), "--child", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return None, cmd, proc.stderr or proc.stdout
    return json.loads(lines[-1]), cmd, proc.stderr
