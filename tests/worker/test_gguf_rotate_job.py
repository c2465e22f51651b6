"""A gguf job's options reach the engine's GGUF run (worker.gguf): options.gguf_rotate, and
the worker's device and threads."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from higgs_engine.errors import InvalidConfigError
from higgs_engine.sources import ResolvedSource
from tests.fixtures import build_gguf_llama, build_tiny_encoder
from worker.config import RunnerConfig
from worker.gguf import GgufJob, GgufWorker, quantize_gguf_job


def _no_sessions() -> None:
    raise AssertionError("a bits target needs no profile store")


# slow: a whole GGUF job with a rotation (the engine's rotation tests stay in the lane)
@pytest.mark.slow
def test_rotate_reaches_the_run(tmp_path: Path) -> None:
    ckpt = build_gguf_llama(tmp_path / "tiny")
    src = ResolvedSource(path=ckpt, id="tiny", revision=None, kind="local")
    rep = quantize_gguf_job(
        _no_sessions,  # type: ignore[arg-type]
        GgufJob(src, None, {"bits": 8.0}, rotate="on"),
        GgufWorker(),
        tmp_path / "out",
        lambda *a: None,
    )
    assert rep.metrics["rotated"] and rep.metrics["rotation"]["per_head_vo"]


def test_rotate_on_an_encoder_fails_naming_it(tmp_path: Path) -> None:
    bert = build_tiny_encoder(tmp_path / "bert")
    src = ResolvedSource(path=bert, id="bert", revision=None, kind="local")
    with pytest.raises(InvalidConfigError, match="BertModel"):
        quantize_gguf_job(
            _no_sessions,  # type: ignore[arg-type]
            GgufJob(src, None, {"bits": 8.0}, rotate="on"),
            GgufWorker(),
            tmp_path / "out",
            lambda *a: None,
        )


def test_the_workers_device_and_threads_reach_the_plan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, runner_cfg: RunnerConfig
) -> None:
    """The worker's device (RunnerConfig.device) and threads are the GGUF plan's: the plan
    the engine makes of the job, told before anything is converted."""
    from higgs_engine import job as engine_job

    planned: list[Any] = []
    real = engine_job.gguf_plan

    def watched(job: Any, progress: Any = None) -> Any:
        planned.append(real(job, progress))
        raise InvalidConfigError("stop after planning", field="test")

    monkeypatch.setattr(engine_job, "gguf_plan", watched)
    ckpt = build_gguf_llama(tmp_path / "tiny")
    src = ResolvedSource(path=ckpt, id="tiny", revision=None, kind="local")
    worker = GgufWorker.of(replace(runner_cfg, device="cuda:1"))
    assert (worker.device, worker.profiles) == ("cuda:1", runner_cfg.profiles)
    with pytest.raises(InvalidConfigError, match="stop after planning"):
        quantize_gguf_job(
            _no_sessions,  # type: ignore[arg-type]
            GgufJob(src, None, {"bits": 8.0}),
            GgufWorker(device=worker.device, threads=3),
            tmp_path / "out",
            lambda *a: None,
        )
    (plan,) = planned
    assert (plan.compute.device, plan.compute.threads) == ("cuda:1", 3)
    assert not (tmp_path / "out").exists()
