"""A job attempt's memory limit, so that one hostile or oversized model cannot take the host.

HIGGS_WORKER_MAX_MEMORY_MB (settings.worker_max_memory_mb) is the address space an attempt
may add to its pool process: while a task runs, the process's RLIMIT_AS is what the process
already held when the task began (the interpreter, torch and its libraries, thread stacks:
0.9 to 1.2 GB of address space for an idle CPU pool process on the 2-core development
machine, about 0.4 GB of it resident) plus that many MB. Measured there, in one process with
one torch thread: a tiny test model's job adds 200 MB (native + dequantized) to 240 MB
(gguf); SmolLM2-135M at 4 bits adds 430 MB (native + dequantized) and 605 MB (gguf, Q4_K,
llama.cpp's converter a subprocess with its own cap), artifact checks included, so the default
4096 leaves room for models several times larger. An allocation past it fails at once (MemoryError, a torch allocation error,
std::bad_alloc in native code) instead of growing until the kernel's OOM killer picks a
victim. Subprocesses inherit the limit: llama.cpp's converter runs with the same cap (its own
address space; what it maps of the checkpoint counts, so the setting must exceed the largest
checkpoint a worker converts to GGUF). The job then fails as `resource_limit`, naming the
setting, and the pool process lives on.

A CUDA pool process is not limited: the CUDA driver reserves address space far beyond any
useful cap (several times the GPU's memory) and fails to start under one. The config checks
(higgs_engine.checkpoint_check) run there as everywhere.
"""

from __future__ import annotations

import contextlib
import logging
import resource
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("worker.limits")

__all__ = [
    "RESOURCE_LIMIT",
    "MemoryLimit",
    "active_limit",
    "address_space",
    "memory_limit",
    "out_of_memory",
]

RESOURCE_LIMIT = "resource_limit"
_MIB = 1 << 20
# What running out of memory says, in Python, torch, C++ and the C library.
_OOM_TEXT = (
    "can't allocate memory",
    "Cannot allocate memory",
    "not enough memory",
    "std::bad_alloc",
    "MemoryError",
    "can't start new thread",
)


@dataclass(frozen=True)
class MemoryLimit:
    """The limit in force: the setting (MB) and the RLIMIT_AS it became (bytes)."""

    max_mb: int
    rlimit_bytes: int

    def message(self) -> str:
        return (
            f"the job needed more memory than the worker's limit allows "
            f"(HIGGS_WORKER_MAX_MEMORY_MB={self.max_mb}: {self.max_mb} MB of address space "
            "per job attempt, its subprocesses included)"
        )


_active: MemoryLimit | None = None


def active_limit() -> MemoryLimit | None:
    """The limit of the task this process runs now, or None."""
    return _active


def address_space() -> int:
    """This process's address space (VmSize) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    raise OSError("no VmSize in /proc/self/status")


@contextlib.contextmanager
def memory_limit(max_mb: int, device: str) -> Iterator[MemoryLimit | None]:
    """RLIMIT_AS = the address space now + `max_mb` MB for the body (and every process it
    starts), restored afterwards. No limit on a CUDA device or where the platform has none."""
    global _active
    if max_mb <= 0 or device.startswith("cuda") or not hasattr(resource, "RLIMIT_AS"):
        yield None
        return
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        want = address_space() + max_mb * _MIB
        if hard != resource.RLIM_INFINITY:
            want = min(want, hard)
        resource.setrlimit(resource.RLIMIT_AS, (want, hard))
    except (OSError, ValueError) as e:  # no /proc, or a hard limit below what we hold
        log.warning("no memory limit for this task: %s", e)
        yield None
        return
    _active = MemoryLimit(max_mb, want)
    try:
        yield _active
    finally:
        _active = None
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def out_of_memory(exc: BaseException) -> bool:
    """Whether `exc` (or an exception it was raised from) is a failed allocation."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, MemoryError) or type(cur).__name__ == "OutOfMemoryError":
            return True
        if isinstance(cur, (RuntimeError, OSError)) and any(t in str(cur) for t in _OOM_TEXT):
            return True
        cur = cur.__cause__ or cur.__context__
    return False
