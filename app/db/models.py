"""The service's tables. Alembic migrations (migrations/) are the only way they are created."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import Mapped, mapped_column, relationship

from app.db.base import Base, utcnow

# Job statuses (app.jobs.state owns the transitions between them).
QUEUED, RUNNING, SUCCEEDED, FAILED, CANCELLED = (
    "queued",
    "running",
    "succeeded",
    "failed",
    "cancelled",
)
STATUSES = (QUEUED, RUNNING, SUCCEEDED, FAILED, CANCELLED)
TERMINAL = frozenset({SUCCEEDED, FAILED, CANCELLED})


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    # The first characters of the key, for display only ("higgs_AbCd..."); never enough to use.
    prefix: Mapped[str] = mapped_column(String(32))
    # sha256 hex of the full key; the key itself is never stored.
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(default=None)
    # The HMAC-SHA256 key that signs this key's webhook events (app.webhooks). It must be
    # readable to sign, so it is stored as is; keys made before webhooks get one when first asked.
    webhook_secret: Mapped[str | None] = mapped_column(String(64), default=None)
    # The key's own Hugging Face Hub token (PUT /v1/keys/me/hub-token), encrypted with the
    # service's HIGGS_HUB_TOKEN_SECRET (app.keys.hub_token); no endpoint ever returns it.
    hub_token: Mapped[str | None] = mapped_column(Text, default=None)
    hub_token_set_at: Mapped[datetime | None] = mapped_column(default=None)


class Job(Base):
    __tablename__ = "jobs"
    __table_args__ = (
        # One job per (key, Idempotency-Key); NULL keys never collide.
        UniqueConstraint("api_key_id", "idempotency_key"),
        # Listing: the caller's jobs newest first, optionally by status.
        Index("ix_jobs_key_created", "api_key_id", "created_at", "id"),
        Index("ix_jobs_status_heartbeat", "status", "heartbeat_at"),
    )

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    api_key_id: Mapped[str] = mapped_column(ForeignKey("api_keys.id"))
    idempotency_key: Mapped[str | None] = mapped_column(String(255), default=None)
    # sha256 of the normalised request: same Idempotency-Key with another body is refused.
    request_hash: Mapped[str] = mapped_column(String(64))
    request: Mapped[dict[str, Any]] = mapped_column()
    # {"version": 1, "engine": HiggsConfig.to_dict(), "target": {...}, "evaluate": bool}
    config: Mapped[dict[str, Any]] = mapped_column()
    model_id: Mapped[str] = mapped_column(String(512))
    # The resolved commit sha (Hub) recorded by the worker; the requested revision is in `request`.
    model_revision: Mapped[str | None] = mapped_column(String(255), default=None)
    # Where the terminal-state event is POSTed (app.webhooks); None = no webhook.
    webhook_url: Mapped[str | None] = mapped_column(Text, default=None)

    status: Mapped[str] = mapped_column(String(16), default=QUEUED, index=True)
    stage: Mapped[str | None] = mapped_column(String(32), default=None)
    progress_done: Mapped[int] = mapped_column(Integer, default=0)
    progress_total: Mapped[int] = mapped_column(Integer, default=0)
    heartbeat_at: Mapped[datetime | None] = mapped_column(default=None)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    worker_id: Mapped[str | None] = mapped_column(String(255), default=None)
    error_code: Mapped[str | None] = mapped_column(String(64), default=None)
    error_message: Mapped[str | None] = mapped_column(Text, default=None)
    # A job back in the queue after its worker found the storage full (error_code storage_full):
    # free bytes on the artifacts volume then. The sweep sends it again once there is more.
    wait_free_bytes: Mapped[int | None] = mapped_column(BigInteger, default=None)
    # The running attempt's scratch (its staging folder) as the worker last measured it:
    # counted with the key's artifacts in its disk quota (app.jobs.disk).
    scratch_bytes: Mapped[int | None] = mapped_column(BigInteger, default=None)
    # Scratch of this job's attempts removed after they stopped (the sweep, or the runner
    # after a failure), in bytes: shown in a failed job's error.
    scratch_reclaimed_bytes: Mapped[int | None] = mapped_column(BigInteger, default=None)
    summary: Mapped[dict[str, Any] | None] = mapped_column(default=None)
    report: Mapped[dict[str, Any] | None] = mapped_column(default=None)
    # Seconds per stage of the last attempt, e.g. {"quantizing": 12.3}.
    stage_durations: Mapped[dict[str, Any] | None] = mapped_column(default=None)
    stage_started_at: Mapped[datetime | None] = mapped_column(default=None)

    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)
    enqueued_at: Mapped[datetime | None] = mapped_column(default=None)
    started_at: Mapped[datetime | None] = mapped_column(default=None)
    finished_at: Mapped[datetime | None] = mapped_column(default=None)

    layers: Mapped[list[JobLayer]] = relationship(
        back_populates="job", cascade="all, delete-orphan", order_by="JobLayer.idx"
    )
    artifacts: Mapped[list[Artifact]] = relationship(
        back_populates="job", cascade="all, delete-orphan", order_by="Artifact.format"
    )


class JobLayer(Base):
    __tablename__ = "job_layers"
    __table_args__ = (UniqueConstraint("job_id", "name"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    idx: Mapped[int] = mapped_column(Integer)
    name: Mapped[str] = mapped_column(String(512))
    shape: Mapped[list[Any]] = mapped_column()
    p: Mapped[int] = mapped_column(Integer)  # 0 = kept in 16 bits
    n: Mapped[int] = mapped_column(Integer)
    bits: Mapped[float] = mapped_column(Float)
    rel_error: Mapped[float | None] = mapped_column(Float, default=None)
    alpha: Mapped[float | None] = mapped_column(Float, default=None)
    bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    # llama.cpp tensor type (Q4_K, F16...) of a GGUF job's tensor; None for HIGGS layers
    type: Mapped[str | None] = mapped_column(String(16), default=None)

    job: Mapped[Job] = relationship(back_populates="layers")


class Artifact(Base):
    __tablename__ = "artifacts"
    __table_args__ = (UniqueConstraint("job_id", "format"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    format: Mapped[str] = mapped_column(String(32))
    # Where the files are, in the artifact store (app.artifacts.store): file:///abs/dir for
    # the local folder, s3://bucket/key-prefix for an S3-compatible store. Published
    # atomically by the worker: nothing is listed here before the job succeeded.
    uri: Mapped[str] = mapped_column(Text)
    total_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    # sha256 of the manifest ("<sha256>  <path>\n" per file, sorted by path).
    sha256: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)

    job: Mapped[Job] = relationship(back_populates="artifacts")
    files: Mapped[list[ArtifactFile]] = relationship(
        back_populates="artifact", cascade="all, delete-orphan", order_by="ArtifactFile.path"
    )


class ArtifactFile(Base):
    __tablename__ = "artifact_files"
    __table_args__ = (UniqueConstraint("artifact_id", "path"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    artifact_id: Mapped[int] = mapped_column(
        ForeignKey("artifacts.id", ondelete="CASCADE"), index=True
    )
    # POSIX path relative to the artifact root, e.g. "model.safetensors" or "sub/x.json".
    path: Mapped[str] = mapped_column(String(1024))
    bytes: Mapped[int] = mapped_column(BigInteger)
    sha256: Mapped[str] = mapped_column(String(64))

    artifact: Mapped[Artifact] = relationship(back_populates="files")


class Profile(Base):
    """A cached sensitivity profile (dynamic HIGGS), keyed by everything that determines it."""

    __tablename__ = "profiles"
    __table_args__ = (
        UniqueConstraint("model_id", "revision", "metric", "text_hash", "token_budget"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    model_id: Mapped[str] = mapped_column(String(512))
    revision: Mapped[str] = mapped_column(String(255))
    metric: Mapped[str] = mapped_column(String(32))
    text_hash: Mapped[str] = mapped_column(String(64))
    token_budget: Mapped[int] = mapped_column(Integer)
    data: Mapped[dict[str, Any]] = mapped_column()
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class WebhookDelivery(Base):
    """One webhook event of a job (its terminal state) and how delivering it went. The row is
    made by the dispatcher once the job is terminal; `attempt_log` keeps every try."""

    __tablename__ = "webhook_deliveries"
    __table_args__ = (
        UniqueConstraint("job_id", "event"),
        Index("ix_webhook_deliveries_state_next", "state", "next_attempt_at"),
    )

    # Also the event id receivers see (Higgs-Event-Id), to drop duplicates.
    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    event: Mapped[str] = mapped_column(String(32))  # "job.succeeded", "job.failed", ...
    url: Mapped[str] = mapped_column(Text)
    payload: Mapped[dict[str, Any]] = mapped_column()
    # pending (tries left) -> delivered | failed (gave up)
    state: Mapped[str] = mapped_column(String(16), default="pending")
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    next_attempt_at: Mapped[datetime | None] = mapped_column(default=None)
    last_status_code: Mapped[int | None] = mapped_column(Integer, default=None)
    last_error: Mapped[str | None] = mapped_column(Text, default=None)
    # [{"at": iso, "status_code": int | None, "error": str | None, "duration_ms": float}]
    attempt_log: Mapped[list[Any]] = mapped_column(default=list)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)
    delivered_at: Mapped[datetime | None] = mapped_column(default=None)


class LocalModel(Base):
    """A model name some worker can read from its models directory (or that an operator
    registered): the API checks submitted names here, never on its own disk
    (app.jobs.local_models)."""

    __tablename__ = "local_models"

    name: Mapped[str] = mapped_column(String(96), primary_key=True)
    # Who has it: "<host>:<models dir>" of a worker, or "operator".
    holder: Mapped[str] = mapped_column(String(255), primary_key=True)
    # Last time the worker registered it; None for an operator's rows (never stale).
    seen_at: Mapped[datetime | None] = mapped_column(default=None)
    # The first `architectures` entry of its config.json (None: not known, e.g. an operator's
    # row or a config without one).
    architecture: Mapped[str | None] = mapped_column(String(128), default=None)


class Calibration(Base):
    """Calibration text uploaded with one API key (POST /v1/calibrations), referenced by id in
    a job's options.calibration. The text is checked (UTF-8, not empty, size limit) on upload."""

    __tablename__ = "calibrations"

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    api_key_id: Mapped[str] = mapped_column(ForeignKey("api_keys.id"), index=True)
    sha256: Mapped[str] = mapped_column(String(64))
    bytes: Mapped[int] = mapped_column(BigInteger)
    text: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


# Part states (app.jobs.parts owns the transitions between them).
PART_QUEUED, PART_RUNNING, PART_DONE, PART_FAILED, PART_CANCELLED = (
    "queued",
    "running",
    "done",
    "failed",
    "cancelled",
)


class JobPart(Base):
    """One part of a job fanned out over many workers (one or more shards of the source). The
    rows of the job's current attempt (job_attempt = jobs.attempts) are the source of truth of
    the fan-out: who runs each part, how far it got, where its output is."""

    __tablename__ = "job_parts"
    __table_args__ = (Index("ix_job_parts_state_heartbeat", "state", "heartbeat_at"),)

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    idx: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_attempt: Mapped[int] = mapped_column(Integer)
    shards: Mapped[list[Any]] = mapped_column()
    # The engine config (HiggsConfig.to_dict()) every part quantizes with, recorded by the
    # coordinator: a dynamic plan's per-layer grids are in it as overrides.
    engine_config: Mapped[dict[str, Any]] = mapped_column()
    # The job plan (higgs_engine.job.JobPlan.to_dict()) the coordinator made once: every part
    # and the assembly run it, nothing is derived again. None on rows written before it.
    plan: Mapped[dict[str, Any] | None] = mapped_column(default=None)
    state: Mapped[str] = mapped_column(String(16), default=PART_QUEUED)
    worker_id: Mapped[str | None] = mapped_column(String(255), default=None)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    progress_done: Mapped[int] = mapped_column(Integer, default=0)
    progress_total: Mapped[int] = mapped_column(Integer, default=0)
    enqueued_at: Mapped[datetime | None] = mapped_column(default=None)
    started_at: Mapped[datetime | None] = mapped_column(default=None)
    heartbeat_at: Mapped[datetime | None] = mapped_column(default=None)
    finished_at: Mapped[datetime | None] = mapped_column(default=None)
    seconds: Mapped[float | None] = mapped_column(Float, default=None)
    error_code: Mapped[str | None] = mapped_column(String(64), default=None)
    error_message: Mapped[str | None] = mapped_column(Text, default=None)
    # Where the part's shard files are: the job attempt's artifact location in the store
    # (named by no artifact row until the assembly publishes it).
    output_uri: Mapped[str | None] = mapped_column(Text, default=None)
    # The finished part's metadata (higgs_engine.parts part.json): its shard files with bytes
    # and sha256, tensor names, layer rows; the assembly reads no shard.
    output: Mapped[dict[str, Any] | None] = mapped_column(default=None)
