"""A gguf job never silently ignores an option, with real processes: the embedded `higgs serve`
answers a gguf request carrying a HIGGS option (skip, p, dtype, ...) or a bit width above F16
with a 422 naming each, `higgs submit` prints it as one error line and exits non-zero, and
`higgs quantize --format gguf` refuses the same flags before any work."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from devtools.stack import HIGGS
from tests.fixtures import TINY_MODEL, assert_problem

pytestmark = pytest.mark.slow


CASES: list[tuple[dict[str, Any], dict[str, float], list[str]]] = [
    ({"skip": ["*"]}, {"bits": 4}, ["options.skip"]),
    ({"p": 2}, {"bits": 4}, ["options.p"]),
    ({"dtype": "bfloat16"}, {"bits": 4}, ["options.dtype"]),
    ({"group_size": 128, "seed": 3}, {"avg_bits": 5}, ["options.group_size", "options.seed"]),
    ({}, {"bits": 100}, ["target.bits"]),
    ({}, {"avg_bits": 17}, ["target.avg_bits"]),
]


def test_gguf_refuses_what_it_does_not_take(
    stack_factory: Any, e2e_models_dir: Path, tmp_path: Path
) -> None:
    stack = stack_factory("local")
    stack.start_serve()
    key = stack.create_key(data_dir=stack.data_dir)
    with stack.client(key) as c:
        for options, target, fields in CASES:
            body = {
                "model": {"id": TINY_MODEL},
                "target": target,
                "options": {"formats": ["gguf"], **options},
            }
            problem = assert_problem(c.post("/v1/jobs", json=body), 422)
            assert [e["field"] for e in problem["errors"]] == fields, (body, problem)
        assert c.get("/v1/jobs").json()["data"] == []  # no job was made

    # The client: one error line naming the option, a non-zero exit.
    res = stack.run(
        [*HIGGS, "submit", TINY_MODEL, "--bits", "4", "--formats", "gguf", "--p", "2",
         "--url", stack.url, "--key", key],
        check=False,
    )  # fmt: skip
    assert res.returncode != 0
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "options.p" in lines[0], res.stderr

    # The local command refuses the same flags before any work.
    out = tmp_path / "g"
    res = stack.run(
        [*HIGGS, "quantize", str(e2e_models_dir / TINY_MODEL), "--out", str(out),
         "--format", "gguf", "--skip", "*", "--dtype", "bfloat16"],
        check=False,
    )  # fmt: skip
    assert res.returncode != 0
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "--skip" in lines[0] and "--dtype" in lines[0], res.stderr
    assert not out.exists()
