"""Service settings: read once from the environment (prefix HIGGS_) and passed down.

Everything defaults to one data directory so that the embedded shape (SQLite file, local
artifacts, a server-less Celery transport) needs no configuration at all.
"""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from higgs_engine.planning.profile import DEFAULT_PROFILE

TASK_NAME = "higgs.run_job"
DEFAULT_QUEUE = "higgs"
GPU_QUEUE = "higgs.gpu"


class Settings(BaseSettings):
    # An empty variable counts as unset (compose passes ${VAR:-} through as "").
    model_config = SettingsConfigDict(env_prefix="HIGGS_", extra="ignore", env_ignore_empty=True)

    data_dir: Path = Path(".higgs")
    # None -> derived from data_dir in the validator below (so the fields are always set after).
    database_url: str = ""
    broker_url: str = ""
    artifacts_dir: Path | None = None
    # Where artifacts are published: unset = artifacts_dir on local disk (the embedded shape);
    # s3://bucket/prefix = an S3-compatible store (app.artifacts.store), credentials the
    # standard AWS way (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, profiles, instance roles).
    artifacts_url: str | None = None
    # A non-AWS S3 endpoint (SeaweedFS, MinIO, Ceph...), e.g. http://127.0.0.1:8333.
    s3_endpoint_url: str | None = None
    s3_region: str | None = None
    # Files above this size are uploaded in parts of this size (S3 minimum: 5 MiB).
    s3_part_size_mb: int = Field(default=64, ge=5, le=5120)
    # Connect and read timeout of one store request (two tries): what an unreachable store
    # costs a download, /readyz or a job before it reads as storage_unavailable.
    s3_timeout_s: float = Field(default=20.0, gt=0)
    # Downloads of S3 artifacts answer 307 to a presigned store URL instead of streaming. The
    # store checks only the URL's own signature and expiry: a presigned URL stays valid for its
    # whole lifetime even after the API key that obtained it is revoked, so it is kept short.
    artifacts_redirect: bool = False
    artifacts_redirect_ttl_s: int = Field(default=300, ge=1, le=7 * 24 * 3600)
    # With a models dir, model id "foo" names the checkpoint directory models_dir/foo.
    models_dir: Path | None = None
    # The service's own Hub token. Jobs use it only for the API keys listed here ("*": every
    # key; comma-separated key ids; empty: none). Otherwise a job uses its key's own token
    # (PUT /v1/keys/me/hub-token), or none: public repositories only.
    hf_token: str | None = None
    hf_token_keys: str = ""
    # Encrypts the per-key Hub tokens in the database (Fernet, a key derived from this string);
    # comma-separated: the first encrypts, every one decrypts (rotation). Unset: keys cannot
    # store a Hub token (422).
    hub_token_secret: str | None = None
    hf_offline: bool = False

    # HTTP
    max_body_bytes: int = Field(default=64 * 1024, gt=0)
    # Calibration text uploads (POST /v1/calibrations): their own, larger body limit.
    calibration_max_bytes: int = Field(default=8 * 1024 * 1024, gt=0, le=16 * 1024 * 1024)
    # Storage quota of one API key's calibration uploads: how many it may keep and their total
    # size (422 calibration_quota_exceeded above either); 0 = no limit.
    calibration_max_per_key: int = Field(default=100, ge=0)
    calibration_max_total_bytes_per_key: int = Field(default=256 * 1024 * 1024, ge=0)
    # The worker's sweep deletes uploads older than this that no queued or running job uses;
    # 0 = keep them forever.
    calibration_retention_days: float = Field(default=30.0, ge=0)
    page_limit_max: int = Field(default=100, gt=0)
    events_poll_interval_s: float = Field(default=0.5, gt=0)
    # SSE streams end after this long even if the job is still running (clients reconnect).
    events_max_duration_s: float = Field(default=3600.0, gt=0)
    # API keys are checked against an in-process cache: a revocation takes effect within this.
    auth_cache_ttl_s: float = Field(default=1.0, ge=0)
    # Per API key: requests/s on average and the burst above it (429 with Retry-After beyond);
    # rate_limit_per_s=0 switches the limit off. With a Redis broker every API process draws
    # from one bucket per key in Redis; otherwise (the embedded shape) each process has its own.
    rate_limit_per_s: float = Field(default=50.0, ge=0)
    rate_limit_burst: int = Field(default=200, ge=1)
    # Failed authentications (unknown or revoked keys not yet cached) per client address and
    # API process: on average and the burst above it; beyond, 429 without a database lookup.
    # 0 switches the limit off.
    auth_failures_per_s: float = Field(default=1.0, ge=0)
    auth_failures_burst: int = Field(default=20, ge=1)
    # Event streams (GET /v1/jobs/{id}/events) one key may have open at once per API process
    # (429 with Retry-After beyond); 0 = no cap.
    max_event_streams_per_key: int = Field(default=10, ge=0)
    # Jobs one key may have queued or running at once (429 with Retry-After on submit); 0 = no
    # quota.
    max_active_jobs_per_key: int = Field(default=20, ge=0)
    # Disk one key may hold: its jobs' published artifacts plus the scratch of its running
    # attempts, in bytes (422 disk_quota_exceeded on submit at or above it; a running job that
    # goes past it fails with disk_quota_exceeded); 0 = no quota.
    disk_quota_bytes_per_key: int = Field(default=0, ge=0)
    # The Retry-After (s) of 503 answers while the database or broker is unreachable.
    unavailable_retry_after_s: int = Field(default=5, ge=1)
    # GET /metrics answers only `Authorization: Bearer <metrics_key>`; unset: /metrics is off.
    metrics_key: str | None = None
    # The API's connection pool (PostgreSQL): connections kept, extra ones allowed, and how
    # long a request waits for one before a 503. Per API process. An overflow connection is
    # closed when it is returned, so a pool smaller than the requests in flight opens and
    # closes a database connection (a server process) per request under load.
    db_pool_size: int = Field(default=20, ge=1)
    db_max_overflow: int = Field(default=10, ge=0)
    db_pool_timeout_s: float = Field(default=10.0, gt=0)
    # PostgreSQL: how long opening a connection may take (libpq connect_timeout, whole seconds,
    # at least 2), and the API's statement_timeout (the server cancels a statement running
    # longer; 0 = none). A database that does not answer then costs a request a 503, not a
    # thread forever.
    db_connect_timeout_s: int = Field(default=5, ge=2)
    db_statement_timeout_s: float = Field(default=30.0, ge=0)
    # /readyz: its checks run in background threads (one at a time per dependency) and a result
    # is reused for readyz_cache_s; a request waits at most readyz_timeout_s for them, and a
    # dependency that has not answered by then is reported unavailable (503 + Retry-After).
    readyz_timeout_s: float = Field(default=2.0, gt=0)
    readyz_cache_s: float = Field(default=1.0, ge=0)
    # Every request is answered within request_timeout_s of server time (time spent receiving
    # its body excluded): a response not started by then is a 503 dependency_timeout with
    # Retry-After (app.deadline); a started stream or download is never cut. 0 = no deadline.
    request_timeout_s: float = Field(default=10.0, ge=0)
    # Threads for the API's blocking work (anyio's thread limiter; anyio's default is 40). A
    # request stuck in a frozen database holds one past its deadline; keep this above
    # db_pool_size + db_max_overflow so that requests waiting for a connection still get a
    # thread, and time out on db_pool_timeout_s or the request deadline.
    threadpool_size: int = Field(default=40, ge=1)
    # Requests an API process works on at once (app.admission); the others wait their turn in
    # arrival order, round robin over API keys, holding no thread (0 = no limit: every request
    # at once, in no particular order).
    api_concurrency: int = Field(default=8, ge=0)
    # A request with a body (POST, PUT, PATCH) must have sent all of it within this many seconds
    # of its start (408 body_timeout and the connection closed otherwise); its API key is checked
    # before any of it is read. 0 = no deadline.
    body_timeout_s: float = Field(default=60.0, ge=0)
    # The proxies whose X-Forwarded-For (and X-Forwarded-Proto) the API believes: addresses and
    # networks, comma-separated, or * for any peer. Empty: none, the TCP peer is the client (the
    # address the failed-authentication limit counts).
    forwarded_allow_ips: str = ""
    # The avg_bits / max_ppl_increase targets (dynamic HIGGS). An operator may switch them
    # off; they are then refused with a 422, never silently run as uniform HIGGS.
    dynamic_targets: bool = True

    # Dynamic HIGGS: how a model's sensitivity profile is measured (higgs_engine.profile).
    # Data-free by default: KL from the base model on text the model generates itself, so a job
    # needs no text. The defaults are the engine's (higgs_engine.planning.profile.DEFAULT_PROFILE).
    # Token budget = profile_windows * profile_context (tests keep it tiny).
    # "auto": kl for a causal LM, cos (1 - cos of mean-pooled embeddings) for an encoder.
    profile_metric: Literal["auto", "kl", "ppl", "cos"] = "auto"
    profile_method: Literal["noise", "fisher"] = "fisher"
    # Token source without a text file: "self" (text the model generates, cached) or "random".
    profile_data_free: Literal["self", "random"] = "self"
    profile_context: int = Field(default=DEFAULT_PROFILE.context, ge=2)
    profile_windows: int = Field(default=DEFAULT_PROFILE.windows, ge=1)
    # Label draws per window for the fisher method (backward passes per window).
    profile_fisher_samples: int = Field(default=DEFAULT_PROFILE.fisher_samples, ge=1)
    profile_seed: int = 0
    # Profile text (UTF-8 file on the worker); None = the data-free source above
    # (profile_data_free). Needed for metric ppl.
    profile_text_file: Path | None = None
    # Engine-side profile cache (also what makes an interrupted profile resume); the database's
    # profiles table is the service's index of complete profiles.
    profiles_dir: Path | None = None
    # The allocator's budget resolution in bits per weight (plans and jobs).
    plan_resolution: float = Field(default=1e-4, gt=0, le=0.1)
    # Largest accepted max_ppl_increase (10 = an 11x perplexity): beyond it a "bound" is noise.
    max_ppl_increase_limit: float = Field(default=10.0, gt=0)

    # Queue / worker
    task_queue: str = DEFAULT_QUEUE
    broker_timeout_s: float = Field(default=3.0, gt=0)
    heartbeat_timeout_s: float = Field(default=120.0, gt=0)
    max_attempts: int = Field(default=3, ge=1)
    # A queued job whose enqueue never happened is re-sent by the sweep after this grace.
    enqueue_grace_s: float = Field(default=30.0, ge=0)
    # A queued job sent this long ago and still not claimed is sent again when the broker holds
    # fewer messages than there are such jobs (messages lost: Redis restarted without
    # persistence, a failover, a flush). A duplicate message is harmless (the claim is a CAS).
    queued_resend_s: float = Field(default=300.0, gt=0)
    # How long the worker retries a database write through an outage (a PostgreSQL restart)
    # before it abandons the job attempt; the time in between is not held against the job.
    worker_db_retry_s: float = Field(default=300.0, gt=0)
    # A job back in the queue because the storage was full is sent again as soon as the
    # artifacts volume has more free space, and in any case after this long.
    storage_retry_s: float = Field(default=1800.0, gt=0)
    sweep_interval_s: float = Field(default=30.0, gt=0)
    # A job whose source is sharded (model.safetensors.index.json with several shards) is split
    # into one part per shard, run by any worker, and assembled (a Celery chord on the Redis
    # result backend; the sweep is the barrier when a host dies). Only with a Redis broker.
    fanout: bool = True
    job_soft_time_limit_s: int = Field(default=6 * 3600, gt=0)
    job_time_limit_s: int = Field(default=6 * 3600 + 300, gt=0)
    worker_concurrency: int = Field(default=1, ge=1)
    # A job runs in a fresh pool process only when the last one grew past this resident size
    # (Celery's worker_max_memory_per_child): no fork + re-init between ordinary jobs.
    worker_max_memory_mb: int = Field(default=4096, ge=64)
    # Where the worker computes: "auto" = CUDA when torch can use it, else the CPU.
    device: str = "auto"
    # A gguf job for a Hub model: the API reads the model's config.json from the Hub (at most
    # this long) to refuse an architecture llama.cpp's converter does not know at submit; 0 or
    # no answer in time leaves the check to the worker.
    hub_check_timeout_s: float = Field(default=3.0, ge=0)
    # Those reads hold an API thread each: at most this many run at once per API process (503
    # with Retry-After beyond), and at most hub_check_per_key of them for one key (429 beyond).
    hub_check_concurrency: int = Field(default=4, ge=1)
    hub_check_per_key: int = Field(default=1, ge=1)
    # How long an architecture read from the Hub is reused, and a failed read (no answer in
    # time, a private or missing repository) before the Hub is asked again; per (model,
    # revision), shared by every key of the API process.
    hub_check_cache_s: float = Field(default=3600.0, ge=0)
    hub_check_failure_cache_s: float = Field(default=60.0, ge=0)

    # options.evaluate: perplexity and KL on this UTF-8 text on the worker (None: such jobs fail
    # with invalid_config before quantizing), over eval_windows windows of eval_context tokens.
    eval_text_file: Path | None = None
    eval_context: int = Field(default=512, ge=2)
    eval_windows: int = Field(default=16, ge=1)

    # Webhooks (app.webhooks): a job's terminal-state event is POSTed to its webhook_url.
    # Loopback, link-local and private addresses are refused unless this is set.
    webhook_allow_private: bool = False
    # The whole of one delivery (connect, TLS, request, answer) in wall time: a receiver that
    # trickles its answer is cut off at this deadline, not after each slow read.
    webhook_timeout_s: float = Field(default=10.0, gt=0)
    # Deliveries one worker sends at once, and at most how many of them are one API key's (so
    # a tenant's slow receivers cannot hold every slot and delay other tenants' events).
    webhook_concurrency: int = Field(default=8, ge=1)
    webhook_per_key_concurrency: int = Field(default=2, ge=1)
    # Retries back off from webhook_backoff_s, doubling up to webhook_backoff_max_s, and stop
    # once an event is older than webhook_retry_window_s (or after webhook_max_attempts tries).
    webhook_backoff_s: float = Field(default=5.0, gt=0)
    webhook_backoff_max_s: float = Field(default=600.0, gt=0)
    webhook_retry_window_s: float = Field(default=6 * 3600.0, gt=0)
    webhook_max_attempts: int = Field(default=20, ge=1)
    # How often the worker's dispatcher looks for events to make and deliveries that are due.
    webhook_interval_s: float = Field(default=1.0, gt=0)
    # Jobs that finished longer ago than this get no event made (a worker fleet down for that
    # long does not flood receivers with stale events when it comes back).
    webhook_event_horizon_s: float = Field(default=24 * 3600.0, gt=0)
    # Signed links (downloads a plain <a href> can use): lifetime, and an optional server
    # secret mixed into their key so that reading the database alone cannot mint one.
    link_ttl_s: float = Field(default=600.0, gt=0, le=7 * 24 * 3600)
    link_secret: str | None = None

    @field_validator("forwarded_allow_ips")
    @classmethod
    def _check_proxies(cls, v: str) -> str:
        from app.proxies import TrustedProxies

        TrustedProxies(v)  # ValueError naming the entry that is no address
        return v

    @field_validator("device")
    @classmethod
    def _check_device(cls, v: str) -> str:
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", v):
            raise ValueError(f"device {v!r} must be auto, cpu, cuda or cuda:N")
        return v

    @model_validator(mode="after")
    def _derive_paths(self) -> Settings:
        self.data_dir = self.data_dir.expanduser().resolve()
        if not self.database_url:
            self.database_url = f"sqlite:///{self.data_dir / 'higgs.db'}"
        if not self.broker_url:
            # kombu's filesystem transport: a broker that is just folders under data_dir.
            self.broker_url = "filesystem://"
        if self.artifacts_dir is None:
            self.artifacts_dir = self.data_dir / "artifacts"
        self.artifacts_dir = self.artifacts_dir.expanduser().resolve()
        if self.models_dir is not None:
            self.models_dir = self.models_dir.expanduser().resolve()
        if self.artifacts_url:
            from urllib.parse import urlparse

            u = urlparse(self.artifacts_url)
            if u.scheme != "s3" or not u.netloc:
                raise ValueError(
                    f"artifacts_url {self.artifacts_url!r} must be s3://bucket[/prefix] "
                    "(unset: the local artifacts folder)"
                )
        if self.profiles_dir is None:
            self.profiles_dir = self.data_dir / "profiles"
        self.profiles_dir = self.profiles_dir.expanduser().resolve()
        if self.profile_text_file is not None:
            self.profile_text_file = self.profile_text_file.expanduser().resolve()
        if self.eval_text_file is not None:
            self.eval_text_file = self.eval_text_file.expanduser().resolve()
        if self.profile_metric == "ppl" and self.profile_text_file is None:
            raise ValueError(
                "profile_metric='ppl' needs a calibration text: set HIGGS_PROFILE_TEXT_FILE "
                "(or use the data-free default profile_metric='auto')"
            )
        return self

    @property
    def artifacts_path(self) -> Path:
        """artifacts_dir, typed as always set (the validator fills it)."""
        if self.artifacts_dir is None:  # pragma: no cover - the validator always sets it
            raise RuntimeError("artifacts_dir is not set")
        return self.artifacts_dir

    @property
    def profiles_path(self) -> Path:
        """profiles_dir, typed as always set (the validator fills it)."""
        if self.profiles_dir is None:  # pragma: no cover - the validator always sets it
            raise RuntimeError("profiles_dir is not set")
        return self.profiles_dir

    @property
    def broker_folder(self) -> Path:
        return self.data_dir / "broker"

    @property
    def is_filesystem_broker(self) -> bool:
        return self.broker_url.startswith("filesystem:")

    def broker_transport_options(self) -> dict[str, Any]:
        """kombu transport options for broker_url (the filesystem transport needs its folders)."""
        if self.is_filesystem_broker:
            folder = self.broker_folder
            return {
                "data_folder_in": str(folder / "queue"),
                "data_folder_out": str(folder / "queue"),
                "processed_folder": str(folder / "processed"),
                "control_folder": str(folder / "control"),
                "store_processed": False,
            }
        return {}

    def ensure_dirs(self) -> None:
        """Create the folders the embedded shape writes to (idempotent)."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.artifacts_path.mkdir(parents=True, exist_ok=True)
        if self.is_filesystem_broker:
            for key in ("data_folder_in", "processed_folder", "control_folder"):
                Path(self.broker_transport_options()[key]).mkdir(parents=True, exist_ok=True)


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings, read once from the environment."""
    return Settings()
