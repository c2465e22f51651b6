"""A worker's job attempt resolves its model once (worker.models.resolve_model: located, then
described by the engine) and hands the ResolvedModel to every stage: no other resolution,
config.json read or meta model built, uniform or dynamic; the report's source is that model.
The written artifact is then loaded once more by its own check before it is published
(higgs_engine.artifact_check): that reads the artifact's config, not the source's, and is
counted apart."""

from __future__ import annotations

import pytest
from sqlalchemy.orm import Session, sessionmaker

# Loaded before any count starts, so that count_calls finds (and later restores) the
# load_config / build_meta_model that the artifact loader binds at import.
import higgs_engine.artifacts  # noqa: F401
from app.db.models import Job
from app.settings import Settings
from tests.fixtures import TINY_MODEL as MODEL
from tests.fixtures import count_resolutions
from tests.worker.helpers import create_job
from worker import publish
from worker.config import RunnerConfig
from worker.runner import run_job

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NATIVE = {"formats": ["native"]}


@pytest.mark.parametrize("target", [{"bits": 4}, {"avg_bits": 3.5}], ids=["uniform", "dynamic"])
def test_a_job_attempt_resolves_its_model_once(
    settings: Settings,
    sessions: sessionmaker[Session],
    monkeypatch: pytest.MonkeyPatch,
    target: dict[str, float],
) -> None:
    # A tiny token budget for the dynamic job's profile: one window of 16 random tokens.
    settings = settings.model_copy(update={"profile_context": 16, "profile_windows": 1})
    cfg = RunnerConfig.from_settings(settings, "cpu")
    job_id = create_job(
        sessions, settings, {"model": {"id": MODEL}, "target": target, "options": NATIVE}
    )
    counts = count_resolutions(monkeypatch)
    in_check: dict[str, int] = {}
    verify = publish.verify_artifacts

    def verify_counted(*args: object, **kwargs: object) -> None:
        before = {k: v[0] for k, v in counts.items()}
        verify(*args, **kwargs)  # type: ignore[arg-type]
        for k, v in counts.items():
            in_check[k] = in_check.get(k, 0) + v[0] - before[k]
            v[0] = before[k]

    monkeypatch.setattr(publish, "verify_artifacts", verify_counted)
    out = run_job(sessions, job_id, cfg, worker_id="w1")
    assert out.status == "succeeded", out.detail
    # the native artifact, loaded by the project's loader before it is published
    assert in_check == {
        "resolve_source": 0,
        "describe_model": 0,
        "load_config": 1,
        "build_meta_model": 1,
    }
    assert {k: v[0] for k, v in counts.items()} == {
        "resolve_source": 0,  # the worker locates the model itself (models dir or the Hub)
        "describe_model": 1,
        "load_config": 1,
        "build_meta_model": 1,
    }
    with sessions() as s:
        job = s.get(Job, job_id)
        assert job is not None and job.report is not None
        source = job.report["source"]
    assert (source["id"], source["kind"], source["revision"]) == (MODEL, "local", None)
