"""worker.limits in a real child interpreter: under a task's memory limit an allocation past
it fails (in the process and in a subprocess it starts) and is the job's `resource_limit`;
afterwards the process allocates again; a crash signal is the job's `native_crash`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from billiard.exceptions import WorkerLostError

from worker.limits import out_of_memory
from worker.tasks import native_crash

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import subprocess, sys
from worker.attempt import job_error_code
from worker.limits import memory_limit

big = "bytearray(1024 << 20)"
with memory_limit(256, "cpu") as limit:
    assert limit is not None
    try:
        exec(big)
        print("in-process: allocated")
    except MemoryError as exc:
        print("in-process:", job_error_code(exc))
    child = subprocess.run([sys.executable, "-c", big], capture_output=True, text=True)
    print("child:", child.returncode, "MemoryError" in child.stderr)
    print("message:", limit.message())
exec(big)
print("after: allocated")
with memory_limit(256, "cuda:0") as limit:
    print("cuda:", limit)
"""


def test_allocations_past_the_limit_fail_in_the_task_and_its_subprocesses() -> None:
    res = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert "in-process: resource_limit" in lines
    assert "child: 1 True" in lines
    assert "message: " in res.stdout and "HIGGS_WORKER_MAX_MEMORY_MB=256" in res.stdout
    assert "after: allocated" in lines
    assert "cuda: None" in lines


def test_what_counts_as_out_of_memory() -> None:
    assert out_of_memory(MemoryError())
    assert out_of_memory(
        RuntimeError("DefaultCPUAllocator: not enough memory: you tried to allocate 8 GB")
    )
    wrapped = ValueError("conversion failed")
    wrapped.__cause__ = OSError(12, "Cannot allocate memory")
    assert out_of_memory(wrapped)
    assert not out_of_memory(RuntimeError("shape mismatch"))


def test_crash_signals_are_native_crashes_and_kills_are_not() -> None:
    abort = WorkerLostError("Worker exited prematurely: signal 6 (SIGABRT) Job: 0.")
    msg = native_crash(abort, 4096)
    assert msg is not None and "SIGABRT" in msg and "not retried" in msg
    assert native_crash(WorkerLostError("exited prematurely: signal 11 (SIGSEGV)"), 1) is not None
    assert native_crash(WorkerLostError("exited prematurely: signal 9 (SIGKILL)"), 1) is None
    assert native_crash(WorkerLostError("exited prematurely: exitcode 1"), 1) is None
    assert native_crash(RuntimeError("signal 6"), 1) is None
