"""The statuses an attempt ends with (worker.attempt.OutcomeStatus) are exactly those the
worker's code returns: read statically from every `Outcome(...)` in worker/ (mypy checks that
none is outside the type; this checks that the type names none that is never returned)."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import get_args

from worker.attempt import Outcome, OutcomeStatus

WORKER = Path(__file__).resolve().parents[2] / "worker"


def returned_statuses() -> dict[str, list[str]]:
    """Each literal status passed to Outcome(...) in worker/, with where it is."""
    found: dict[str, list[str]] = {}
    for path in sorted(WORKER.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == Outcome.__name__
            ):
                continue
            arg = node.args[0] if node.args else None
            assert isinstance(arg, ast.Constant) and isinstance(arg.value, str), (
                f"{path.name}:{node.lineno}: Outcome's status is not a string literal"
            )
            found.setdefault(arg.value, []).append(f"{path.name}:{node.lineno}")
    return found


def test_outcome_status_names_exactly_the_returned_statuses() -> None:
    returned = returned_statuses()
    assert {"succeeded", "failed", "lost", "fanned_out"} <= set(returned)  # the scan works
    assert set(returned) == set(get_args(OutcomeStatus)), returned
