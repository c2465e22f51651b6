"""A model's sensitivity profile as data: how it is measured (ProfileConfig), what it holds
(alpha per layer), its cache key, and where complete profiles are found and kept.

alpha_l is such that the metric change of a per-layer quantization ~= sum_l alpha_l * t_l^2
(docs: the algorithm's linearity section). The measurement itself needs torch and lives in
higgs_engine.profile; everything here is plain Python, so the API can plan from a stored
profile without torch.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from higgs_engine.errors import CorruptCheckpointError, InvalidConfigError, ProfileNotFoundError

PROFILE_VERSION = 1
# "kl" and "ppl" measure a causal LM's next-token distribution; "cos" measures a model without a
# causal LM head (an encoder): mean over sequences of 1 - cos(base, perturbed) of the
# mean-pooled final hidden state. "auto" is resolved per checkpoint by `resolve_profile_config`
# (causal LM -> kl, otherwise cos); a stored profile always names a concrete metric.
METRICS = ("auto", "kl", "ppl", "cos")
LM_METRICS = ("kl", "ppl")
METHODS = ("noise", "fisher")
# What `model_structure.model_kind` calls a checkpoint: with a causal LM head, or without one.
MODEL_KINDS = ("causal", "encoder")
# The longest window an encoder is profiled on (resolve_profile_config).
ENCODER_CONTEXT = 128
# Token sources when no calibration text is given: text the model generates itself
# (higgs_engine.selfgen), or seeded uniform random tokens.
DATA_FREE_SOURCES = ("self", "random")


@dataclass(frozen=True)
class ProfileConfig:
    """How a profile is measured. Everything that changes the alphas is in here."""

    metric: str = "auto"
    method: str = "noise"
    levels: tuple[float, ...] = (0.005, 0.02)  # noise t^2 for the noise-injection method
    context: int = 512
    windows: int = 4  # token budget = windows * context
    seed: int = 0
    fisher_samples: int = 4  # label draws (backward passes) per window for the Fisher method
    data_free: str = "self"  # token source without a text: "self" (generated) or "random"

    def __post_init__(self) -> None:
        if self.metric not in METRICS:
            raise InvalidConfigError(f"metric={self.metric!r} must be one of {list(METRICS)}")
        if self.method not in METHODS:
            raise InvalidConfigError(f"method={self.method!r} must be one of {list(METHODS)}")
        if self.method == "noise":
            if not self.levels:
                raise InvalidConfigError("levels must name at least one noise level t^2")
            bad = [x for x in self.levels if not (math.isfinite(x) and 0 < x < 1)]
            if bad:
                raise InvalidConfigError(f"noise levels {bad} must be relative MSEs t^2 in (0, 1)")
        if self.context < 2:
            raise InvalidConfigError(f"context={self.context} must be at least 2 tokens")
        if self.windows < 1:
            raise InvalidConfigError(f"windows={self.windows} must be at least 1")
        if self.data_free not in DATA_FREE_SOURCES:
            raise InvalidConfigError(
                f"data_free={self.data_free!r} must be one of {list(DATA_FREE_SOURCES)}"
            )
        if self.fisher_samples < 1:
            raise InvalidConfigError(f"fisher_samples={self.fisher_samples} must be at least 1")

    @property
    def tokens(self) -> int:
        return self.windows * self.context

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["levels"] = list(self.levels)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ProfileConfig:
        d = dict(d)
        d["levels"] = tuple(d.get("levels", ()))
        # profiles written before self-generated text existed used random tokens
        d.setdefault("data_free", "random")
        return cls(**d)


# The Fisher estimate matched noise injection on quality at a fraction of the cost
# (benchmarks/results/dynamic.md); without a text the model's own generated text is used.
# The metric is chosen per checkpoint (kl for a causal LM, cos for an encoder, whose Fisher
# method is the Gauss-Newton estimate and whose data-free tokens are random: an encoder
# cannot generate text); see planning.profile.resolve_profile_config.
# 16 windows of 512 tokens with one label draw each: self-generated documents differ widely
# (genre, perplexity 3 to 75 on SmolLM2), so the number of documents, not of label draws,
# decides how well the alphas predict (benchmarks/results/profile_documents.md and
# datafree_sources.md; docs/algorithm.md section 4). 16 draws in all, as 4 windows x 4 draws had, for 16 forward passes instead of 4.
DEFAULT_PROFILE = ProfileConfig(method="fisher", windows=16, fisher_samples=1)


def resolve_profile_config(
    config: ProfileConfig, kind: str, max_positions: int | None = None
) -> ProfileConfig:
    """The config a checkpoint of this `kind` ("causal" or "encoder") is actually profiled with.

    - metric "auto" becomes "kl" for a causal LM and "cos" for an encoder; "kl"/"ppl" on an
      encoder (no next-token distribution) and "cos" on a causal LM are errors;
    - an encoder cannot generate text, so data_free "self" becomes "random" (uniform random
      tokens framed by the tokenizer's CLS ... SEP); the profile records "random";
    - an encoder's windows are at most ENCODER_CONTEXT tokens (sentence length, where its
      embeddings are used: on all-MiniLM-L6-v2, profiles in 128-token windows gave better
      allocations than in 512-token ones, from random and from real text alike,
      benchmarks/results/datafree_sources_minilm.md) and at most `max_positions` (its learned
      position table); the token budget is kept by taking more, shorter windows.
    Resolving twice gives the same config."""
    if kind not in MODEL_KINDS:
        raise InvalidConfigError(f"model kind {kind!r} must be one of {list(MODEL_KINDS)}")
    if kind == "causal":
        if config.metric == "cos":
            raise InvalidConfigError(
                "metric='cos' is for models without a causal LM head; this checkpoint has one "
                "(use kl or ppl)"
            )
        return replace(config, metric="kl") if config.metric == "auto" else config
    if config.metric in LM_METRICS:
        raise InvalidConfigError(
            f"metric={config.metric!r} needs a causal LM head (next-token probabilities); "
            "this checkpoint is an encoder: use metric 'cos' (or 'auto')"
        )
    out = replace(config, metric="cos", data_free="random")
    limit = ENCODER_CONTEXT
    if max_positions is not None and max_positions >= 2:
        limit = min(limit, max_positions)
    if out.context > limit:
        out = replace(out, context=limit, windows=max(1, config.tokens // limit))
    return out


@dataclass
class LayerAlpha:
    name: str
    shape: list[int]  # [out_features, in_features]
    alpha: float
    # noise method: [[t2, metric change], ...] per level; fisher: [] (tr_fisher is set instead)
    points: list[list[float]] = field(default_factory=list)
    tr_fisher: float | None = None


@dataclass
class Profile:
    model: str  # model id or path as given
    revision: str | None  # resolved commit or local fingerprint
    calibration: str  # "text:<sha256>" or "random:<seed>"
    config: dict[str, Any]  # ProfileConfig.to_dict()
    layers: list[LayerAlpha]
    # {"ppl": ...} of a causal LM on the calibration tokens; {"embedding_norm": ...} (mean norm of
    # the mean-pooled final hidden state) of an encoder
    base: dict[str, float]
    cost: dict[str, float]  # {"forward_passes", "backward_passes", "seconds"}
    complete: bool
    version: int = PROFILE_VERSION
    # Which of `layers` are the token embedding / an untied output head (profiled for GGUF files
    # and scope="all"), so that a plan for the linear layers alone can leave them out.
    embeddings: list[str] = field(default_factory=list)

    def linear_layers(self) -> list[str]:
        """Names of the profiled layers that are not embeddings, in profile order."""
        emb = set(self.embeddings)
        return [la.name for la in self.layers if la.name not in emb]

    @property
    def metric(self) -> str:
        return str(self.config["metric"])

    @property
    def method(self) -> str:
        return str(self.config["method"])

    def alphas(self) -> dict[str, float]:
        return {la.name: la.alpha for la in self.layers}

    def key(self) -> str:
        return profile_key(
            self.model, self.revision, self.calibration, ProfileConfig.from_dict(self.config)
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Profile:
        d = dict(d)
        if d.get("version") != PROFILE_VERSION:
            raise CorruptCheckpointError(
                f"profile version {d.get('version')!r} is not {PROFILE_VERSION}"
            )
        d["layers"] = [LayerAlpha(**row) for row in d["layers"]]
        return cls(**d)

    def save(self, path: Path) -> None:
        """Write atomically (a reader never sees half a file; an interrupted run keeps the last one)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1, sort_keys=True))
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> Profile:
        path = Path(path)
        if not path.is_file():
            raise ProfileNotFoundError(f"profile file {str(path)!r} does not exist")
        try:
            return cls.from_dict(json.loads(path.read_text()))
        except (ValueError, TypeError, KeyError) as exc:
            raise CorruptCheckpointError(f"{str(path)!r} is not a valid profile: {exc}") from exc


def profile_key(model: str, revision: str | None, calibration: str, config: ProfileConfig) -> str:
    """Cache key: model, revision, calibration data, and every setting that changes alphas."""
    blob = json.dumps(
        {
            "model": model,
            "revision": revision,
            "calibration": calibration,
            "config": config.to_dict(),
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def calibration_id(text: str | None, seed: int, data_free: str = "random") -> str:
    """ "text:<sha256>", or the data-free source: "random:<seed>", or "self:t1:p0.95:<seed>"
    (text sampled from the model at temperature 1, top-p 0.95: higgs_engine.selfgen's defaults)."""
    if text is not None:
        return "text:" + hashlib.sha256(text.encode("utf-8")).hexdigest()
    if data_free == "self":
        return f"self:t1:p0.95:{seed}"
    return f"random:{seed}"


def source_fingerprint(path: Path) -> str:
    """A cheap content fingerprint of a local checkpoint: config + safetensors headers, sizes
    and 16 sampled 64 KiB chunks of each weight file (full hashing of a 7B model takes minutes)."""
    h = hashlib.sha256()
    cfg = path / "config.json"
    if cfg.is_file():
        h.update(cfg.read_bytes())
    for f in sorted(path.glob("*.safetensors")):
        size = f.stat().st_size
        h.update(f.name.encode() + str(size).encode())
        with f.open("rb") as fh:
            head = fh.read(8)
            h.update(head)
            if len(head) == 8:
                h.update(fh.read(min(int.from_bytes(head, "little"), 1 << 24)))
            for k in range(16):
                fh.seek(size * k // 16)
                h.update(fh.read(1 << 16))
    return "local:" + h.hexdigest()[:32]


# ---------------------------------------------------------------------------------------------
# Where profiles are found and kept
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProfileRequest:
    """The profile a caller wants: the model as measured (id and revision or fingerprint), the
    calibration data, how it is measured, and the layers it must cover."""

    model: str
    revision: str | None
    calibration: str  # calibration_id(text, seed)
    config: ProfileConfig
    layers: tuple[str, ...] = ()

    @property
    def key(self) -> str:
        return profile_key(self.model, self.revision, self.calibration, self.config)

    def accepts(self, profile: Profile) -> bool:
        """The one rule for reusing a stored profile: complete, measured the same way on the
        same calibration data, and covering every wanted layer."""
        have = {la.name for la in profile.layers}
        return (
            profile.complete
            and profile.config == self.config.to_dict()
            and profile.calibration == self.calibration
            and set(self.layers) <= have
        )


class ProfileStore(Protocol):
    """Somewhere complete profiles are kept: a directory, a file, the service's table.

    `find` returns a profile the request accepts, or None (a broken entry is None, never an
    error: it is measured again). `save` records a profile measured for the request.
    `resume_path` is a file where a partial profile may be kept while it is measured (None:
    this store keeps complete profiles only)."""

    @property
    def name(self) -> str:
        """Reported as where a reused profile came from."""
        ...

    def find(self, request: ProfileRequest) -> Profile | None: ...

    def save(self, profile: Profile, request: ProfileRequest) -> None: ...

    def resume_path(self, request: ProfileRequest) -> Path | None: ...


def read_profile_file(path: Path, request: ProfileRequest) -> Profile | None:
    """The profile in `path` if the request accepts it and it was measured for the same
    model revision (its key matches), else None."""
    if not path.is_file():
        return None
    try:
        prof = Profile.load(path)
    except Exception:  # a broken file is recomputed, never trusted
        return None
    return prof if request.accepts(prof) and prof.key() == request.key else None


@dataclass(frozen=True)
class ProfileFile:
    """One profile file (`higgs profile --out`)."""

    path: Path
    name: str = "file"

    def find(self, request: ProfileRequest) -> Profile | None:
        return read_profile_file(self.path, request)

    def save(self, profile: Profile, request: ProfileRequest) -> None:
        profile.save(self.path)

    def resume_path(self, request: ProfileRequest) -> Path | None:
        return self.path


@dataclass(frozen=True)
class ProfileDirectory:
    """A cache directory of profiles, one file per key."""

    root: Path
    name: str = "cache_dir"

    def path(self, request: ProfileRequest) -> Path:
        return Path(self.root) / f"profile-{request.key}.json"

    def find(self, request: ProfileRequest) -> Profile | None:
        return read_profile_file(self.path(request), request)

    def save(self, profile: Profile, request: ProfileRequest) -> None:
        profile.save(self.path(request))

    def resume_path(self, request: ProfileRequest) -> Path | None:
        return self.path(request)


def find_profile(
    stores: Sequence[ProfileStore], request: ProfileRequest
) -> tuple[Profile, ProfileStore] | None:
    """The first profile a store holds for the request, and that store. Stores searched
    before it (which lacked it) get a copy."""
    for i, store in enumerate(stores):
        prof = store.find(request)
        if prof is not None:
            for earlier in stores[:i]:
                earlier.save(prof, request)
            return prof, store
    return None


def resume_path(stores: Sequence[ProfileStore], request: ProfileRequest) -> Path | None:
    """Where a profile being measured is kept between layers: the last store offering a file."""
    for store in reversed(stores):
        path = store.resume_path(request)
        if path is not None:
            return path
    return None
