"""`higgs serve` gives its API processes one PROMETHEUS_MULTIPROC_DIR, empty at start."""

from __future__ import annotations

from pathlib import Path

from higgs_cli.service_cmds import MULTIPROC_ENV, metrics_dir


def test_a_fresh_folder_when_none_is_set() -> None:
    env: dict[str, str] = {}
    made = metrics_dir(env)
    assert made is not None and env[MULTIPROC_ENV] == made
    assert Path(made).is_dir() and not any(Path(made).iterdir())
    Path(made).rmdir()


def test_a_given_folder_is_emptied_of_an_earlier_runs_files(tmp_path: Path) -> None:
    folder = tmp_path / "m"
    env = {MULTIPROC_ENV: str(folder)}
    assert metrics_dir(env) is None and folder.is_dir()
    (folder / "histogram_123.db").write_bytes(b"x")
    (folder / "keep.txt").write_text("not ours")
    assert metrics_dir(env) is None
    assert [p.name for p in folder.iterdir()] == ["keep.txt"]
