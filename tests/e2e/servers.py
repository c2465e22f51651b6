"""Private PostgreSQL and Redis servers that a test may stop, restart or wipe: each on its own
free loopback port and data folder, never the shared servers of scripts/test."""

from __future__ import annotations

import contextlib
import glob
import os
import shlex
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from devtools.stack import free_port


def pg_bin() -> Path | None:
    for d in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True):
        if os.access(os.path.join(d, "initdb"), os.X_OK):
            return Path(d)
    found = shutil.which("initdb")
    return Path(found).parent if found else None


def _as_postgres(argv: list[str]) -> list[str]:
    """initdb and postgres refuse to run as root: run them as the postgres user then."""
    if os.geteuid() != 0:
        return argv
    return ["su", "postgres", "-s", "/bin/sh", "-c", shlex.join(argv)]


class PrivatePostgres:
    def __init__(self) -> None:
        binary = pg_bin()
        if binary is None:
            raise RuntimeError("PostgreSQL server binaries (initdb, pg_ctl) are not installed")
        self.bin = binary
        self.port = free_port()
        # Not under pytest's tmp_path: that is private to root, and the server runs as postgres.
        self.root = Path(tempfile.mkdtemp(prefix="higgs-pg-"))
        self.root.chmod(0o755)
        if os.geteuid() == 0:
            shutil.chown(self.root, "postgres")
        self.data = self.root / "data"
        subprocess.run(
            _as_postgres(
                [str(self.bin / "initdb"), "-D", str(self.data), "-U", "postgres", "--auth=trust"]
            ),
            check=True,
            capture_output=True,
            timeout=120,
        )
        self.start()
        self.url = f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def _pg_ctl(self, *args: str, timeout: float = 60) -> None:
        subprocess.run(
            _as_postgres([str(self.bin / "pg_ctl"), "-D", str(self.data), *args]),
            check=True,
            capture_output=True,
            timeout=timeout,
        )

    def start(self) -> None:
        opts = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=100"
        self._pg_ctl("-w", "-t", "60", "-l", str(self.root / "server.log"), "-o", opts, "start")

    def stop(self) -> None:
        """A fast shutdown: open connections are terminated, as in a restart or failover."""
        self._pg_ctl("-w", "-m", "fast", "stop")

    def log(self) -> str:
        with contextlib.suppress(OSError):
            return (self.root / "server.log").read_text(errors="replace")[-4000:]
        return ""

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._pg_ctl("-m", "immediate", "stop")
        shutil.rmtree(self.root, ignore_errors=True)


class PrivateRedis:
    """redis-server without persistence (no RDB, no AOF): a restart loses every message."""

    def __init__(self) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed")
        self.exe = exe
        self.port = free_port()
        self.root = Path(tempfile.mkdtemp(prefix="higgs-redis-"))
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.start()

    def start(self) -> None:
        argv = [
            self.exe,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ]
        argv += ["--dir", str(self.root)]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import redis

        deadline = time.monotonic() + 20
        while True:
            try:
                if redis.Redis(port=self.port, socket_timeout=1).ping():
                    return
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def restart(self) -> None:
        self.stop()
        self.start()

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)


def wait_finished(
    client: Any, job_id: str, timeout: float = 180, logs: Callable[[], str] = str
) -> dict[str, Any]:
    """GET the job through `client` (an httpx.Client with a key) until it is terminal; its
    body. AssertionError naming the job (and `logs()`) after `timeout` seconds."""
    from app.db.models import TERMINAL

    deadline = time.monotonic() + timeout
    job: dict[str, Any] = {}
    while time.monotonic() < deadline:
        job = client.get(f"/v1/jobs/{job_id}").json()
        if job["status"] in TERMINAL:
            return job
        time.sleep(0.3)
    raise AssertionError(f"job {job_id} not finished: {job}\n{logs()}")
