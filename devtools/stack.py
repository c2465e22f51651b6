"""Real service processes for the end-to-end tests and the service benchmark: uvicorn, Celery
workers and `higgs` commands spawned in their own process sessions (so a test can SIGKILL a
whole worker like a machine that dies), with logs in files and a readiness wait."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
# The installed console script, or its entry point when it is not installed.
_SCRIPT = Path(sys.executable).with_name("higgs")
HIGGS = (
    [str(_SCRIPT)]
    if _SCRIPT.exists()
    else [sys.executable, "-c", "from higgs_cli.main import main; raise SystemExit(main())"]
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
            argv,
            cwd=REPO,
            env={**self.env, **(extra_env or {})},
            stdout=fh,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        fh.close()
        proc = Proc(name, popen, log)
        self.procs.append(proc)
        return proc

    def run(
        self, argv: list[str], timeout: float = 120, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        out = subprocess.run(
            argv, cwd=REPO, env=self.env, capture_output=True, text=True, timeout=timeout
        )
        if check and out.returncode != 0:
            raise AssertionError(f"{argv} exited {out.returncode}:\n{out.stdout}\n{out.stderr}")
        return out

    def start_api(self, workers: int = 1, timeout: float = 60) -> Proc:
        from higgs_cli.service_cmds import api_command

        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        proc = self.spawn("api", api_command("127.0.0.1", port, workers, log_level="warning"))
        self.wait_ready(proc, timeout)
        return proc

    def start_serve(self, extra_env: dict[str, str] | None = None, timeout: float = 90) -> Proc:
        """`higgs serve` (the embedded default: API, worker and broker in one command) on the
        stack's data folder and a free port, once it answers /readyz."""
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        argv = [*HIGGS, "serve", "--data-dir", str(self.data_dir), "--port", str(port)]
        proc = self.spawn("serve", [*argv, "--grace", "10"], extra_env)
        self.wait_ready(proc, timeout)
        return proc

    def start_worker(
        self, extra_env: dict[str, str] | None = None, log_level: str = "INFO"
    ) -> Proc:
        from higgs_cli.service_cmds import worker_command

        name = f"w{uuid.uuid4().hex[:6]}@%h"
        return self.spawn("worker", worker_command(name=name, log_level=log_level), extra_env)

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

    def migrate(self) -> None:
        """`alembic upgrade head` on the stack's database (what the compose file's migrate does)."""
        self.run([sys.executable, "-m", "alembic", "upgrade", "head"], timeout=300)

    def create_key(self, name: str = "e2e", data_dir: Path | None = None) -> str:
        """A new API key (`higgs keys create`, on `data_dir`'s database when given)."""
        where = ["--data-dir", str(data_dir)] if data_dir is not None else []
        out = self.run([*HIGGS, "keys", "create", name, *where])
        key = out.stdout.strip().splitlines()[-1].strip()
        assert key and " " not in key, out.stdout
        return key

    def client(self, key: str) -> httpx.Client:
        return httpx.Client(
            base_url=self.url, headers={"Authorization": f"Bearer {key}"}, timeout=30
        )

    def logs(self) -> str:
        return "\n".join(f"===== {p.name} ({p.log.name}) =====\n{p.tail()}" for p in self.procs)

    def close(self) -> None:
        for p in reversed(self.procs):
            p.stop()
