"""The one `higgs` command: a small dispatcher that imports a verb's module only when used.

How verbs are wired (for the authors of the verb modules):

- `VERBS` below maps each verb to (module, one-line help). The module is imported only when
  its verb is on the command line (or for `higgs VERB --help`), so `higgs --help` and every
  verb start fast and the engine (torch) and the service (fastapi, celery) never import each
  other.
- Each verb module exposes `register(subparsers)`: it adds a parser for each of ITS verbs with
  `subparsers.add_parser(verb, help=...)` and sets a handler with
  `parser.set_defaults(handler=fn)`, where `fn(args: argparse.Namespace) -> int` returns the
  exit code. Heavy imports (torch, transformers, fastapi...) go inside the handlers.
- Errors: raise `higgs_cli.common.CliError(message, exit_code)` (or any
  `higgs_engine.errors.HiggsError`, or `OSError`) and main() prints exactly one line
  `higgs: error: <message>` on stderr and exits with that code (2 for bad input, 1 otherwise), never a traceback. `--debug` (before the verb)
  re-raises instead, for developers.
- What several verbs share (CliError, the per-stage progress bars, the profile cache's
  default place, the profile / text / target helpers) lives in `higgs_cli.common`; verb
  modules import it and never each other's helpers.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from higgs_cli.common import CliError

PROG = "higgs"

# verb -> (module implementing it, help line shown by `higgs --help`)
VERBS: dict[str, tuple[str, str]] = {
    "quantize": ("higgs_cli.engine_cmds", "quantize a Hugging Face checkpoint with HIGGS"),
    "eval": ("higgs_cli.engine_cmds", "perplexity / KL of a model or artifact on a text file"),
    "profile": ("higgs_cli.dynamic_cmds", "measure a model's per-layer sensitivity profile"),
    "plan": ("higgs_cli.dynamic_cmds", "predicted quality versus size from a profile"),
    "serve": ("higgs_cli.service_cmds", "run the HTTP API and/or a worker"),
    "keys": ("higgs_cli.service_cmds", "manage API keys"),
    "models": ("higgs_cli.service_cmds", "local model names the API accepts"),
    "submit": ("higgs_cli.client_cmds", "submit a quantization job to a service"),
    "status": ("higgs_cli.client_cmds", "show a job's status"),
    "download": ("higgs_cli.client_cmds", "download a finished job's artifacts"),
}


# Which extra of pyproject.toml installs a top-level package (for "install the extra" errors).
EXTRA_OF = {
    **dict.fromkeys(
        ("fastapi", "starlette", "uvicorn", "pydantic_settings", "sqlalchemy", "alembic",
         "psycopg", "celery", "kombu", "redis", "prometheus_client", "boto3", "botocore"),
        "api",
    ),
    **dict.fromkeys(
        ("torch", "transformers", "safetensors", "huggingface_hub", "gguf", "sentencepiece"),
        "engine",
    ),
}  # fmt: skip


def missing_extra(exc: BaseException) -> str | None:
    """For a ModuleNotFoundError of a package an extra installs: one line naming that extra."""
    if not isinstance(exc, ModuleNotFoundError) or not exc.name:
        return None
    extra = EXTRA_OF.get(exc.name.split(".")[0])
    if extra is None:
        return None
    return (
        f"this needs the '{extra}' extra, which is not installed (no {exc.name.split('.')[0]}): "
        f"pip install 'higgs-service[{extra}]'"
    )


def _find_verb(argv: Sequence[str]) -> str | None:
    for arg in argv:
        if arg in VERBS:
            return arg
        if not arg.startswith("-"):
            return None  # an unknown verb: argparse reports it
    return None


def build_parser(verb: str | None) -> argparse.ArgumentParser:
    """The parser with `verb`'s module registered and placeholders for the other verbs."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="HIGGS quantization: engine, service and client in one command.",
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    sub = parser.add_subparsers(dest="verb", metavar="VERB")
    sub.required = True
    registered: set[str] = set()
    if verb is not None:
        module = importlib.import_module(VERBS[verb][0])
        before = set(sub.choices)
        module.register(sub)
        registered = set(sub.choices) - before
    for name, (_, help_line) in VERBS.items():
        if name not in registered:
            sub.add_parser(name, help=help_line, add_help=False)
    return parser


def _fail(message: str, code: int) -> int:
    first = message.strip().splitlines()[0] if message.strip() else "unknown error"
    print(f"{PROG}: error: {first}", file=sys.stderr)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    verb = _find_verb(args_list)
    head = args_list[: args_list.index(verb)] if verb is not None else args_list
    debug = "--debug" in head
    try:
        try:
            parser = build_parser(verb)
        except ModuleNotFoundError as exc:
            if debug:
                raise
            return _fail(missing_extra(exc) or f"the {verb!r} command is not available: {exc}", 1)
        args = parser.parse_args(args_list)
        handler = getattr(args, "handler", None)
        if handler is None:
            return _fail(f"the {args.verb!r} command is not available in this installation", 1)
        return int(handler(args) or 0)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except CliError as exc:
        if debug:
            raise
        return _fail(str(exc), exc.exit_code)
    except SystemExit:
        raise
    except BaseException as exc:
        if debug:
            raise
        return _fail(*_classify(exc))


def _classify(exc: BaseException) -> tuple[str, int]:
    """Message and exit code for an exception escaping a handler."""
    try:
        from higgs_engine.errors import HiggsError
    except ImportError:  # pragma: no cover - the engine is part of this package
        HiggsError = ()  # type: ignore[assignment,misc]
    if isinstance(exc, HiggsError):
        return str(exc), 2
    extra = missing_extra(exc)
    if extra is not None:
        return extra, 1
    if isinstance(exc, OSError):
        where = f" ({exc.filename})" if getattr(exc, "filename", None) else ""
        return f"{exc.strerror or exc}{where}", 1
    return f"unexpected {type(exc).__name__}: {exc}", 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
