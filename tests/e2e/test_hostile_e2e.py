"""The hostile-checkpoint corpus (tests/hostile_corpus.py) through every format on both
deployment shapes, with real processes: the embedded `higgs serve` (SQLite, filesystem
broker) and production (uvicorn + a Celery worker + Redis + PostgreSQL).

Every case ends in one clean error: a failed job on its first attempt with the expected code
(or, for what the API can tell without the model, a 422 naming the field), nothing left in the
artifacts folder or its staging area, and every process alive; a healthy model submitted
after the corpus still succeeds in each format."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from devtools.stack import Stack
from tests.e2e.test_service_e2e import start_separate
from tests.fixtures import files_under
from tests.hostile_corpus import FORMATS, HOSTILE, build_corpus

pytestmark = pytest.mark.slow

TIMEOUT_S = 300
# The worker's limit while the corpus runs: a hostile case that slipped past the checks
# fails at this size instead of growing (the pool process and the converter alike).
WORKER_MEMORY_MB = "3072"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_corpus(tmp_path_factory.mktemp("hostile"))


def _capped_env(stack: Stack, corpus: Path) -> None:
    stack.env.update(
        {
            "HIGGS_MODELS_DIR": str(corpus),
            "HIGGS_WORKER_MAX_MEMORY_MB": WORKER_MEMORY_MB,
            "HIGGS_MAX_ATTEMPTS": "3",
            "HIGGS_MAX_ACTIVE_JOBS_PER_KEY": "0",  # the whole corpus queued at once
        }
    )


def _submit_all(c: httpx.Client, models: list[str]) -> dict[tuple[str, str], Any]:
    """{(model, format): job id, or the 422 problem the API answered}."""
    out: dict[tuple[str, str], Any] = {}
    for model in models:
        for fmt in FORMATS:
            body = {"model": {"id": model}, "target": {"bits": 4}, "options": {"formats": [fmt]}}
            r = c.post("/v1/jobs", json=body)
            assert r.status_code in (202, 422), (model, fmt, r.status_code, r.text)
            out[(model, fmt)] = r.json()["id"] if r.status_code == 202 else r.json()
    return out


def _wait_all(c: httpx.Client, ids: dict[tuple[str, str], str], stack: Stack) -> dict[Any, Any]:
    deadline = time.monotonic() + TIMEOUT_S
    jobs: dict[Any, Any] = {}
    while time.monotonic() < deadline:
        for k, job_id in ids.items():
            if k not in jobs or jobs[k]["status"] not in ("succeeded", "failed", "cancelled"):
                jobs[k] = c.get(f"/v1/jobs/{job_id}").json()
        if all(j["status"] in ("succeeded", "failed", "cancelled") for j in jobs.values()):
            return jobs
        time.sleep(0.5)
    pending = {
        k: (j["status"], j.get("stage")) for k, j in jobs.items() if j["status"] == "running"
    }
    raise AssertionError(f"jobs still running after {TIMEOUT_S}s: {pending}\n{stack.logs()}")


def _run_corpus(stack: Stack, c: httpx.Client) -> None:
    submitted = _submit_all(c, sorted(HOSTILE))
    ids = {k: v for k, v in submitted.items() if isinstance(v, str)}
    jobs = _wait_all(c, ids, stack)
    wrong: list[tuple[Any, ...]] = []
    for (case, fmt), got in submitted.items():
        _, code, text = HOSTILE[case]
        if not isinstance(got, str):  # refused at submit: only what the API can tell
            if case != "unknown-architecture" or fmt != "gguf":
                wrong.append((case, fmt, "422", got))
            continue
        job = jobs[(case, fmt)]
        err = job.get("error") or {}
        if (
            job["status"] != "failed"
            or err.get("code") != code
            or text not in err.get("message", "")
            or job["attempts"] != 1
        ):
            wrong.append((case, fmt, job["status"], job["attempts"], err))
    assert not wrong, "\n".join(map(str, wrong))
    # Nothing of any of them on disk: no published attempt, no scratch.
    left = [p for p in files_under(stack.artifacts_dir) if p.name != ".keep"]
    assert left == [], left
    # Every process alive, and the worker still runs a healthy model in every format.
    assert all(p.alive() for p in stack.procs), stack.logs()
    healthy = _wait_all(c, _submit_all(c, ["healthy"]), stack)
    for (_, fmt), job in healthy.items():
        assert job["status"] == "succeeded", (fmt, job.get("error"))
    assert all(p.alive() for p in stack.procs), stack.logs()


def test_corpus_on_the_embedded_service(stack_factory: Any, corpus: Path) -> None:
    stack = stack_factory("local")
    _capped_env(stack, corpus)
    stack.start_serve()
    key = stack.create_key(data_dir=stack.data_dir)
    with stack.client(key) as c:
        _run_corpus(stack, c)


def test_corpus_on_redis_and_postgres(stack_factory: Any, corpus: Path) -> None:
    stack = stack_factory("redis-postgres")
    _capped_env(stack, corpus)
    start_separate(stack)
    key = stack.create_key()
    with stack.client(key) as c:
        _run_corpus(stack, c)
