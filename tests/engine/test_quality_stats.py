"""The quality benchmark's per-method cost figures (devtools.quality.SimulatedModel.apply):
CPU seconds and the peak RSS while the method ran, reset between methods."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from devtools.quality import Method, SimulatedModel

MIB = 1024 * 1024


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 16), nn.Linear(16, 8))


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux procfs")
def test_peak_rss_is_per_method() -> None:
    sim = SimulatedModel(_model())
    held: list[torch.Tensor] = []

    def hungry(w: torch.Tensor) -> tuple[torch.Tensor, float]:
        if not held:  # 200 MiB touched once, during this method only
            held.append(torch.ones(200 * MIB // 4))
        return w.clone(), 16.0

    big = sim.apply(Method("hungry", "test", {}, fn=hungry))
    held.clear()
    small = sim.apply(Method("plain", "test", {}, fn=lambda w: (w.clone(), 16.0)))
    assert big.peak_rss_mib is not None and big.rss_before_mib is not None
    assert small.peak_rss_mib is not None and small.rss_before_mib is not None
    assert big.peak_rss_mib >= big.rss_before_mib + 190
    # The second method's peak does not carry the first one's 200 MiB.
    assert small.peak_rss_mib < big.peak_rss_mib - 150
    assert big.cpu_seconds > 0 and big.seconds > 0
