"""A Hub model's architecture read at submit: its config.json only (a few KB, never weights),
so that a format the model cannot have (gguf for an architecture llama.cpp's converter does not
know) is a 422 when the job is asked for, not a failed job later.

The file comes from the Hub endpoint huggingface_hub uses (HF_ENDPOINT, default
https://huggingface.co), read here without importing it, with the token the job itself will
use (app.keys.hub_token: the key's own, or the service's where the operator allows it; never
the process's HF_TOKEN or stored login). The
whole fetch is bounded by `timeout_s` of wall time and 1 MiB; anything that goes wrong (no
network, a private or gated repository, a missing file, a slow answer, bad JSON) answers None:
the architecture is then unknown here and the worker checks it before any work. Nothing is
cached here: app.jobs.hub_check bounds how many of these reads run at once and keeps their
answers and failures, per token.
"""

from __future__ import annotations

import json
import os
import time
from urllib.parse import quote

import httpx

__all__ = ["MAX_CONFIG_BYTES", "hub_architecture"]

MAX_CONFIG_BYTES = 1024 * 1024


def hub_endpoint() -> str:
    """The Hub's address as huggingface_hub reads it (HF_ENDPOINT), without importing it
    (the API process keeps the model-side libraries out)."""
    return os.environ.get("HF_ENDPOINT") or "https://huggingface.co"


def _config_url(model_id: str, revision: str) -> str:
    return f"{hub_endpoint().rstrip('/')}/{model_id}/resolve/{quote(revision, safe='')}/config.json"


def _fetch(url: str, timeout_s: float, token: str | None) -> bytes | None:
    headers = {"User-Agent": "higgs-service (architecture check)"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    deadline = time.monotonic() + timeout_s
    body = bytearray()
    with (
        httpx.Client(timeout=timeout_s, follow_redirects=True, max_redirects=3) as client,
        client.stream("GET", url, headers=headers) as r,
    ):
        if r.status_code != 200:
            return None
        for chunk in r.iter_bytes():
            body += chunk
            if len(body) > MAX_CONFIG_BYTES or time.monotonic() > deadline:
                return None
    return bytes(body)


def hub_architecture(
    model_id: str, revision: str | None, timeout_s: float, token: str | None = None
) -> str | None:
    """The first `architectures` entry of the Hub model's config.json at `revision` (default
    main), read with `token` (None: anonymously), or None when it cannot be read within
    `timeout_s` (0: never asked). Blocking: it holds its thread until the Hub answers or the
    time is up."""
    if timeout_s <= 0:
        return None
    try:
        raw = _fetch(_config_url(model_id, revision or "main"), timeout_s, token)
        cfg = json.loads(raw) if raw is not None else None
    except (httpx.HTTPError, ValueError, OSError):
        cfg = None
    archs = cfg.get("architectures") if isinstance(cfg, dict) else None
    if isinstance(archs, list) and archs and isinstance(archs[0], str):
        return archs[0][:128]
    return None
