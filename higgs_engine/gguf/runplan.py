"""A GGUF run planned as data: GgufPlan holds everything run_gguf_plan (higgs_engine.gguf.run)
will do, validated as it is built (InvalidConfigError naming the field) and written to JSON with
a version (to_dict / from_dict).

    source     the resolved model (path, id, revision, kind), read once by plan_gguf
    model      what planning read of its config: architecture, model type, encoder, rotatable
    goal       exactly one of bits (one llama.cpp type), ftype (llama.cpp's own mixture) and a
               planning Target (the allocator's: avg_bits or max_ppl_increase)
    rotation   the mode asked for and, once decided, whether the file is rotated
    layout     llama.cpp's types on the menu, the values t^2 is measured on, the split size
    compute    the device the profile runs on, the threads measuring, quantizing and
               evaluation run with
    profile    how the profile is measured (a planning target only)
    evaluate   the evaluation in llama.cpp (None: none)
    choices    once allocated: llama.cpp's type per tensor and what the allocation predicts

`--rotate auto` with a planning target on a llama-family decoder leaves the rotation open
(rotation.rotated None): rotation_candidates gives the two candidate plans (not rotated,
rotated), each is allocated (with_choices) and pick_rotation keeps the better one.

Only dataclasses here: no torch, no llama.cpp, no file is read except by plan_gguf.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from higgs_engine.errors import InvalidConfigError
from higgs_engine.planning.gguf_types import (
    DEFAULT_SPLIT_BYTES,
    GGUF_MENU,
    GGUF_TYPES,
    GgufType,
    uniform_type_for_bits,
)
from higgs_engine.planning.plans import Target
from higgs_engine.planning.profile import DEFAULT_PROFILE, ProfileConfig

if TYPE_CHECKING:
    from higgs_engine.sources import SourceIdentity

__all__ = [
    "DEFAULT_ROTATE",
    "GGUF_PLAN_VERSION",
    "ROTATE_MODES",
    "GgufChoices",
    "GgufCompute",
    "GgufEvalRequest",
    "GgufGoal",
    "GgufLayout",
    "GgufModel",
    "GgufPlan",
    "GgufRotation",
    "available_threads",
    "pick_rotation",
    "plan_gguf",
    "rotation_candidates",
]

GGUF_PLAN_VERSION = 1

_MIN_SPLIT_BYTES = 1024**2

ROTATE_MODES = ("off", "on", "auto")
DEFAULT_ROTATE = "off"


def available_threads() -> int:
    """The cores this process may run on: the default for measuring, quantizing and evaluating."""
    return max(1, len(os.sched_getaffinity(0)))


@dataclass(frozen=True)
class GgufEvalRequest:
    """Evaluate the file in llama.cpp on `text` (None: no evaluation)."""

    text: str
    name: str = "text"
    context: int | None = None
    windows: int | None = None

    def __post_init__(self) -> None:
        if self.windows is not None and self.windows < 1:
            raise InvalidConfigError(
                f"evaluate.windows={self.windows} must be at least 1", field="windows"
            )


@dataclass(frozen=True)
class GgufGoal:
    """What the file is for: exactly one of `bits` (one llama.cpp type everywhere, rows it does
    not fit taking llama.cpp's fallback), `ftype` (llama.cpp's own mixture, e.g. Q4_K_M) and a
    planning `target` (avg_bits over the whole file as llama.cpp counts, or max_ppl_increase)."""

    bits: float | None = None
    ftype: str | None = None
    target: Target | None = None

    def __post_init__(self) -> None:
        from higgs_engine.gguf.llama import FTYPES

        if sum(x is not None for x in (self.bits, self.target, self.ftype)) != 1:
            raise InvalidConfigError("give exactly one of bits, a target and a llama.cpp ftype")
        if self.ftype is not None and self.ftype not in FTYPES:
            raise InvalidConfigError(
                f"ftype={self.ftype!r} is not one of llama.cpp's file types {sorted(FTYPES)}",
                field="ftype",
            )
        if self.bits is not None:
            uniform_type_for_bits(self.bits)  # raises for bits below Q2_K, naming them

    @property
    def label(self) -> str:
        """The file name's label: the ftype, the uniform type, or the target."""
        if self.ftype is not None:
            return self.ftype
        if self.bits is not None:
            return uniform_type_for_bits(self.bits).name
        # else the target (exactly one is given: __post_init__)
        avg = self.target.avg_bits if self.target is not None else None
        if avg is not None:
            return f"higgs-{avg:g}bpw"
        ppl = self.target.max_ppl_increase if self.target is not None else None
        return f"higgs-ppl{ppl:g}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "bits": self.bits,
            "ftype": self.ftype,
            "target": self.target.to_dict() if self.target is not None else None,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> GgufGoal:
        target = d.get("target")
        return cls(d.get("bits"), d.get("ftype"), Target(**target) if target else None)


@dataclass(frozen=True)
class GgufModel:
    """What planning read of the checkpoint's config."""

    architecture: str | None
    model_type: str | None
    encoder: bool
    rotatable: bool  # a llama-family decoder (higgs_engine.gguf.rotate.ROTATABLE)


@dataclass(frozen=True)
class GgufRotation:
    """`mode` "off" / "on" / "auto" with the residual rotation's `seed`; `rotated`: whether the
    file is the rotated checkpoint's (None: open until the two candidates are compared)."""

    mode: str = DEFAULT_ROTATE
    seed: int = 0
    rotated: bool | None = False

    def __post_init__(self) -> None:
        if self.mode not in ROTATE_MODES:
            raise InvalidConfigError(
                f"rotate={self.mode!r} must be one of {list(ROTATE_MODES)}", field="rotate"
            )
        if self.mode == "off" and self.rotated:
            raise InvalidConfigError("rotate='off' cannot plan a rotated file", field="rotate")


@dataclass(frozen=True)
class GgufLayout:
    """llama.cpp's types the allocator chooses from (`menu`), the values per tensor t^2 is
    measured on, and the split size of the 16-bit conversion in bytes."""

    menu: tuple[GgufType, ...] = GGUF_MENU
    sample_values: int = 1 << 18
    split_max_bytes: int = DEFAULT_SPLIT_BYTES  # planning.gguf_types: 8 GiB

    def __post_init__(self) -> None:
        if not self.menu:
            raise InvalidConfigError("menu is empty: give llama.cpp types", field="menu")
        if self.sample_values < 1:
            raise InvalidConfigError(
                f"sample_values={self.sample_values} must be at least 1", field="sample_values"
            )
        if self.split_max_bytes < _MIN_SPLIT_BYTES:
            raise InvalidConfigError(
                f"split_max_bytes={self.split_max_bytes} must be at least 1 MiB",
                field="split_max_bytes",
            )

    def to_dict(self) -> dict[str, Any]:
        return {
            "menu": [t.name for t in self.menu],
            "sample_values": self.sample_values,
            "split_max_bytes": self.split_max_bytes,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> GgufLayout:
        unknown = [n for n in d["menu"] if n not in GGUF_TYPES]
        if unknown:
            raise InvalidConfigError(f"menu names unknown llama.cpp types {unknown}", field="menu")
        return cls(
            tuple(GGUF_TYPES[n] for n in d["menu"]),
            int(d["sample_values"]),
            int(d["split_max_bytes"]),
        )


@dataclass(frozen=True)
class GgufCompute:
    """Where the run computes: `device` for the profile (None: the CPU; "auto", "cuda[:N]"),
    `threads` for measuring t^2, llama.cpp's quantizer and the evaluation (0: every core)."""

    device: str | None = None
    threads: int = 0

    def __post_init__(self) -> None:
        if self.threads < 0:
            raise InvalidConfigError(
                f"threads={self.threads} must be 0 (every core) or more", field="threads"
            )

    @property
    def thread_count(self) -> int:
        return self.threads or available_threads()


@dataclass(frozen=True)
class GgufChoices:
    """An allocation: llama.cpp's type per tensor (tensor name -> type name), the predicted
    change in the profile's metric (None without a profile), the bytes of every tensor of the
    file, and a max_ppl_increase target's bound on the metric."""

    types: Mapping[str, str]
    predicted: float | None
    tensor_bytes: int
    metric_bound: float | None = None

    def __post_init__(self) -> None:
        unknown = sorted({t for t in self.types.values() if t not in GGUF_TYPES})
        if unknown:
            raise InvalidConfigError(
                f"choices name unknown llama.cpp types {unknown}", field="types"
            )

    def to_dict(self) -> dict[str, Any]:
        return {
            "types": dict(self.types),
            "predicted": self.predicted,
            "tensor_bytes": self.tensor_bytes,
            "metric_bound": self.metric_bound,
        }


@dataclass(frozen=True)
class GgufPlan:
    """Everything a GGUF run does (the module's docstring); see plan_gguf."""

    source: SourceIdentity
    model: GgufModel
    goal: GgufGoal
    rotation: GgufRotation = field(default_factory=GgufRotation)
    layout: GgufLayout = field(default_factory=GgufLayout)
    compute: GgufCompute = field(default_factory=GgufCompute)
    profile: ProfileConfig | None = None
    evaluate: GgufEvalRequest | None = None
    choices: GgufChoices | None = None

    def __post_init__(self) -> None:
        if self.rotation.mode == "on" and not self.model.rotatable:
            raise InvalidConfigError(
                "rotate='on' applies to llama-family decoders (llama, mistral, qwen2); "
                f"this checkpoint is {self.model.architecture or '(no architecture)'} "
                f"(model_type {self.model.model_type!r})",
                field="rotate",
            )
        if self.rotation.rotated is None and (self.goal.target is None or self.choices):
            raise InvalidConfigError(
                "only a planning target leaves the rotation open to compare", field="rotate"
            )
        if (self.goal.target is None) != (self.profile is None):
            raise InvalidConfigError(
                "a profile configuration goes with a planning target, and only with one",
                field="profile",
            )
        if self.goal.ftype is not None and self.choices is not None:
            raise InvalidConfigError(
                f"ftype={self.goal.ftype!r} is llama.cpp's own mixture: no types to allocate",
                field="choices",
            )

    @property
    def rotated(self) -> bool:
        """Whether the file is the rotated checkpoint's (False while the choice is open)."""
        return bool(self.rotation.rotated)

    def with_choices(self, choices: GgufChoices) -> GgufPlan:
        return replace(self, choices=choices)

    def to_dict(self) -> dict[str, Any]:
        s = self.source
        return {
            "version": GGUF_PLAN_VERSION,
            "source": {"path": str(s.path), "id": s.id, "revision": s.revision, "kind": s.kind},
            "model": asdict(self.model),
            "goal": self.goal.to_dict(),
            "rotation": asdict(self.rotation),
            "layout": self.layout.to_dict(),
            "compute": asdict(self.compute),
            "profile": self.profile.to_dict() if self.profile is not None else None,
            "evaluate": asdict(self.evaluate) if self.evaluate is not None else None,
            "choices": self.choices.to_dict() if self.choices is not None else None,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> GgufPlan:
        from higgs_engine.sources import ResolvedSource

        if d.get("version") != GGUF_PLAN_VERSION:
            raise InvalidConfigError(
                f"GGUF plan version {d.get('version')!r} is not {GGUF_PLAN_VERSION}",
                field="version",
            )
        s = d["source"]
        choices = d.get("choices")
        return cls(
            source=ResolvedSource(Path(s["path"]), s["id"], s["revision"], s["kind"]),
            model=GgufModel(**d["model"]),
            goal=GgufGoal.from_dict(d["goal"]),
            rotation=GgufRotation(**d["rotation"]),
            layout=GgufLayout.from_dict(d["layout"]),
            compute=GgufCompute(**d["compute"]),
            profile=ProfileConfig.from_dict(d["profile"]) if d.get("profile") else None,
            evaluate=GgufEvalRequest(**d["evaluate"]) if d.get("evaluate") else None,
            choices=GgufChoices(**choices) if choices else None,
        )


def plan_gguf(
    source: SourceIdentity,
    goal: GgufGoal,
    rotation: GgufRotation | None = None,
    layout: GgufLayout | None = None,
    compute: GgufCompute | None = None,
    profile: ProfileConfig = DEFAULT_PROFILE,
    evaluate: GgufEvalRequest | None = None,
) -> GgufPlan:
    """The plan of a GGUF file of `source` for `goal`: the checkpoint's config read once (its
    architecture checked against llama.cpp's converter: UnsupportedModelError naming it), the
    rotation decided where it can be ("on": rotated; "off", or "auto" without a planning target
    or outside the llama family: not; "auto" with one: open, see rotation_candidates), threads
    resolved (0: every core). `profile` is kept only for a planning target."""
    from higgs_engine.gguf.convert import check_architecture
    from higgs_engine.gguf.rotate import ROTATABLE
    from higgs_engine.model_structure import load_config, model_kind

    hf_config = getattr(source, "hf_config", None) or load_config(source.path)
    archs = list(getattr(hf_config, "architectures", None) or [])
    check_architecture(archs)
    model_type = getattr(hf_config, "model_type", None)
    model = GgufModel(
        architecture=archs[0] if archs else None,
        model_type=model_type,
        encoder=model_kind(hf_config) != "causal",
        rotatable=model_type in ROTATABLE,
    )
    mode = (rotation or GgufRotation()).mode
    if mode == "on":
        rotated: bool | None = True
    elif mode == "auto" and model.rotatable and goal.target is not None:
        rotated = None
    else:
        rotated = False
    compute = compute or GgufCompute()
    return GgufPlan(
        source=source,
        model=model,
        goal=goal,
        rotation=replace(rotation or GgufRotation(), rotated=rotated),
        layout=layout or GgufLayout(),
        compute=replace(compute, threads=compute.thread_count),
        profile=profile if goal.target is not None else None,
        evaluate=evaluate,
    )


def rotation_candidates(plan: GgufPlan) -> tuple[GgufPlan, ...]:
    """The plans to allocate: the plan itself when its rotation is decided, else the two
    candidates (not rotated, rotated), in that order."""
    if plan.rotation.rotated is not None:
        return (plan,)
    return tuple(replace(plan, rotation=replace(plan.rotation, rotated=r)) for r in (False, True))


def pick_rotation(plain: GgufPlan, rotated: GgufPlan | None) -> GgufPlan:
    """The better of two allocated candidates: for an avg_bits target the lower predicted
    change, for a max_ppl_increase target the smaller file (the unrotated one on a tie).
    `rotated` None: its allocation was infeasible."""
    if rotated is None:
        return plain
    a, b, target = plain.choices, rotated.choices, plain.goal.target
    if a is None or b is None or target is None:
        raise InvalidConfigError("pick_rotation compares two allocated plans of a target")
    if target.avg_bits is not None:
        if a.predicted is None or b.predicted is None:
            raise InvalidConfigError("an avg_bits target's candidates carry predictions")
        return rotated if b.predicted < a.predicted else plain
    return rotated if b.tensor_bytes < a.tensor_bytes else plain
