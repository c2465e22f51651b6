"""What the runner, the fan-out and the tasks need from the settings: RunnerConfig, read once
per worker process."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from app.artifacts.store import ArtifactStore, store_from_settings
from app.keys.hub_token import HubTokens
from app.settings import Settings
from higgs_engine.errors import InvalidConfigError
from worker.dynamic import ProfileSettings

# Test-only knob: seconds to sleep after each quantized layer, so that tests can kill or
# cancel a job in the middle. Never set it in production.
DEBUG_LAYER_DELAY_ENV = "HIGGS_DEBUG_LAYER_DELAY_S"


@dataclass(frozen=True)
class RunnerConfig:
    """What the runner needs from the settings (read once per worker process)."""

    artifacts_dir: Path
    models_dir: Path | None
    # Which Hub token each job uses (its key's own, the service's where allowed, or none):
    # worker.models.job_hub_token reads it per job.
    hub_tokens: HubTokens
    hf_offline: bool
    device: str
    heartbeat_interval_s: float
    # Where artifacts are published: the artifacts_dir folder (LocalStore), or a remote store
    # (HIGGS_ARTIFACTS_URL=s3://...) the files are uploaded to from local staging.
    store: ArtifactStore
    progress_min_interval_s: float = 0.5
    debug_layer_delay_s: float = 0.0
    # Evaluation text for jobs with options.evaluate (settings.eval_text_file); None = refuse them.
    eval_text_file: Path | None = None
    eval_context: int = 512
    eval_windows: int = 16
    # Dynamic HIGGS (avg_bits / max_ppl_increase targets): how profiles are measured and cached.
    profiles: ProfileSettings | None = None
    # How long a database write is retried through an outage before the attempt is abandoned.
    db_retry_s: float = 300.0
    # Bytes of artifacts and scratch one API key may hold (worker.scratch.DiskGuard); 0 = none.
    disk_quota_bytes_per_key: int = 0

    @classmethod
    def from_settings(cls, settings: Settings, device: str) -> RunnerConfig:
        delay = float(os.environ.get(DEBUG_LAYER_DELAY_ENV, "0") or 0)
        return cls(
            artifacts_dir=settings.artifacts_path,
            models_dir=settings.models_dir,
            hub_tokens=HubTokens.from_settings(settings),
            hf_offline=settings.hf_offline,
            device=device,
            # Several beats per timeout, so one slow write never makes a live job look dead.
            heartbeat_interval_s=max(0.2, min(15.0, settings.heartbeat_timeout_s / 4)),
            store=store_from_settings(settings),
            debug_layer_delay_s=max(0.0, delay),
            eval_text_file=settings.eval_text_file,
            eval_context=settings.eval_context,
            eval_windows=settings.eval_windows,
            profiles=ProfileSettings.from_settings(settings),
            db_retry_s=settings.worker_db_retry_s,
            disk_quota_bytes_per_key=settings.disk_quota_bytes_per_key,
        )

    def profile_settings(self) -> ProfileSettings:
        """The profile settings a dynamic target needs; InvalidConfigError when this worker
        has none."""
        if self.profiles is None:
            raise InvalidConfigError("this worker has no profile settings for dynamic targets")
        return self.profiles
