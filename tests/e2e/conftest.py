"""End-to-end fixtures: real processes (uvicorn, Celery worker, `higgs serve`) on free ports,
real databases (SQLite file or PostgreSQL) and brokers (kombu filesystem or Redis).

Every process runs in its own session so a test can SIGKILL a whole worker (main process and
pool children) like a machine that dies; teardown always kills what is left and prints the
logs of a failed test.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from devtools.scratch import scratch_postgres
from devtools.stack import Stack
from tests.fixtures import TINY_MODEL, build_tiny_checkpoint

REDIS_ENV = "HIGGS_TEST_REDIS_URL"
POSTGRES_ENV = "HIGGS_TEST_POSTGRES_URL"


@pytest.fixture(scope="session")
def e2e_models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("e2e-models")
    build_tiny_checkpoint("llama", root / TINY_MODEL)
    return root


def base_env(tmp: Path, models_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HIGGS_", "HF_"))}
    env.update(
        {
            "HIGGS_DATA_DIR": str(tmp / "data"),
            "HIGGS_MODELS_DIR": str(models_dir),
            # Fast failure detection for the tests; production keeps the defaults.
            "HIGGS_HEARTBEAT_TIMEOUT_S": "4",
            "HIGGS_SWEEP_INTERVAL_S": "1",
            "HIGGS_ENQUEUE_GRACE_S": "2",
            "HIGGS_EVENTS_POLL_INTERVAL_S": "0.2",
            "HF_HOME": str(tmp / "hf"),
            "HF_HUB_OFFLINE": "1",
            "PYTHONUNBUFFERED": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "OMP_NUM_THREADS": "1",
        }
    )
    return env


@pytest.fixture
def stack_factory(
    request: pytest.FixtureRequest, tmp_path: Path, e2e_models_dir: Path
) -> Iterator[Any]:
    """make(kind) -> Stack with env ready (nothing started); kind: "local" | "redis-postgres"."""
    stacks: list[Stack] = []
    cleanups: list[Any] = []

    def make(kind: str) -> Stack:
        tmp = tmp_path / f"{kind}-{len(stacks)}"
        tmp.mkdir()
        env = base_env(tmp, e2e_models_dir)
        if kind == "redis-postgres":
            redis_url, pg_url = os.environ.get(REDIS_ENV), os.environ.get(POSTGRES_ENV)
            if not redis_url or not pg_url:
                pytest.skip(
                    f"{REDIS_ENV} and {POSTGRES_ENV} must both be set for the Redis + PostgreSQL e2e tests"
                )
            db_url, drop = scratch_postgres(pg_url, "higgs_e2e")
            cleanups.append(drop)
            env["HIGGS_DATABASE_URL"] = db_url
            env["HIGGS_BROKER_URL"] = _private_redis_db(redis_url)
        elif kind != "local":
            raise ValueError(kind)
        stack = Stack(tmp=tmp, env=env)
        stacks.append(stack)
        return stack

    yield make

    failed = getattr(request.node, "rep_call", None) is not None and request.node.rep_call.failed
    for s in stacks:
        if failed:
            sys.stderr.write(s.logs() + "\n")
        s.close()
    for c in cleanups:
        c()


@pytest.hookimpl(tryfirst=True, hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    rep = outcome.get_result()  # type: ignore[attr-defined]
    setattr(item, "rep_" + rep.when, rep)


def _private_redis_db(url: str) -> str:
    """The same Redis server, database 7, emptied: other tests' messages are not ours."""
    import redis

    base = url.rsplit("/", 1)[0] if url.count("/") > 2 else url
    private = f"{base}/7"
    redis.Redis.from_url(private).flushdb()
    return private
