"""The CLI's progress bars name what each stage counts, from the one table of units."""

from __future__ import annotations

import pytest

from higgs_cli.common import StageBars


def test_a_bar_per_stage_with_its_unit(monkeypatch: pytest.MonkeyPatch) -> None:
    import tqdm

    made: list[dict[str, object]] = []

    class Bar:
        def __init__(self, **kw: object) -> None:
            made.append(kw)
            self.total = kw.get("total")
            self.n = 0

        def refresh(self) -> None:
            pass

        def close(self) -> None:
            pass

    monkeypatch.setattr(tqdm, "tqdm", Bar)
    bars = StageBars(False)
    for stage, done, total in [
        ("generating", 0, 64),
        ("generating", 64, 64),
        ("profiling", 1, 4),
        ("probing", 1, 14),
        ("quantizing", 2, 30),
        ("measuring", 3, 40),
    ]:
        bars(stage, done, total)
    bars.close()
    assert [(m["desc"], m["unit"], m["total"]) for m in made] == [
        ("generating", "token", 64),
        ("profiling", "window", 4),
        ("probing", "layer", 14),
        ("quantizing", "layer", 30),
        ("measuring", "tensor", 40),
    ]
