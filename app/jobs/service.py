"""Business rules of the jobs API: validate a request into a versioned job config before any
job exists, create jobs idempotently, list, cancel, and render jobs for the API."""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy.engine import Connection
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from app.db.base import utcnow
from app.db.models import STATUSES, Job, JobLayer
from app.errors import (
    ConflictError,
    NotSupportedError,
    QuotaExceededError,
    ValidationFailedError,
)
from app.jobs import repository, state
from app.jobs.disk import check_disk_quota
from app.jobs.job_config import JobConfig
from app.jobs.local_models import read_architecture
from app.jobs.model_ref import LocalNames, ModelRefError, ModelSource, resolve_model
from app.jobs.schemas import JobCreate, JobOut, Options
from app.keys.service import AuthKey, lock_key
from app.params import has_control_char
from app.plans.planner import DYNAMIC_TARGETS, check_dynamic_target, check_grid_dim
from app.settings import Settings
from app.webhooks.urls import WebhookUrlError, check_webhook_url
from higgs_engine.errors import InvalidConfigError
from higgs_engine.planning.config import (
    CONFIG_VERSION,
    DEFAULT_METHOD,
    SUPPORTED_GRIDS,
    HiggsConfig,
    check_method_job,
)
from higgs_engine.planning.ct_targets import (
    CT_BITS,
    CT_DTYPES,
    CT_FORMAT,
    CT_MIN_AVG_BITS,
    ct_architecture_problem,
)
from higgs_engine.planning.stages import stage_unit

_IDEMPOTENCY_KEY = re.compile(r"^[\x21-\x7e]{1,255}$")
_DYNAMIC = DYNAMIC_TARGETS
# hub(model_id, revision) -> the Hub model's architecture, None when unknown
HubLookup = Callable[[str, str | None], str | None]


class ReportNotReadyError(ConflictError):
    code, title = "report_not_ready", "No report yet"


class IdempotencyConflictError(ValidationFailedError):
    code, title = "idempotency_conflict", "Idempotency-Key reused with another request"


@dataclass(frozen=True)
class JobSpec:
    """A validated request: what is stored on the job."""

    request: dict[str, Any]
    request_hash: str
    config: JobConfig
    model_id: str
    webhook_url: str | None = None


def config_error_field(error: InvalidConfigError, target_kind: str) -> str:
    """The request field an engine InvalidConfigError is about (its `field`): a bit budget is
    the target, an option of the request is that option, anything else the options."""
    if error.field == "bits":
        return f"target.{target_kind}"
    if error.field in Options.model_fields:
        return f"options.{error.field}"
    return "options"


def validate_request(
    req: JobCreate,
    settings: Settings,
    registry: LocalNames | None = None,
    hub: HubLookup | None = None,
) -> JobSpec:
    """Everything checkable before a job exists; ValidationFailedError (422) naming the field.
    `registry`: the local models the workers registered (the API needs no models folder);
    `hub`: how a Hub model's architecture is read (app.jobs.hub_check, bounded and cached;
    None: not at submit, the worker checks it)."""
    try:
        ref = resolve_model(req.model.id, req.model.revision, settings.models_dir, registry)
    except ModelRefError as e:
        raise ValidationFailedError.field(e.field, str(e)) from e
    kind, value = req.target.kind, req.target.value
    opts = req.options
    if kind in _DYNAMIC and not settings.dynamic_targets:
        raise NotSupportedError.field(
            f"target.{kind}",
            f"target.{kind} is not supported yet: dynamic HIGGS targets are switched off on "
            "this service (HIGGS_DYNAMIC_TARGETS=false); use target.bits",
        )
    gguf = "gguf" in opts.formats
    ct = CT_FORMAT in opts.formats
    if gguf:
        check_gguf_request(req, ref, registry, hub)
    elif ct:
        check_ct_request(req, ref, registry, hub)
    cfg = _engine_config(req, gguf or ct, settings)
    try:
        check_method_job(
            opts.method,
            calibrated=opts.calibration is not None,
            dynamic=kind in _DYNAMIC,
            gguf=gguf,
        )
    except InvalidConfigError as e:
        raise ValidationFailedError.field("options.method", str(e)) from e
    webhook_url = _webhook_url(req, settings)
    if opts.gguf_rotate is not None and not gguf:
        raise ValidationFailedError.field(
            "options.gguf_rotate", 'options.gguf_rotate is an option of formats ["gguf"]'
        )
    request, request_hash = _canonical_request(req)
    return JobSpec(
        request=request,
        request_hash=request_hash,
        config=JobConfig(
            engine=cfg.to_dict(),
            target={kind: value},
            evaluate=opts.evaluate,
            menu_p=opts.p if kind in DYNAMIC_TARGETS and not (gguf or ct) else None,
            gguf=gguf,
            gguf_rotate=opts.gguf_rotate if gguf else None,
            ct=ct,
        ),
        model_id=req.model.id,
        webhook_url=webhook_url,
    )


def _engine_config(req: JobCreate, whole_file: bool, settings: Settings) -> HiggsConfig:
    """The engine's HiggsConfig of a request (for a whole-file job, GGUF or compressed-tensors,
    the defaults, unused but for the dtype), its grid
    options and dynamic target checked; 422 naming the field."""
    kind, value = req.target.kind, req.target.value
    opts = req.options
    common: dict[str, Any] = {
        "group_size": opts.group_size,
        "rotation_block": opts.rotation_block,
        # a whole-file job's HIGGS config is unused: the engine's defaults
        "formats": ("native",) if whole_file else tuple(opts.formats),
        "skip": tuple(opts.skip),
        "dtype": opts.dtype,
        "sign_seed": opts.sign_seed,
        "scale_rule": opts.scale_rule,
        "seed": opts.seed,
        # a GGUF job quantizes the embedding in llama.cpp's types; its HIGGS config is unused
        "scope": "linear" if whole_file else opts.scope,
        "method": DEFAULT_METHOD if whole_file else opts.method,
    }
    check_grid_dim(opts.p)
    sizes = SUPPORTED_GRIDS.get(opts.p) if opts.p is not None else None
    all_sizes = sorted({n for ns in SUPPORTED_GRIDS.values() for n in ns})
    if opts.n is not None and opts.n not in (sizes or all_sizes):
        raise ValidationFailedError.field(
            "options.n",
            f"options.n={opts.n} is not a supported grid size; choose one of {list(sizes or all_sizes)}",
        )
    try:
        if kind == "bits":
            cfg = HiggsConfig.from_bits(value, p=opts.p, n=opts.n, **common)
        else:
            # The allocator picks per-layer grids; (p, n) is the base the overrides refine.
            grid: dict[str, Any] = {
                k: v for k, v in (("p", opts.p), ("n", opts.n)) if v is not None
            }
            cfg = HiggsConfig(**grid, **common)
    except InvalidConfigError as e:
        raise ValidationFailedError.field(config_error_field(e, kind), str(e)) from e
    if kind in _DYNAMIC:
        check_dynamic_target(
            kind,
            value,
            group_size=opts.group_size,
            p=opts.p,
            n=opts.n,
            ppl_limit=settings.max_ppl_increase_limit,
        )
    if cfg.version != CONFIG_VERSION:  # pragma: no cover - the engine checks this itself
        raise ValidationFailedError.field("options", f"engine config version {cfg.version}")
    return cfg


def _webhook_url(req: JobCreate, settings: Settings) -> str | None:
    """The request's webhook_url once the URL rules accept it (422 naming webhook_url)."""
    if req.webhook_url is None:
        return None
    try:
        return check_webhook_url(req.webhook_url, allow_private=settings.webhook_allow_private)
    except WebhookUrlError as e:
        raise ValidationFailedError.field("webhook_url", str(e)) from e


def _canonical_request(req: JobCreate) -> tuple[dict[str, Any], str]:
    """The request as stored and its sha256 (what an Idempotency-Key replay must match).
    Options added later are left out at their defaults, so earlier requests hash as before."""
    request = req.model_dump(mode="json")
    if request["options"].get("scope") == "linear":
        del request["options"]["scope"]  # the default: the stored request (and hash) as before
    if request.get("webhook_url") is None:
        request.pop("webhook_url", None)  # the stored request (and its hash) as before webhooks
    if request.get("options", {}).get("gguf_rotate") is None:
        request.get("options", {}).pop("gguf_rotate", None)  # likewise
    if request["options"].get("method") == DEFAULT_METHOD:
        del request["options"]["method"]  # likewise
    canonical = json.dumps(request, sort_keys=True, separators=(",", ":"))
    return request, hashlib.sha256(canonical.encode()).hexdigest()


# Options of HIGGS artifacts only: a gguf job given any of them is refused, naming each, rather
# than run with the option silently ignored.
HIGGS_ONLY_OPTIONS = (
    "p",
    "n",
    "group_size",
    "rotation_block",
    "skip",
    "dtype",
    "sign_seed",
    "scale_rule",
    "seed",
)


def request_architecture(
    req: JobCreate, ref: ModelSource, registry: LocalNames | None, hub: HubLookup | None
) -> str | None:
    """The requested model's architecture where it can be known at submit: a local model's as
    the workers registered it, or read here when this process has the models folder; a Hub
    model's from its config.json when the Hub answers in time (None otherwise: the worker
    checks it before any work)."""
    if ref.kind == "local":
        if ref.path is not None:
            return read_architecture(ref.path)
        return None if registry is None else registry.architecture(req.model.id)
    if ref.kind == "hub" and hub is not None:
        return hub(req.model.id, req.model.revision)
    return None


def check_gguf_request(
    req: JobCreate, ref: ModelSource, registry: LocalNames | None, hub: HubLookup | None = None
) -> None:
    """What a GGUF job can be asked for: the format alone, no HIGGS option, data-free, a
    target within llama.cpp's types, and an architecture llama.cpp's converter knows (a local
    model's as the workers registered it, a Hub model's from its config.json through `hub`,
    read with the job's own Hub token)."""
    from higgs_engine.planning.gguf_types import (
        GGUF_ARCHITECTURES,
        max_menu_bits,
        min_menu_bits,
    )

    opts = req.options
    higgs_only = [name for name in HIGGS_ONLY_OPTIONS if name in opts.model_fields_set]
    if higgs_only:
        names = ", ".join(f"options.{name}" for name in higgs_only)
        raise ValidationFailedError(
            f"{names}: HIGGS options that a gguf file does not take (its tensors are in "
            "llama.cpp's own types, chosen for the target); omit them",
            errors=[
                {
                    "field": f"options.{name}",
                    "message": f"options.{name} is a HIGGS option; a gguf job does not take it",
                }
                for name in higgs_only
            ],
        )
    if "scope" in opts.model_fields_set and opts.scope != "all":
        raise ValidationFailedError.field(
            "options.scope",
            f"options.scope={opts.scope!r}: a gguf file always quantizes the token embedding "
            "and the output head in llama.cpp's types; omit options.scope (or give all)",
        )
    if len(opts.formats) > 1:
        raise ValidationFailedError.field(
            "options.formats",
            "gguf is a file of llama.cpp's own types, not of HIGGS codes: ask for it alone "
            '(options.formats ["gguf"]) and for native / dequantized in another job',
        )
    if opts.calibration is not None:
        raise ValidationFailedError.field(
            "options.calibration", "the gguf format is data-free: calibration is not available"
        )
    kind, value = req.target.kind, req.target.value
    if kind == "bits" and value < 2:
        raise ValidationFailedError.field(
            "target.bits",
            f"target.bits={value:g} is below the smallest GGUF type (Q2_K, 2 code bits)",
        )
    if kind in ("bits", "avg_bits") and value > max_menu_bits():
        raise ValidationFailedError.field(
            f"target.{kind}",
            f"target.{kind}={value:g} is above the widest GGUF type "
            f"(F16, {max_menu_bits():g} bits per weight)",
        )
    if kind == "avg_bits" and value < min_menu_bits():
        raise ValidationFailedError.field(
            "target.avg_bits",
            f"target.avg_bits={value:g} is below the smallest GGUF type "
            f"({min_menu_bits():g} bits per weight, Q2_K)",
        )
    arch = request_architecture(req, ref, registry, hub)
    if arch is not None and arch not in GGUF_ARCHITECTURES:
        raise ValidationFailedError.field(
            "options.formats",
            f"llama.cpp's converter does not know the architecture {arch} of "
            f"{req.model.id!r}: the gguf format is not available for it",
        )


def check_ct_request(
    req: JobCreate, ref: ModelSource, registry: LocalNames | None, hub: HubLookup | None = None
) -> None:
    """What a compressed-tensors job can be asked for: the format alone, no HIGGS option but a
    16-bit dtype (an uploaded calibration text is taken: GPTQ in each layer's scheme), target.bits
    4 or 8 or a budget vLLM's schemes can meet, and an
    architecture transformers can load as compressed-tensors (a local model's as registered,
    a Hub model's from its config.json through `hub`)."""
    opts = req.options
    higgs_only = [n for n in HIGGS_ONLY_OPTIONS if n in opts.model_fields_set and n != "dtype"]
    if higgs_only or "scope" in opts.model_fields_set or "method" in opts.model_fields_set:
        names = [f"options.{n}" for n in higgs_only]
        names += [f"options.{n}" for n in ("scope", "method") if n in opts.model_fields_set]
        raise ValidationFailedError(
            f"{', '.join(names)}: HIGGS options that a compressed-tensors checkpoint does not "
            "take (its layers are in vLLM's schemes, chosen for the target); omit them",
            errors=[
                {
                    "field": n,
                    "message": f"{n} is a HIGGS option; a compressed-tensors job does not take it",
                }
                for n in names
            ],
        )
    if opts.dtype not in CT_DTYPES:
        raise ValidationFailedError.field(
            "options.dtype",
            f"options.dtype={opts.dtype!r}: a compressed-tensors checkpoint is one of "
            f"{', '.join(CT_DTYPES)}",
        )
    if len(opts.formats) > 1:
        raise ValidationFailedError.field(
            "options.formats",
            "compressed-tensors is a checkpoint of vLLM's schemes, not of HIGGS codes: ask for "
            'it alone (options.formats ["compressed-tensors"]) and for other formats in '
            "another job",
        )
    kind, value = req.target.kind, req.target.value
    if kind == "bits" and value not in CT_BITS:
        raise ValidationFailedError.field(
            "target.bits",
            f"target.bits={value:g}: compressed-tensors takes 4 (int4 W4A16) or 8 (int8 per "
            "channel); give target.avg_bits for a mix of vLLM's schemes",
        )
    if kind == "avg_bits" and value < CT_MIN_AVG_BITS:
        raise ValidationFailedError.field(
            "target.avg_bits",
            f"target.avg_bits={value:g} is below the cheapest compressed-tensors scheme "
            f"(int4 in groups of 128, {CT_MIN_AVG_BITS:g} bits per weight)",
        )
    arch = request_architecture(req, ref, registry, hub)
    problem = None if arch is None else ct_architecture_problem(arch)
    if problem is not None:
        raise ValidationFailedError.field(
            "options.formats",
            f"{problem}: the compressed-tensors format is not available for {req.model.id!r}",
        )


def with_calibration(session: Session, key: AuthKey, req: JobCreate, spec: JobSpec) -> JobSpec:
    """`spec` with config["calibration"] = {id, sha256, bytes, tokens} when the request names
    an upload (422 naming the option if it is not this key's or is certainly too short)."""
    from dataclasses import replace

    from app.calibrations.service import job_calibration

    opts = req.options
    if opts.calibration is None:
        if opts.calibration_tokens is not None:
            raise ValidationFailedError.field(
                "options.calibration_tokens", "needs options.calibration (an uploaded text's id)"
            )
        return spec
    entry = job_calibration(session, key, opts.calibration, opts.calibration_tokens)
    return replace(spec, config=spec.config.model_copy(update={"calibration": entry}))


def check_idempotency_key(key: str | None) -> str | None:
    if key is None:
        return None
    if not _IDEMPOTENCY_KEY.match(key):
        raise ValidationFailedError.field(
            "Idempotency-Key",
            f"Idempotency-Key {key[:60]!r} must be 1..255 printable ASCII characters without spaces",
        )
    return key


def _replay(job: Job, spec: JobSpec) -> Job:
    if job.request_hash != spec.request_hash:
        raise IdempotencyConflictError(
            f"Idempotency-Key {job.idempotency_key!r} was already used for job {job.id} with a "
            "different request body",
            errors=[
                {
                    "field": "Idempotency-Key",
                    "message": "already used with a different request body",
                }
            ],
        )
    return job


QUOTA_RETRY_AFTER_S = 30


def _check_active(session: Session, key: AuthKey, max_active: int) -> None:
    active = repository.count_active(session, key.id)
    if active >= max_active:
        raise QuotaExceededError(
            f"this API key has {active} jobs queued or running, the most allowed at once "
            f"({max_active}); submit again when one has finished",
            retry_after=QUOTA_RETRY_AFTER_S,
        )


def check_quota_first(
    session: Session, key: AuthKey, idempotency_key: str | None, max_active: int
) -> None:
    """The job quota before anything costly is checked (a Hub model's config read): 429 when
    the key already has `max_active` jobs queued or running, unless the request replays an
    existing job by its Idempotency-Key (never refused). create_job counts again, under the
    key's lock, before its insert: this early count only spares the work of a refused submit."""
    if max_active <= 0:
        return
    if idempotency_key is not None and repository.by_idempotency_key(
        session, key.id, idempotency_key
    ):
        return
    _check_active(session, key, max_active)


def create_job(
    session: Session,
    key: AuthKey,
    spec: JobSpec,
    idempotency_key: str | None,
    *,
    max_active: int = 0,
    disk_quota: int = 0,
) -> tuple[Job, bool]:
    """Insert the job (status queued) and commit. Returns (job, created). With an
    Idempotency-Key, concurrent identical requests all get the one job: the unique constraint
    (api_key_id, idempotency_key) decides the race, the losers read the winner's row.
    max_active > 0: QuotaExceededError (429) when the key already has that many jobs queued
    or running (a replay of an existing job is never refused). disk_quota > 0:
    DiskQuotaExceededError (422) when the key holds that many bytes of artifacts and scratch."""
    if idempotency_key is not None:
        existing = repository.by_idempotency_key(session, key.id, idempotency_key)
        if existing is not None:
            return _replay(existing, spec), False
    if max_active > 0:
        lock_key(session, key.id)  # the count and the insert below, one key at a time
        _check_active(session, key, max_active)
    check_disk_quota(session, key.id, disk_quota)
    now = utcnow()
    job = Job(
        id=str(uuid.uuid4()),
        api_key_id=key.id,
        idempotency_key=idempotency_key,
        request_hash=spec.request_hash,
        request=spec.request,
        config=spec.config.to_dict(),
        model_id=spec.model_id,
        webhook_url=spec.webhook_url,
        created_at=now,
        updated_at=now,
    )
    session.add(job)
    try:
        session.commit()
    except IntegrityError:
        session.rollback()
        if idempotency_key is None:
            raise
        existing = repository.by_idempotency_key(session, key.id, idempotency_key)
        if existing is None:  # pragma: no cover - the conflicting row must exist
            raise
        return _replay(existing, spec), False
    return job, True


def get_job(session: Session, key: AuthKey, job_id: str) -> Job:
    job = repository.get_owned(session, key.id, job_id)
    if job is None:
        raise state.JobNotFoundError(job_id)
    return job


def read_job(conn: Connection, key: AuthKey, job_id: str) -> repository.JobRecord:
    """get_job for the view alone: one statement on an autocommit connection (Reads)."""
    job = repository.read_owned(conn, key.id, job_id)
    if job is None:
        raise state.JobNotFoundError(job_id)
    return job


def encode_cursor(job: Job | repository.JobRecord) -> str:
    raw = json.dumps([job.created_at.isoformat(), job.id]).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[datetime, str]:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        created, job_id = json.loads(raw)
        when = datetime.fromisoformat(created)
        if when.tzinfo is None or not isinstance(job_id, str) or has_control_char(job_id):
            raise ValueError("bad cursor fields")
        when = when.astimezone(UTC)  # OverflowError past either end of the calendar
    except (ValueError, TypeError, OverflowError, binascii.Error, json.JSONDecodeError) as e:
        raise ValidationFailedError.field(
            "after", f"after={cursor[:80]!r} is not a cursor from this API"
        ) from e
    return when, job_id


def list_jobs(
    conn: Connection,
    key: AuthKey,
    *,
    status: str | None,
    limit: int,
    after: str | None,
    max_limit: int,
) -> tuple[list[repository.JobRecord], str | None]:
    if status is not None and status not in STATUSES:
        raise ValidationFailedError.field(
            "status", f"status={status!r} must be one of {', '.join(STATUSES)}"
        )
    if not 1 <= limit <= max_limit:
        raise ValidationFailedError.field(
            "limit", f"limit={limit} must be between 1 and {max_limit}"
        )
    rows = repository.read_page(
        conn, key.id, status=status, limit=limit, after=decode_cursor(after) if after else None
    )
    has_more = len(rows) > limit
    rows = rows[:limit]
    return rows, (encode_cursor(rows[-1]) if has_more and rows else None)


def cancel_job(session: Session, key: AuthKey, job_id: str) -> Job:
    get_job(session, key, job_id)
    state.request_cancel(session, job_id)
    return get_job(session, key, job_id)


def job_layers(session: Session, key: AuthKey, job_id: str) -> list[JobLayer]:
    job = get_job(session, key, job_id)
    return repository.layers(session, job.id)


def job_report(session: Session, key: AuthKey, job_id: str) -> dict[str, Any]:
    job = get_job(session, key, job_id)
    if job.report is None:
        raise ReportNotReadyError(
            f"job {job_id} has no report yet (status {job.status}); reports exist once a job succeeded"
        )
    return job.report


def job_url(job_id: str) -> str:
    return f"/v1/jobs/{job_id}"


def job_view(job: Job | repository.JobRecord) -> JobOut:
    total = job.progress_total
    failed = job.error_code is not None
    request = job.request or {}
    arts = job.artifacts if job.status == "succeeded" else []
    return JobOut.model_validate(
        {
            "id": job.id,
            "status": job.status,
            "stage": job.stage,
            "progress": {
                "done": job.progress_done,
                "total": total,
                "fraction": round(job.progress_done / total, 4) if total else None,
                "unit": stage_unit(job.stage),
            },
            "cancel_requested": job.cancel_requested,
            "attempts": job.attempts,
            "model": {
                "id": job.model_id,
                "revision": (request.get("model") or {}).get("revision"),
                "resolved_revision": job.model_revision,
            },
            "created_at": job.created_at,
            "started_at": job.started_at,
            "finished_at": job.finished_at,
            "updated_at": job.updated_at,
            "request": request,
            "config": job.config,
            "error": {
                "code": job.error_code,
                "message": job.error_message or "",
                "scratch_reclaimed_bytes": job.scratch_reclaimed_bytes,
            }
            if failed
            else None,
            "summary": job.summary,
            "stage_durations": job.stage_durations,
            "webhook_url": job.webhook_url,
            "artifacts": [
                {
                    "format": a.format,
                    "url": f"{job_url(job.id)}/artifacts/{a.format}",
                    "bytes": a.total_bytes,
                    "sha256": a.sha256,
                }
                for a in arts
            ],
        }
    )
