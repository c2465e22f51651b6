"""Typed errors of the engine. Every message names the bad value."""

from __future__ import annotations


class HiggsError(Exception):
    """Base of every error the engine raises on purpose. `code` is a stable machine name."""

    code: str = "engine_error"


class InvalidConfigError(HiggsError, ValueError):
    """A quantization option is out of range or inconsistent (bits, p, n, group size...).

    `field` names the option it is about (a HiggsConfig field such as "p" or "group_size",
    "bits" for a bit budget), or None when no single option is to blame."""

    code = "invalid_config"

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class ModelNotFoundError(HiggsError, FileNotFoundError):
    """The model reference names no readable checkpoint (local path or Hub id)."""

    code = "model_not_found"


class UnsupportedModelError(HiggsError):
    """The checkpoint's architecture cannot be built or has nothing quantizable."""

    code = "unsupported_model"


class CorruptCheckpointError(HiggsError):
    """A checkpoint or artifact file exists but cannot be parsed, fails its checksum, or
    contradicts itself (`field`: the config.json field its tensors disagree with, or None)."""

    code = "corrupt_checkpoint"

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class InfeasibleTargetError(HiggsError, ValueError):
    """A compression target no allocation can meet (budget below the smallest option...)."""

    code = "infeasible_target"


class ProfileNotFoundError(HiggsError, FileNotFoundError):
    """No cached sensitivity profile exists for the model."""

    code = "profile_not_found"


class CancelledError(HiggsError):
    """The progress callback asked to stop (returned False or raised this)."""

    code = "cancelled"


class OutOfMemoryError(HiggsError, MemoryError):
    """A step (a subprocess such as llama.cpp's converter, or an allocation) could not get the
    memory it asked for: the machine's, or a limit the caller set on the process."""

    code = "out_of_memory"
