"""Dynamic HIGGS jobs in the worker: the engine's job (higgs_engine.job: profile -> allocate
-> quantize) with the service's profile store and the job's option menu.

    profiling   the model's sensitivity profile (alpha per layer), with the job's progress
                callback (done/total = layers), so the job can be cancelled between layers; an
                interrupted profile resumes from the engine's cache file. Skipped when the
                profiles table (or the engine's cache directory) already has a complete profile
                for the same model revision, metric, calibration data and token budget.
    allocating  the exact DP allocator for the job's target over option_menu(options.p)
    quantizing  the plan's config: one override per layer (HiggsConfig.overrides)

The report gets each layer's alpha and the predicted metric change from the layers' measured
t^2 (higgs_engine.planning.plans.annotate_report), including which KL -> perplexity conversion
was used, and `metrics.service.profile` says whether the profile was computed or reused.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy.orm import Session, sessionmaker

from app.jobs.job_config import JobConfig
from app.plans.profiles import find_profiles, profile_payload, store_profile
from app.settings import Settings
from higgs_engine.errors import CorruptCheckpointError, InvalidConfigError
from higgs_engine.planning.options import option_menu
from higgs_engine.planning.plans import annotate_report
from higgs_engine.planning.profile import (
    DEFAULT_PROFILE,
    Profile,
    ProfileConfig,
    ProfileDirectory,
    ProfileRequest,
    ProfileStore,
    calibration_id,
    resolve_profile_config,
    source_fingerprint,
)
from higgs_engine.report import Report
from worker.dbretry import retry_db

if TYPE_CHECKING:
    from higgs_engine.job import JobPlan, ProfileSource
    from higgs_engine.sources import ResolvedModel, SourceIdentity

SessionFactory = sessionmaker[Session]


@dataclass(frozen=True)
class ProfileSettings:
    """How the worker measures profiles (from Settings, read once per worker process)."""

    cache_dir: Path
    metric: str = "auto"  # resolved per checkpoint: kl for a causal LM, cos for an encoder
    method: str = "fisher"
    data_free: str = "self"
    context: int = DEFAULT_PROFILE.context
    windows: int = DEFAULT_PROFILE.windows
    fisher_samples: int = DEFAULT_PROFILE.fisher_samples
    seed: int = 0
    text_file: Path | None = None
    resolution: float = 1e-4
    # How long a profile lookup or store is retried through a database outage.
    db_retry_s: float = 300.0

    @classmethod
    def from_settings(cls, settings: Settings) -> ProfileSettings:
        return cls(
            cache_dir=settings.profiles_path,
            metric=settings.profile_metric,
            method=settings.profile_method,
            data_free=settings.profile_data_free,
            context=settings.profile_context,
            windows=settings.profile_windows,
            fisher_samples=settings.profile_fisher_samples,
            seed=settings.profile_seed,
            text_file=settings.profile_text_file,
            resolution=settings.plan_resolution,
            db_retry_s=settings.worker_db_retry_s,
        )

    def engine_config(self) -> ProfileConfig:
        return ProfileConfig(
            metric=self.metric,
            method=self.method,
            data_free=self.data_free,
            context=self.context,
            windows=self.windows,
            fisher_samples=self.fisher_samples,
            seed=self.seed,
        )

    def text(self) -> str | None:
        if self.text_file is None:
            return None
        try:
            return self.text_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise InvalidConfigError(
                f"the profile calibration text {str(self.text_file)!r} cannot be read: {e}"
            ) from e


def profile_revision(source: SourceIdentity) -> str:
    """What a profile is keyed by: the Hub commit sha, or a local checkpoint's fingerprint."""
    return source.revision or source_fingerprint(source.path)


class DatabaseProfiles:
    """The profiles table as a profile store: rows for this job's model (by id and revision,
    whatever path the model has on this worker), checked by the engine's request rule."""

    name = "database"

    def __init__(
        self,
        sessions: SessionFactory,
        source: SourceIdentity,
        requested_revision: str | None,
        db_retry_s: float = 300.0,
    ) -> None:
        self.sessions = sessions
        # Lookups and stores are retried through a database outage like the runner's writes.
        self.db_retry_s = db_retry_s
        self.source = source
        self.requested_revision = requested_revision
        self.revision = profile_revision(source)

    def find(self, request: ProfileRequest) -> Profile | None:
        pc = request.config

        def lookup() -> list[dict[str, Any] | None]:
            with self.sessions() as s:
                rows = find_profiles(
                    s,
                    self.source.id,
                    self.revision,
                    pc.metric,
                    calibration=request.calibration,
                    token_budget=pc.tokens,
                )
                return [profile_payload(row) for row in rows]

        payloads = retry_db(lookup, f"profile lookup of {self.source.id!r}", self.db_retry_s)
        for data in payloads:
            if data is None:
                continue
            try:
                prof = Profile.from_dict(data)
            except (CorruptCheckpointError, TypeError, KeyError, ValueError):
                continue
            if request.accepts(prof):
                return prof
        return None

    def save(self, profile: Profile, request: ProfileRequest) -> None:
        def store() -> None:  # an upsert: safe to retry
            with self.sessions() as s:
                store_profile(
                    s,
                    model_id=self.source.id,
                    revision=self.revision,
                    profile=profile.to_dict(),
                    key=profile.key(),
                    source={
                        "id": self.source.id,
                        "kind": self.source.kind,
                        "revision": self.source.revision,
                        "requested_revision": self.requested_revision,
                    },
                )

        retry_db(store, f"profile of {self.source.id!r}", self.db_retry_s)

    def resume_path(self, request: ProfileRequest) -> Path | None:
        return None


def profile_stores(
    sessions: SessionFactory,
    source: SourceIdentity,
    requested_revision: str | None,
    ps: ProfileSettings,
) -> list[ProfileStore]:
    """The table first, then the engine's cache directory (which keeps partial profiles)."""
    return [
        DatabaseProfiles(sessions, source, requested_revision, ps.db_retry_s),
        ProfileDirectory(ps.cache_dir),
    ]


def job_profile_source(
    sessions: SessionFactory,
    source: SourceIdentity,
    requested_revision: str | None,
    menu_p: int | None,
    ps: ProfileSettings,
) -> ProfileSource:
    """Where a dynamic job's profile comes from: the service's stores, every layer profiled
    (one profile serves every job of the model), the job's option menu."""
    from higgs_engine.job import ProfileSource

    return ProfileSource(
        config=ps.engine_config(),
        text=ps.text(),
        stores=tuple(profile_stores(sessions, source, requested_revision, ps)),
        selfgen_cache=ps.cache_dir,
        skip=(),
        menu=tuple(option_menu(menu_p)),
        resolution=ps.resolution,
    )


def profile_entry(plan: JobPlan, source: SourceIdentity) -> dict[str, Any]:
    """The report's metrics.service.profile of a dynamic job: where its profile came from
    (the plan's record of it; a compressed-tensors plan's allocation keeps it)."""
    alloc = (plan.ct or {}).get("allocation")
    if plan.dynamic is not None:
        reused, seconds = plan.dynamic.reused, plan.dynamic.profile_s
    elif alloc is not None:
        reused, seconds = alloc["profile_reused"], float(alloc["profiling_s"])
    else:
        raise InvalidConfigError(f"the job plan is {plan.kind}, not dynamic")
    return {"reused": reused, "seconds": round(seconds, 4), "revision": profile_revision(source)}


def annotate_uniform(
    sessions: SessionFactory, source: ResolvedModel, ps: ProfileSettings, report: Report
) -> None:
    """A uniform job on a model with a cached profile also reports each layer's alpha and the
    predicted metric change from its measured t^2 (never measures a profile for it)."""
    # metric "auto" -> kl or cos
    pc = resolve_profile_config(ps.engine_config(), source.model_kind, source.max_positions)
    request = ProfileRequest(
        source.id, profile_revision(source), calibration_id(ps.text(), pc.seed, pc.data_free), pc
    )
    prof = DatabaseProfiles(sessions, source, None, ps.db_retry_s).find(request)
    if prof is not None:
        annotate_report(report, prof)


def job_menu_p(job_cfg: JobConfig, request: dict[str, Any]) -> int | None:
    """A dynamic job's option menu (options.p)."""
    if job_cfg.menu_p is not None:
        return job_cfg.menu_p
    p = (request.get("options") or {}).get("p")  # a config stored before JobConfig had menu_p
    return None if p is None else int(p)
