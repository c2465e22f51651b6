"""The quality benchmark's per-method cost figures (devtools.quality.SimulatedModel.apply):
CPU seconds and the peak RSS while the method ran, reset between methods."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

_SCENARIO = """
import json
import torch
from torch import nn
from devtools.quality import Method, SimulatedModel

MIB = 1024 * 1024
torch.manual_seed(0)
sim = SimulatedModel(nn.Sequential(nn.Linear(32, 16), nn.Linear(16, 8)))
held = []

def hungry(w):
    if not held:  # 200 MiB touched once, during this method only
        held.append(torch.ones(200 * MIB // 4))
    return w.clone(), 16.0

big = sim.apply(Method("hungry", "test", {}, fn=hungry))
held.clear()
small = sim.apply(Method("plain", "test", {}, fn=lambda w: (w.clone(), 16.0)))
print(json.dumps([[s.peak_rss_mib, s.rss_before_mib, s.cpu_seconds, s.seconds] for s in (big, small)]))
"""


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux procfs")
def test_peak_rss_is_per_method() -> None:
    # In a fresh interpreter: a long test process's heap would blur a 200 MiB difference.
    out = subprocess.run(
        [sys.executable, "-c", _SCENARIO],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parents[2],
        check=True,
    )
    (big_peak, big_before, big_cpu, big_s), (small_peak, small_before, _, _) = json.loads(
        out.stdout.strip().splitlines()[-1]
    )
    assert None not in (big_peak, big_before, small_peak, small_before)
    assert big_peak >= big_before + 190
    # The second method's peak does not carry the first one's 200 MiB.
    assert small_peak < big_peak - 150
    assert big_cpu > 0 and big_s > 0
