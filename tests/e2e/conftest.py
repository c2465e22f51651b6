"""End-to-end fixtures: real processes (uvicorn, Celery worker, `higgs serve`) on free ports,
real databases (SQLite file or PostgreSQL) and brokers (kombu filesystem or Redis).

Every process runs in its own session so a test can SIGKILL a whole worker (main process and
pool children) like a machine that dies; teardown always kills what is left and prints the
logs of a failed test.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.db.scratch import scratch_postgres
from tests.conftest import build_tiny_checkpoint

REPO = Path(__file__).resolve().parents[2]
# The installed console script (`python -m higgs_cli.main` would run main.py as __main__, a
# second copy of the module whose CliError the verb modules do not raise).
_SCRIPT = Path(sys.executable).with_name("higgs")
HIGGS = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-c", "from higgs_cli.main import main; raise SystemExit(main())"]
REDIS_ENV = "HIGGS_TEST_REDIS_URL"
POSTGRES_ENV = "HIGGS_TEST_POSTGRES_URL"
# The tiny model the e2e jobs quantize, and one whose job is slowed down (test-only knob
# HIGGS_DEBUG_LAYER_DELAY_S) so that it can be killed or cancelled in the middle.
MODEL = "tiny"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def e2e_models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("e2e-models")
    build_tiny_checkpoint("llama", root / MODEL)
    return root


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    def alive(self) -> bool:
        return self.popen.poll() is None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, sig)

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM to the process (it stops its own children), wait, then SIGKILL the group."""
        if self.alive():
            self.popen.send_signal(signal.SIGTERM)
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill(signal.SIGKILL)
            return self.popen.wait(10)

    def tail(self, n: int = 80) -> str:
        try:
            lines = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(lines[-n:])


@dataclass
class Stack:
    """A running service: base URL, environment shared by all its processes, data folders."""

    tmp: Path
    env: dict[str, str]
    url: str = ""
    procs: list[Proc] = field(default_factory=list)

    @property
    def data_dir(self) -> Path:
        return Path(self.env["HIGGS_DATA_DIR"])

    @property
    def artifacts_dir(self) -> Path:
        return Path(self.env.get("HIGGS_ARTIFACTS_DIR") or self.data_dir / "artifacts")

    def spawn(self, name: str, argv: list[str], extra_env: dict[str, str] | None = None) -> Proc:
        log = self.tmp / f"{name}-{len(self.procs)}.log"
        fh = log.open("wb")
        popen = subprocess.Popen(
            argv, cwd=REPO, env={**self.env, **(extra_env or {})}, stdout=fh, stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        fh.close()
        proc = Proc(name, popen, log)
        self.procs.append(proc)
        return proc

    def run(self, argv: list[str], timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
        out = subprocess.run(
            argv, cwd=REPO, env=self.env, capture_output=True, text=True, timeout=timeout
        )
        if check and out.returncode != 0:
            raise AssertionError(f"{argv} exited {out.returncode}:\n{out.stdout}\n{out.stderr}")
        return out

    def start_api(self, workers: int = 1) -> Proc:
        from higgs_cli.service_cmds import api_command

        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        proc = self.spawn("api", api_command("127.0.0.1", port, workers, log_level="warning"))
        self.wait_ready(proc)
        return proc

    def start_worker(self, extra_env: dict[str, str] | None = None) -> Proc:
        from higgs_cli.service_cmds import worker_command

        name = f"w{uuid.uuid4().hex[:6]}@%h"
        return self.spawn("worker", worker_command(name=name), extra_env)

    def wait_ready(self, proc: Proc, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not proc.alive():
                raise AssertionError(f"{proc.name} exited early:\n{proc.tail()}")
            try:
                if httpx.get(self.url + "/readyz", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"{proc.name} not ready after {timeout}s:\n{proc.tail()}")

    def create_key(self, name: str = "e2e") -> str:
        out = self.run([*HIGGS, "keys", "create", name])
        key = out.stdout.strip().splitlines()[-1].strip()
        assert key and " " not in key, out.stdout
        return key

    def client(self, key: str) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {key}"}, timeout=30)

    def logs(self) -> str:
        return "\n".join(f"===== {p.name} ({p.log.name}) =====\n{p.tail()}" for p in self.procs)

    def close(self) -> None:
        for p in reversed(self.procs):
            p.stop()


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
                pytest.skip(f"{REDIS_ENV} and {POSTGRES_ENV} must both be set for the Redis + PostgreSQL e2e tests")
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
