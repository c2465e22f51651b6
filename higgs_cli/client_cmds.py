"""Client verbs of the `higgs` command: submit, status, download (REST API v1 over httpx).

Every failure is one line on stderr and a non-zero exit (ClientError), never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import quote

import httpx

from app.artifacts.manifest import sha256_file  # pure Python: hashlib only
from higgs_cli.common import CliError
from higgs_engine.planning.config import (
    METHOD_NAMES,
    SCOPES,
    WHOLE_FILE_FORMATS,
    WRITER_FORMATS,
)

DEFAULT_URL = "http://127.0.0.1:8000"
TERMINAL = ("succeeded", "failed", "cancelled")
CHUNK = 1 << 20


class ClientError(CliError):
    """An expected failure of a client command; higgs_cli.main prints it as one line."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message, exit_code)


# ---------------------------------------------------------------- HTTP helpers


def problem_message(resp: httpx.Response) -> str:
    """One line describing an error response (problem+json when the server sent it)."""
    try:
        body = resp.json()
    except ValueError:
        text = resp.text.strip().splitlines()
        return f"HTTP {resp.status_code}: {text[0][:200] if text else resp.reason_phrase}"
    if not isinstance(body, dict):
        return f"HTTP {resp.status_code}: {str(body)[:200]}"
    parts = [str(body.get("title") or resp.reason_phrase)]
    if body.get("detail"):
        parts.append(str(body["detail"]))
    for err in body.get("errors") or []:
        if isinstance(err, dict):
            loc = err.get("field") or err.get("loc") or err.get("pointer")
            if isinstance(loc, list):
                loc = ".".join(str(x) for x in loc)
            msg = err.get("message") or err.get("msg") or err.get("detail") or ""
            parts.append(f"{loc}: {msg}" if loc else str(msg))
    return f"HTTP {resp.status_code}: " + "; ".join(parts)


class Api:
    """A thin client for the service's REST API."""

    def __init__(self, url: str, key: str | None, timeout: float = 30.0) -> None:
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    def close(self) -> None:
        self.http.close()

    def request(self, method: str, path: str, **kw: Any) -> httpx.Response:
        try:
            resp = self.http.request(method, path, **kw)
        except httpx.TransportError as exc:
            raise ClientError(f"cannot reach the service at {self.url}: {exc}") from exc
        if resp.status_code >= 400:
            raise ClientError(problem_message(resp))
        return resp

    def json(self, method: str, path: str, **kw: Any) -> Any:
        resp = self.request(method, path, **kw)
        try:
            return resp.json()
        except ValueError as exc:
            raise ClientError(
                f"{method} {path}: the service answered non-JSON ({resp.status_code})"
            ) from exc

    def job(self, job_id: str) -> dict[str, Any]:
        return self.json("GET", f"/v1/jobs/{quote(job_id, safe='')}")


def connect(args: argparse.Namespace) -> Api:
    url = args.url or os.environ.get("HIGGS_URL") or DEFAULT_URL
    key = args.key or os.environ.get("HIGGS_API_KEY")
    if not key:
        raise ClientError(
            "no API key: pass --key or set HIGGS_API_KEY (create one with `higgs keys create NAME`)"
        )
    if not url.startswith(("http://", "https://")):
        raise ClientError(f"--url {url!r} must start with http:// or https://")
    return Api(url, key)


# ---------------------------------------------------------------- submit


def build_request(args: argparse.Namespace) -> dict[str, Any]:
    """The POST /v1/jobs body for the command-line arguments (the server validates the rest)."""
    targets = {
        "bits": args.bits,
        "avg_bits": args.avg_bits,
        "max_ppl_increase": args.max_ppl_increase,
    }
    given = {k: v for k, v in targets.items() if v is not None}
    if len(given) != 1:
        raise ClientError(
            "give exactly one target: --bits B, --avg-bits B or --max-ppl-increase R", 2
        )
    model: dict[str, Any] = {"id": args.model}
    if args.revision:
        model["revision"] = args.revision
    options: dict[str, Any] = {}
    if args.p is not None:
        options["p"] = args.p
    if args.n is not None:
        options["n"] = args.n
    if args.group_size is not None:
        options["group_size"] = args.group_size
    if args.formats:
        options["formats"] = [f.strip() for f in args.formats.split(",") if f.strip()]
    if args.evaluate is not None:
        options["evaluate"] = args.evaluate
    if getattr(args, "scope", None) is not None:
        options["scope"] = args.scope
    if getattr(args, "method", None) is not None:
        options["method"] = args.method
    if getattr(args, "calibration_tokens", None) is not None:
        if not getattr(args, "calibration", None):
            raise ClientError("--calibration-tokens needs --calibration FILE", 2)
        options["calibration_tokens"] = args.calibration_tokens
    if getattr(args, "gguf_rotate", None) is not None:
        options["gguf_rotate"] = args.gguf_rotate
    body: dict[str, Any] = {"model": model, "target": given}
    if options:
        body["options"] = options
    if getattr(args, "webhook_url", None):
        body["webhook_url"] = args.webhook_url
    return body


def _progress_of(job: dict[str, Any]) -> tuple[str, int, int]:
    prog = job.get("progress") or {}
    return str(job.get("stage") or ""), int(prog.get("done") or 0), int(prog.get("total") or 0)


def _unit_of(job: dict[str, Any]) -> str:
    """What the job's progress counts, as the API says (progress.unit)."""
    return str((job.get("progress") or {}).get("unit") or "step")


def wait_for(
    api: Api,
    job_id: str,
    *,
    interval: float = 0.5,
    timeout: float | None = None,
    show: bool = True,
    sleep: Callable[[float], None] = time.sleep,
) -> dict[str, Any]:
    """Poll the job until it ends, drawing a live progress bar (stage, done/total in the
    stage's unit)."""
    from tqdm import tqdm

    bar = tqdm(total=0, unit="step", disable=not show, file=sys.stderr, dynamic_ncols=True)
    deadline = None if timeout is None else time.monotonic() + timeout
    last: tuple[str, int, int] | None = None
    try:
        while True:
            job = api.job(job_id)
            stage, done, total = _progress_of(job)
            if (stage, done, total) != last:
                if last is None or total != last[2] or stage != last[0]:
                    bar.reset(total=total or None)
                    bar.unit = _unit_of(job)
                bar.set_description(
                    f"{job.get('status')}:{stage}" if stage else str(job.get("status"))
                )
                bar.n = done
                bar.refresh()
                last = (stage, done, total)
            if job.get("status") in TERMINAL:
                return job
            if deadline is not None and time.monotonic() > deadline:
                raise ClientError(f"job {job_id} still {job.get('status')} after {timeout:g} s")
            sleep(interval)
    finally:
        bar.close()


def _summary_line(job: dict[str, Any]) -> str:
    s = job.get("summary") or {}
    bits = s.get("bits_per_weight")
    parts = [f"job {job.get('id')} {job.get('status')}"]
    if bits is not None:
        parts.append(f"{float(bits):.4f} bits/weight")
    if s.get("bits_per_param_total") is not None:
        parts.append(f"{float(s['bits_per_param_total']):.3f} bits/param (whole model)")
    if s.get("bytes_before") and s.get("bytes_after"):
        parts.append(f"{s['bytes_before'] / 2**20:.1f} MiB -> {s['bytes_after'] / 2**20:.1f} MiB")
    if s.get("ppl_base") and s.get("ppl_quantized"):
        parts.append(f"ppl {float(s['ppl_base']):.3f} -> {float(s['ppl_quantized']):.3f}")
    cal = s.get("calibration")
    if isinstance(cal, dict) and cal.get("sha256"):
        parts.append(f"calibrated on {cal.get('tokens')} tokens (sha256 {str(cal['sha256'])[:12]})")
    return ", ".join(parts)


def read_calibration(path: str) -> bytes:
    """The --calibration file's bytes, checked before anything is uploaded (one-line errors)."""
    from higgs_engine.calibration import read_calibration_file
    from higgs_engine.errors import InvalidConfigError

    try:
        text = read_calibration_file(Path(path))
    except InvalidConfigError as exc:
        raise ClientError(str(exc), 2) from None
    return text.encode("utf-8")


def upload_calibration(api: Api, data: bytes) -> dict[str, Any]:
    """POST /v1/calibrations with the text as the body: {id, sha256, bytes, created_at}."""
    headers = {"Content-Type": "text/plain; charset=utf-8"}
    up: dict[str, Any] = api.json("POST", "/v1/calibrations", content=data, headers=headers)
    return up


def cmd_submit(args: argparse.Namespace) -> int:
    body = build_request(args)
    cal_data = read_calibration(args.calibration) if args.calibration else None
    api = connect(args)
    try:
        if cal_data is not None:
            up = upload_calibration(api, cal_data)
            body.setdefault("options", {})["calibration"] = up["id"]
            if not args.quiet:
                print(
                    f"uploaded calibration {up['id']} ({up['bytes']} bytes, sha256 {up['sha256'][:12]})",
                    file=sys.stderr,
                )
        headers = {"Idempotency-Key": args.idempotency_key} if args.idempotency_key else {}
        job = api.json("POST", "/v1/jobs", json=body, headers=headers)
        job_id = str(job["id"])
        if not args.wait:
            print(job_id)
            return 0
        print(f"submitted job {job_id}", file=sys.stderr)
        job = wait_for(
            api, job_id, interval=args.interval, timeout=args.timeout, show=not args.quiet
        )
        if job.get("status") != "succeeded":
            err = job.get("error") or {}
            raise ClientError(
                f"job {job_id} {job.get('status')}: {err.get('code', '')} {err.get('message', '')}".rstrip()
            )
        print(_summary_line(job))
        if args.out:
            fmt = args.format or (body.get("options", {}).get("formats") or ["native"])[0]
            download_artifact(api, job_id, fmt, Path(args.out), show=not args.quiet)
            print(f"downloaded {fmt} artifact to {args.out}")
        print(job_id)
        return 0
    finally:
        api.close()


# ---------------------------------------------------------------- status


def cmd_status(args: argparse.Namespace) -> int:
    api = connect(args)
    try:
        job = api.job(args.job_id)
    finally:
        api.close()
    if args.json:
        print(json.dumps(job, indent=2, sort_keys=True))
        return 0
    stage, done, total = _progress_of(job)
    print(f"id:       {job.get('id')}")
    print(f"status:   {job.get('status')}")
    if job.get("stage"):
        print(f"stage:    {stage} {done}/{total}")
    for k in ("created_at", "started_at", "finished_at"):
        if job.get(k):
            print(f"{k + ':':<9} {job[k]}")
    if job.get("error"):
        print(f"error:    {job['error'].get('code')}: {job['error'].get('message')}")
        if job["error"].get("scratch_reclaimed_bytes"):
            reclaimed = int(job["error"]["scratch_reclaimed_bytes"])
            print(f"scratch:  {reclaimed} bytes of the stopped attempts' scratch removed")
    if job.get("summary"):
        print("summary:  " + _summary_line(job))
    for a in job.get("artifacts") or []:
        print(f"artifact: {a.get('format')} {a.get('bytes')} bytes {a.get('url')}")
    return 0


# ---------------------------------------------------------------- download


def safe_relpath(rel: str) -> PurePosixPath:
    """A listed file path, refused when it could escape the output directory."""
    p = PurePosixPath(rel)
    if p.is_absolute() or ".." in p.parts or not p.parts:
        raise ClientError(f"the service listed an unsafe file path {rel!r}")
    return p


def download_file(
    api: Api, url: str, dest: Path, size: int, sha256: str, show: bool = False
) -> str:
    """Download one file to `dest`, resuming `dest.part` with a Range request; verify sha256.

    Returns "skipped" (already complete), "resumed" or "downloaded".
    """
    if dest.exists() and dest.stat().st_size == size and sha256_file(dest) == sha256:
        return "skipped"
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    have = part.stat().st_size if part.exists() else 0
    if have > size:
        part.unlink()
        have = 0
    outcome = "resumed" if have else "downloaded"
    if have < size or size == 0:
        headers = {"Range": f"bytes={have}-"} if have else {}
        try:
            with api.http.stream("GET", url, headers=headers) as resp:
                if resp.status_code >= 400:
                    resp.read()
                    raise ClientError(problem_message(resp))
                if have and resp.status_code != 206:
                    # The server ignored the range: start over.
                    have, outcome = 0, "downloaded"
                mode = "ab" if have else "wb"
                from tqdm import tqdm

                with (
                    part.open(mode) as f,
                    tqdm(
                        total=size,
                        initial=have,
                        unit="B",
                        unit_scale=True,
                        disable=not show,
                        desc=dest.name,
                        file=sys.stderr,
                        leave=False,
                    ) as bar,
                ):
                    for chunk in resp.iter_bytes(CHUNK):
                        f.write(chunk)
                        bar.update(len(chunk))
        except httpx.TransportError as exc:
            raise ClientError(
                f"download of {dest.name} interrupted ({exc}); run the same command again to resume"
            ) from exc
    got = sha256_file(part)
    if got != sha256:
        part.unlink()
        raise ClientError(
            f"{dest.name}: sha256 {got} does not match the service's {sha256}; removed, retry"
        )
    os.replace(part, dest)
    return outcome


def download_artifact(
    api: Api, job_id: str, fmt: str, out: Path, show: bool = False
) -> dict[str, str]:
    """Download every file of the job's `fmt` artifact into `out` (verified); returns path -> outcome."""
    base = f"/v1/jobs/{quote(job_id, safe='')}/artifacts/{quote(fmt, safe='')}"
    listing = api.json("GET", base)
    files = listing.get("files") if isinstance(listing, dict) else None
    if not isinstance(files, list):
        raise ClientError(f"GET {base}: unexpected answer without a file list")
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, str] = {}
    for entry in files:
        rel = safe_relpath(str(entry["path"]))
        url = base + "/files/" + "/".join(quote(p, safe="") for p in rel.parts)
        results[str(rel)] = download_file(
            api, url, out.joinpath(*rel.parts), int(entry["bytes"]), str(entry["sha256"]), show
        )
    return results


def cmd_download(args: argparse.Namespace) -> int:
    api = connect(args)
    try:
        results = download_artifact(
            api, args.job_id, args.format, Path(args.out), show=not args.quiet
        )
    finally:
        api.close()
    for path, outcome in sorted(results.items()):
        print(f"{outcome:<10} {path}")
    print(f"{len(results)} files of the {args.format} artifact of job {args.job_id} in {args.out}")
    return 0


# ---------------------------------------------------------------- argparse


def _positive(kind: type) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {kind.__name__}") from None
        if v <= 0:
            raise argparse.ArgumentTypeError(f"{text!r} must be positive")
        return v

    return parse


def _add_conn(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--url", default=None, help=f"service URL (env HIGGS_URL, default {DEFAULT_URL})"
    )
    p.add_argument("--key", default=None, help="API key (env HIGGS_API_KEY)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars")


def register(subparsers: Any) -> None:
    """Add the client verbs to the `higgs` sub-command parser."""
    p = subparsers.add_parser(
        "submit",
        help="submit a quantization job to a service",
        description="Submit a quantization job. Recommended: --avg-bits B (e.g. 4.13), because the "
        "allocator then spends the bits where the model is sensitive (a data-free profile, measured "
        "once per model and cached), which beats one bit width everywhere at the same size; "
        "--bits B quantizes every layer alike, --max-ppl-increase R picks the smallest model within R.",
    )
    p.add_argument(
        "model", help="Hub id (owner/name) or the name of a model the service serves locally"
    )
    p.add_argument("--revision", default=None, help="Hub revision (branch, tag or commit)")
    p.add_argument(
        "--avg-bits",
        type=_positive(float),
        default=None,
        help="recommended: average bits per weight, every overhead counted (dynamic HIGGS)",
    )
    p.add_argument(
        "--bits", type=_positive(float), default=None, help="uniform HIGGS code bits per weight"
    )
    p.add_argument(
        "--max-ppl-increase", type=_positive(float), default=None, help="e.g. 0.05 = 5%%"
    )
    p.add_argument("--p", type=int, default=None, help="grid dimension (1 or 2)")
    p.add_argument("--n", type=int, default=None, help="grid size")
    p.add_argument("--group-size", type=int, default=None)
    p.add_argument(
        "--formats",
        default=None,
        help=f"comma separated: any of {','.join(WRITER_FORMATS)} (HIGGS), or one of "
        f"{','.join(WHOLE_FILE_FORMATS)} alone (gguf: a llama.cpp file; compressed-tensors: "
        "a checkpoint vLLM and transformers load)",
    )
    p.add_argument(
        "--scope",
        choices=SCOPES,
        default=None,
        help="linear (default): the linear layers; all: also the token embedding and an untied head",
    )
    p.add_argument(
        "--method",
        choices=METHOD_NAMES,
        default=None,
        help="options.method: higgs (default), higgs-gptq (with --calibration), or a baseline "
        "rtn, nf4, nf4-dq (--formats dequantized, --bits)",
    )
    p.add_argument("--evaluate", dest="evaluate", action="store_true", default=None)
    p.add_argument("--no-evaluate", dest="evaluate", action="store_false")
    p.add_argument(
        "--calibration",
        default=None,
        metavar="FILE",
        help="calibrated HIGGS: upload this UTF-8 text (POST /v1/calibrations) and use it for the job",
    )
    p.add_argument(
        "--calibration-tokens",
        type=_positive(int),
        default=None,
        metavar="N",
        help="calibration tokens (default 8192; the text must have at least N)",
    )
    p.add_argument(
        "--gguf-rotate",
        choices=["off", "on", "auto"],
        default=None,
        help="gguf jobs, llama-family models: rotate the residual stream before converting "
        "(on), or keep whichever the allocator predicts better (auto)",
    )
    p.add_argument("--idempotency-key", default=None)
    p.add_argument("--webhook-url", default=None, help="POST a signed event here when the job ends")
    p.add_argument("--wait", action="store_true", help="follow progress until the job ends")
    p.add_argument("--out", default=None, help="with --wait: download the artifact here")
    p.add_argument(
        "--format",
        default=None,
        help="artifact format to download (default: the first of --formats, else native)",
    )
    p.add_argument("--interval", type=_positive(float), default=0.5, help="poll interval, seconds")
    p.add_argument(
        "--timeout", type=_positive(float), default=None, help="give up waiting after S seconds"
    )
    _add_conn(p)
    p.set_defaults(handler=cmd_submit)

    p = subparsers.add_parser("status", help="show a job")
    p.add_argument("job_id")
    p.add_argument("--json", action="store_true", help="print the job as JSON")
    _add_conn(p)
    p.set_defaults(handler=cmd_status)

    p = subparsers.add_parser(
        "download", help="download a job's artifact (resumes, verifies sha256)"
    )
    p.add_argument("job_id")
    p.add_argument("--format", default="native")
    p.add_argument("--out", required=True, help="output directory")
    _add_conn(p)
    p.set_defaults(handler=cmd_download)
