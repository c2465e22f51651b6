"""What the verb modules of the `higgs` command share: the CliError every verb raises, the
progress bars drawn per stage, the profile cache's default place, and the profile, text and
target helpers of `higgs profile`, `higgs plan` and `higgs quantize`. Verb modules import this
module, never each other's helpers. Only the standard library is imported at module level (the
dispatcher imports this module for every verb); the engine loads inside the functions.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from higgs_engine.planning.stages import stage_unit


class CliError(Exception):
    """An expected failure: printed as one line, exit with `exit_code`."""

    def __init__(self, message: str, exit_code: int = 2) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class StageBars:
    """A progress callback drawing one tqdm bar per stage on stderr (off when not a TTY), in
    the unit the stage counts (higgs_engine.planning.stages)."""

    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet
        self.stage: str | None = None
        self.bar: Any = None

    def __call__(self, stage: str, done: int, total: int) -> None:
        if self.quiet:
            return
        from tqdm import tqdm

        if stage != self.stage:
            self.close()
            self.stage = stage
            unit = stage_unit(stage)
            # disable=None: tqdm turns itself off when stderr is not a terminal.
            self.bar = tqdm(
                total=total, desc=stage, unit=unit, file=sys.stderr, disable=None, leave=False
            )
        if self.bar is not None:
            self.bar.total = total
            self.bar.n = done
            self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def quiet_libraries() -> None:
    """Silence transformers' own progress bars and warnings: stderr carries our bar or our
    one-line error, nothing else."""
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def default_profile_cache() -> Path:
    """Where profiles and self-generated text are cached when no --cache DIR is given."""
    import os

    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "higgs" / "profiles"


def profile_config(args: argparse.Namespace, prefix: str = "") -> Any:
    """The ProfileConfig of the profile options (`--PREFIXtokens`, `--PREFIXmetric`, ...)."""
    from higgs_engine.planning.profile import ProfileConfig

    def get(name: str) -> Any:
        return getattr(args, (prefix + name).replace("-", "_"))

    tokens, context = int(get("tokens")), int(get("context"))
    if tokens < 2:
        raise CliError(f"--{prefix}tokens {tokens} must be at least 2")
    if context < 2:
        raise CliError(f"--{prefix}context {context} must be at least 2")
    context = min(context, tokens)
    if get("metric") == "ppl" and get("text") is None:
        raise CliError(
            f"--{prefix}metric ppl needs --{prefix}text FILE (perplexity of random tokens means nothing)"
        )
    return ProfileConfig(
        metric=get("metric"),
        method="noise" if get("noise") else "fisher",
        data_free="random" if get("random_tokens") else "self",
        levels=tuple(get("levels")),
        context=context,
        windows=max(1, tokens // context),
        seed=int(get("seed")),
        fisher_samples=int(get("samples")),
    )


def read_text_option(args: argparse.Namespace, prefix: str = "") -> str | None:
    """The text of the `--PREFIXtext FILE` option, or None when it is not given."""
    path = getattr(args, (prefix + "text").replace("-", "_"))
    if path is None:
        return None
    from higgs_engine.evaluate import read_text

    return read_text(Path(path))


def load_profile(path: str) -> Any:
    """A finished profile from its JSON file (an incomplete one is a CliError)."""
    from higgs_engine.planning.profile import Profile

    prof = Profile.load(Path(path))
    if not prof.complete:
        raise CliError(
            f"profile {path!r} is incomplete ({len(prof.layers)} layers); rerun `higgs profile` to finish it"
        )
    return prof


def profile_source(
    args: argparse.Namespace, *, fallback_text: str | None = None, **more: Any
) -> Any:
    """The engine's ProfileSource for a dynamic target: the --profile FILE as given, else one
    measured as the --profile-* options say on the --profile-text (or `fallback_text`), found
    in or kept at the profile cache (--profile-cache, or the default) like the self-generated
    text. `more`: further ProfileSource fields (the option menu)."""
    from higgs_engine.job import ProfileSource
    from higgs_engine.planning.profile import ProfileDirectory

    given = getattr(args, "profile_cache", None)
    cache = Path(given) if given else default_profile_cache()
    where: dict[str, Any] = {"stores": (ProfileDirectory(cache),), "selfgen_cache": cache, **more}
    if getattr(args, "profile", None):
        return ProfileSource(profile=load_profile(args.profile), **where)
    text = read_text_option(args, "profile-")
    return ProfileSource(
        config=profile_config(args, "profile-"),
        text=fallback_text if text is None else text,
        **where,
    )


def dynamic_target(avg_bits: float | None, max_ppl: float | None) -> Any:
    """The dynamic target of --avg-bits / --max-ppl-increase, or None when neither is given."""
    from higgs_engine.planning.plans import Target

    if avg_bits is None and max_ppl is None:
        return None
    return Target(avg_bits=avg_bits, max_ppl_increase=max_ppl)


def calibration_text(args: argparse.Namespace) -> str | None:
    """The --calibration file's text (None for `self` or no calibration), checked before any
    model is loaded: missing, empty, binary or too large files are one-line errors."""
    if args.calibration_tokens is not None and args.calibration is None:
        raise CliError("--calibration-tokens needs --calibration FILE or --calibration self")
    if args.calibration_tokens is not None and args.calibration_tokens < 2:
        raise CliError(f"--calibration-tokens {args.calibration_tokens} must be at least 2")
    if args.calibration is None or args.calibration == "self":
        return None
    from higgs_engine.calibration import read_calibration_file

    return read_calibration_file(Path(args.calibration))


def _calibration_text_cache(args: argparse.Namespace) -> Path:
    """Self-generated text is cached beside the profiles (--profile-cache, or the default)."""
    given = getattr(args, "profile_cache", None)
    return Path(given) if given else default_profile_cache()


def calibration_request(args: argparse.Namespace, text: str | None) -> Any:
    """The job's CalibrationRequest (made into token windows once the model is resolved), or
    None without --calibration."""
    if args.calibration is None:
        return None
    from higgs_engine.calibration import DEFAULT_CALIBRATION_TOKENS
    from higgs_engine.job import CalibrationRequest

    return CalibrationRequest(
        text,
        args.calibration_tokens or DEFAULT_CALIBRATION_TOKENS,
        label=f"file:{Path(args.calibration).name}" if text is not None else "self",
        cache_dir=_calibration_text_cache(args) if text is None else None,
        field=f"--calibration {args.calibration}",
    )
