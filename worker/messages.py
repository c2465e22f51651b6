"""What a job's error message may say to the user, and how a full disk is recognised
(and how much room the artifacts volume has).

Job error messages are read by API clients: they carry no absolute server paths (a path under
a known folder is shown relative to it, any other absolute path by its last component) and
stay short (a library's message that lists every model type it knows is cut).
"""

from __future__ import annotations

import errno
import re
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from higgs_engine.errors import HiggsError

if TYPE_CHECKING:
    from worker.config import RunnerConfig

MAX_CHARS = 500
_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
# How a full disk reads when a library reports it without an OSError (safetensors' Rust writer,
# torch's stream writer).
_FULL_TEXT = re.compile(r"No space left on device|StorageFull|Disk quota exceeded", re.IGNORECASE)
# An absolute POSIX path: starts with "/" not preceded by a word character, ':' or '/' (so URLs
# and relative paths are left alone), and runs to a quote, whitespace or punctuation.
_ABS_PATH = re.compile(r"(?<![\w:/.~-])/(?:[^\s'\"`(),;:<>\[\]{}]+)")
# transformers lists every model type it knows after this phrase (about 4,000 characters).
_LIST_TAIL = re.compile(
    r"\.?\s*(?:Should (?:have a `model_type` key in its config\.json, or )?contain one of|"
    r"Should contain one of|Model type should be one of)\b.*",
    re.DOTALL,
)


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        yield cur
        cur = cur.__cause__ or cur.__context__


def is_storage_full(exc: BaseException) -> bool:
    """True when the exception (or one it was raised from) says the disk or quota is full."""
    for e in _chain(exc):
        if isinstance(e, OSError) and e.errno in _FULL_ERRNOS:
            return True
        if _FULL_TEXT.search(str(e)):
            return True
    return False


def storage_error_text(exc: BaseException) -> str:
    """The operator's one-line description of the full-disk error (with its path: for the log)."""
    for e in _chain(exc):
        if isinstance(e, OSError) and e.errno in _FULL_ERRNOS:
            where = f" ({e.filename})" if e.filename else ""
            return f"{e.strerror or 'no space left on device'}{where}"
    return str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__


def message_roots(cfg: RunnerConfig) -> dict[Path, str]:
    """Server folders a message may mention, each with how it is shown ("" = relative path)."""
    roots: dict[Path, str] = {}
    if cfg.models_dir is not None:
        roots[cfg.models_dir] = ""
    roots[cfg.artifacts_dir] = ""
    if cfg.profiles is not None:
        roots[cfg.profiles.cache_dir] = ""
    try:
        from huggingface_hub import constants

        roots[Path(constants.HF_HUB_CACHE)] = ""
    except (
        Exception
    ):  # huggingface_hub missing or misconfigured: its paths fall to the generic rule
        pass
    return roots


def scrub_paths(text: str, roots: Mapping[Path, str]) -> str:
    """Replace absolute paths: below a known root by the part after it, else by the last part."""
    ordered = sorted(
        ((str(r).rstrip("/"), label) for r, label in roots.items()), key=lambda x: -len(x[0])
    )

    def one(m: re.Match[str]) -> str:
        path = m.group(0)
        for root, label in ordered:
            if root and (path == root or path.startswith(root + "/")):
                rest = path[len(root) :].lstrip("/")
                # Staging and attempt folders carry ids: the format folder and file are enough.
                rest = re.sub(r"^(?:\.staging/[^/]+/out|[0-9a-f-]{36}/[^/]+)/?", "", rest)
                shown = "/".join(x for x in (label, rest) if x)
                return shown or Path(path).name or "."
        return Path(path).name or "."

    return _ABS_PATH.sub(one, text)


def shorten(text: str, limit: int = MAX_CHARS) -> str:
    text = _LIST_TAIL.sub(".", text).strip()
    if len(text) <= limit:
        return text
    cut = text[:limit].rsplit(" ", 1)[0]
    return cut.rstrip(" ,;:") + " ..."


def public_message(exc: BaseException, roots: Mapping[Path, str]) -> str:
    """The job's error message for an exception: no server paths, at most MAX_CHARS."""
    raw = f"{exc}" if isinstance(exc, HiggsError) else f"{type(exc).__name__}: {exc}"
    return shorten(scrub_paths(raw, roots))


def volume_free(path: Path) -> tuple[int, int] | None:
    """(free, total) bytes of the volume holding `path`, None when it cannot be read."""
    p = path
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        usage = shutil.disk_usage(p)
    except OSError:
        return None
    return usage.free, usage.total
