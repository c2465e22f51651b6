"""Service verbs of the `higgs` command: `serve` (this part) and `keys` (API keys).

`higgs serve` is the embedded default in one command: it migrates the database, then runs
the API (uvicorn) and a Celery worker (with its sweep) as child processes, all configured by
the same Settings (HIGGS_* environment; --data-dir sets HIGGS_DATA_DIR). With no other
settings that is a SQLite file, a local artifact directory and kombu's filesystem transport
under the data directory; with HIGGS_DATABASE_URL / HIGGS_BROKER_URL it is the production
code path. Ctrl-C or SIGTERM stops both children (warm first, then forcefully).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from higgs_cli.common import CliError

# The API's ASGI application factory (uvicorn --factory).
API_FACTORY = "app.main:create_app"
WORKER_APP = "worker.celery_app"
QUEUES = "higgs,higgs.gpu"


# ---------------------------------------------------------------- commands (also used by tests)


def api_command(host: str, port: int, workers: int = 1, log_level: str = "info") -> list[str]:
    return [
        sys.executable,
        "-m",
        "uvicorn",
        API_FACTORY,
        "--factory",
        "--host",
        host,
        "--port",
        str(port),
        "--workers",
        str(workers),
        "--loop",
        "uvloop",
        "--http",
        "httptools",
        "--log-level",
        log_level,
        "--no-access-log",
        # Forwarded headers are the app's to believe, from HIGGS_FORWARDED_ALLOW_IPS only
        # (app.front_door); uvicorn's own default would trust them from 127.0.0.1.
        "--no-proxy-headers",
    ]


def worker_command(
    concurrency: int = 1, queues: str = QUEUES, name: str = "higgs@%h", log_level: str = "INFO"
) -> list[str]:
    # Mingle / gossip / event heartbeats are broadcast traffic a single embedded worker does
    # not need (and the filesystem transport cannot fan out).
    return [
        sys.executable,
        "-m",
        "celery",
        "-A",
        WORKER_APP,
        "worker",
        "-Q",
        queues,
        "--concurrency",
        str(concurrency),
        "-n",
        name,
        "--loglevel",
        log_level,
        "--without-mingle",
        "--without-gossip",
        "--without-heartbeat",
    ]


def _die_with_parent() -> None:
    """In the child, before exec: get SIGTERM if `higgs serve` itself dies (Linux)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Child:
    """One supervised child process in its own session (signals reach it only through us)."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        self.name = name
        self.proc = subprocess.Popen(
            argv,
            env=env,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )

    def poll(self) -> int | None:
        return self.proc.poll()

    def signal(self, sig: int) -> None:
        """SIGTERM to the process itself (it stops its own children: Celery's pool, uvicorn's
        workers); SIGKILL to the whole process group."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                if sig == signal.SIGKILL:
                    os.killpg(self.proc.pid, sig)
                else:
                    self.proc.send_signal(sig)

    def wait(self, timeout: float) -> bool:
        try:
            self.proc.wait(timeout=max(0.0, timeout))
            return True
        except subprocess.TimeoutExpired:
            return False


def stop_children(children: Sequence[Child], grace: float) -> None:
    """SIGTERM (uvicorn and Celery shut down warm), then SIGKILL whatever is left after `grace`.

    A job killed here keeps its row "running" without heartbeats; the sweep of the next worker
    re-queues it (acks_late + bounded attempts), so nothing accepted is lost.
    """
    for c in children:
        c.signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for c in children:
        if not c.wait(deadline - time.monotonic()):
            print(
                f"higgs serve: {c.name} did not stop within {grace:g}s; killing it", file=sys.stderr
            )
            c.signal(signal.SIGKILL)
            c.wait(5)


# ---------------------------------------------------------------- serve


def _settings() -> Any:
    """The service Settings from the environment; a bad HIGGS_ variable is a one-line error."""
    from pydantic import ValidationError

    from app.settings import Settings

    try:
        return Settings()
    except ValidationError as exc:
        first = exc.errors()[0]
        raise CliError(f"bad HIGGS_{str(first['loc'][0]).upper()}: {first['msg']}", 2) from exc


def _prepare(args: argparse.Namespace) -> tuple[Any, dict[str, str]]:
    """Settings for the children (same environment) and the database migrated to head."""
    env = dict(os.environ)
    if args.data_dir:
        env["HIGGS_DATA_DIR"] = str(Path(args.data_dir).expanduser().resolve())
        os.environ["HIGGS_DATA_DIR"] = env["HIGGS_DATA_DIR"]
    settings = _settings()
    try:
        settings.ensure_dirs()
    except OSError as exc:
        raise CliError(f"cannot create the data directory {settings.data_dir}: {exc}", 1) from exc
    from app.db.migrate import upgrade_database

    try:
        upgrade_database(settings.database_url)  # = `alembic upgrade head`
    except Exception as exc:
        where = settings.database_url.split("@")[-1]
        raise CliError(f"cannot migrate the database {where}: {exc}", 1) from exc
    env["HIGGS_DATA_DIR"] = str(settings.data_dir)
    return settings, env


MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


def metrics_dir(env: dict[str, str]) -> str | None:
    """Set PROMETHEUS_MULTIPROC_DIR for the API processes so that /metrics sums them all: a
    fresh temporary folder (returned: the caller removes it), or the folder the environment
    names, emptied of an earlier run's files (None returned)."""
    given = env.get(MULTIPROC_ENV)
    if given:
        folder = Path(given)
        folder.mkdir(parents=True, exist_ok=True)
        for stale in folder.glob("*.db"):
            stale.unlink(missing_ok=True)
        return None
    made = tempfile.mkdtemp(prefix="higgs-metrics-")
    env[MULTIPROC_ENV] = made
    return made


# What each part of `higgs serve` imports, by the extra that installs it (pyproject.toml). The
# worker runs the engine too; the API never does.
API_MODULES = ("fastapi", "uvicorn", "sqlalchemy", "alembic", "pydantic_settings", "celery")
ENGINE_MODULES = ("torch", "transformers", "safetensors", "huggingface_hub")


def _installed(module: str) -> bool:
    """Whether a top-level package can be imported, found without importing it."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def check_installed(api: bool, worker: bool) -> None:
    """CliError naming the extra to install when a part to run lacks its packages (rather than a
    ModuleNotFoundError traceback from this process or from a child)."""
    needs: list[tuple[str, str, tuple[str, ...]]] = []
    if worker:
        needs.append(("worker", "the worker", API_MODULES + ENGINE_MODULES))
    if api:
        needs.append(("api", "the API", API_MODULES))
    for extra, part, modules in needs:
        missing = [m for m in modules if not _installed(m)]
        if missing:
            hint = " (or run the API alone with --no-worker)" if part == "the worker" else ""
            raise CliError(
                f"{part} needs the '{extra}' extra, which is not installed (no "
                f"{', '.join(missing)}): pip install 'higgs-service[{extra}]'{hint}",
                1,
            )


def cmd_serve(args: argparse.Namespace) -> int:
    if args.no_api and args.no_worker:
        raise CliError("--no-api and --no-worker together leave nothing to run", 2)
    if not 0 < args.port < 65536:
        raise CliError(f"--port {args.port} must be in 1..65535", 2)
    check_installed(api=not args.no_api, worker=not args.no_worker)
    settings, env = _prepare(args)
    made = metrics_dir(env) if not args.no_api else None
    children: list[Child] = []
    stopping = False

    def on_signal(signum: int, _frame: Any) -> None:
        nonlocal stopping
        stopping = True

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    rc = 0
    try:
        if not args.no_worker:
            concurrency = args.concurrency or settings.worker_concurrency
            children.append(Child("worker", worker_command(concurrency), env))
        if not args.no_api:
            children.append(Child("api", api_command(args.host, args.port, args.api_workers), env))
        where = f"http://{args.host}:{args.port}" if not args.no_api else "(no API)"
        print(
            f"higgs serve: API {where}, worker {'off' if args.no_worker else 'on'}, "
            f"data {settings.data_dir}, database {settings.database_url.split('@')[-1]}, "
            f"broker {settings.broker_url.split('@')[-1]}. Ctrl-C stops.",
            flush=True,
        )
        print(
            "higgs serve: pids " + " ".join(f"{c.name}={c.proc.pid}" for c in children), flush=True
        )
        while not stopping:
            for c in children:
                code = c.poll()
                if code is not None:
                    print(
                        f"higgs serve: {c.name} exited with status {code}; stopping",
                        file=sys.stderr,
                    )
                    rc = 1
                    stopping = True
                    break
            time.sleep(0.2)
    finally:
        print("higgs serve: stopping", file=sys.stderr, flush=True)
        stop_children(children, args.grace)
        if made:
            shutil.rmtree(made, ignore_errors=True)
        for s, h in old.items():
            signal.signal(s, h)
    return rc


def register_serve(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "serve",
        help="run the API and a worker (embedded: SQLite + local files under --data-dir)",
        description=(
            "Run the HTTP API and a Celery worker. Without HIGGS_DATABASE_URL / HIGGS_BROKER_URL "
            "everything (SQLite database, broker folders, artifacts) lives under the data directory."
        ),
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--data-dir", default=None, help="data directory (env HIGGS_DATA_DIR, default ./.higgs)"
    )
    p.add_argument(
        "--concurrency",
        type=int,
        default=None,
        help="jobs run at once (default HIGGS_WORKER_CONCURRENCY, 1)",
    )
    p.add_argument("--api-workers", type=int, default=1, help="uvicorn worker processes")
    p.add_argument("--no-worker", action="store_true", help="run the API only")
    p.add_argument("--no-api", action="store_true", help="run the worker only")
    p.add_argument("--grace", type=float, default=20.0, help="seconds to wait for a warm shutdown")
    p.set_defaults(handler=cmd_serve)


# ---------------------------------------------------------------- keys (helper "api")


def _key_sessions(data_dir: str | None) -> Any:
    """A session factory on the (migrated) service database named by the settings."""
    if data_dir:
        os.environ["HIGGS_DATA_DIR"] = str(Path(data_dir).expanduser().resolve())
    from app.db.migrate import upgrade_database
    from app.db.session import create_db_engine, session_factory

    settings = _settings()
    try:
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        upgrade_database(settings.database_url)  # a fresh data dir gets its schema first
    except Exception as exc:
        where = settings.database_url.split("@")[-1]
        raise CliError(f"cannot open the database {where}: {str(exc).splitlines()[0]}", 1) from exc
    return session_factory(create_db_engine(settings.database_url))


def _keys_create_cmd(args: argparse.Namespace) -> int:
    keys_create(args.name, args.data_dir)
    return 0


def _keys_revoke_cmd(args: argparse.Namespace) -> int:
    keys_revoke(args.key_or_id, args.data_dir)
    return 0


def _keys_list_cmd(args: argparse.Namespace) -> int:
    keys_list(args.data_dir)
    return 0


def keys_create(name: str, data_dir: str | None = None) -> str:
    """Create a key; returns the plaintext key (only its sha256 is stored)."""
    from app.errors import AppError
    from app.keys.service import create_key

    with _key_sessions(data_dir)() as session:
        try:
            row, key = create_key(session, name)
        except AppError as exc:
            raise CliError(exc.detail, 2) from exc
    print(f"created API key {row.name!r} (id {row.id}, prefix {row.prefix})")
    # Above the key: scripts take the key from the last line.
    print(f"webhook signing secret: {row.webhook_secret} (also at GET /v1/webhooks/secret)")
    print("store the key now: it is shown only this once")
    print(key, flush=True)
    return key


def keys_revoke(key_or_id: str, data_dir: str | None = None) -> None:
    from app.errors import AppError
    from app.keys.service import revoke_key

    with _key_sessions(data_dir)() as session:
        try:
            row = revoke_key(session, key_or_id)
        except AppError as exc:
            raise CliError(exc.detail, 2) from exc
        print(f"revoked API key {row.name!r} (id {row.id}, prefix {row.prefix})")


def keys_list(data_dir: str | None = None) -> None:
    from sqlalchemy import select

    from app.db.models import ApiKey

    with _key_sessions(data_dir)() as session:
        rows = session.scalars(select(ApiKey).order_by(ApiKey.created_at)).all()
        for r in rows:
            revoked = f"revoked {r.revoked_at:%Y-%m-%d %H:%M}" if r.revoked_at else "active"
            print(
                f"{r.id}  {r.prefix}...  {r.name}  created {r.created_at:%Y-%m-%d %H:%M}  {revoked}"
            )
        if not rows:
            print("no API keys; create one with `higgs keys create NAME`")


def register_keys(subparsers: Any) -> None:
    p = subparsers.add_parser("keys", help="manage API keys", description="Manage API keys.")
    sub = p.add_subparsers(dest="keys_cmd", metavar="ACTION")
    sub.required = True
    data_dir_help = "data directory (env HIGGS_DATA_DIR, default ./.higgs); HIGGS_DATABASE_URL wins"
    c = sub.add_parser("create", help="create a key and print it once, alone on the last line")
    c.add_argument("name", help="a label for the key (who or what uses it)")
    c.add_argument("--data-dir", default=None, help=data_dir_help)
    c.set_defaults(handler=_keys_create_cmd)
    r = sub.add_parser("revoke", help="revoke a key: requests with it get 401 from then on")
    r.add_argument("key_or_id", metavar="KEY_OR_ID", help="the key itself, its id, or its prefix")
    r.add_argument("--data-dir", default=None, help=data_dir_help)
    r.set_defaults(handler=_keys_revoke_cmd)
    ls = sub.add_parser("list", help="list keys (ids and prefixes, never the keys)")
    ls.add_argument("--data-dir", default=None, help=data_dir_help)
    ls.set_defaults(handler=_keys_list_cmd)


def _models_cmd(args: argparse.Namespace) -> int:
    from app.jobs import local_models
    from app.jobs.model_ref import ModelRefError
    from app.jobs.model_ref import resolve_model as check_ref

    names: list[str] = list(getattr(args, "names", []) or [])
    for name in names:
        try:
            check_ref(name, None, None)
        except ModelRefError as exc:
            raise CliError(str(exc), 2) from exc
        if "/" in name:
            raise CliError(f"{name!r} is a Hub id; only local model names are registered", 2)
    with _key_sessions(args.data_dir)() as session:
        if args.models_cmd == "register":
            have = {
                r.name for r in local_models.listing(session) if r.holder == local_models.OPERATOR
            }
            local_models.register(session, have | set(names), local_models.OPERATOR)
            print(f"registered {', '.join(names)}")
        elif args.models_cmd == "unregister":
            n = local_models.unregister(session, local_models.OPERATOR, names)
            print(f"unregistered {n} of {len(names)} name(s) (workers' own rows stay)")
        else:
            rows = local_models.listing(session)
            for r in rows:
                seen = f"seen {r.seen_at:%Y-%m-%d %H:%M:%S}" if r.seen_at else "no expiry"
                print(f"{r.name}  {r.holder}  {seen}")
            if not rows:
                print("no local models registered (workers register their models folder)")
    return 0


def register_models(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "models",
        help="local model names the API accepts",
        description="Local model names the API accepts. Workers register the folders of their "
        "HIGGS_MODELS_DIR themselves; an operator can add names by hand.",
    )
    sub = p.add_subparsers(dest="models_cmd", metavar="ACTION")
    sub.required = True
    data_dir_help = "data directory (env HIGGS_DATA_DIR, default ./.higgs); HIGGS_DATABASE_URL wins"
    for action, help_ in (
        ("register", "accept these local model names (the workers must have them)"),
        ("unregister", "remove names registered by hand"),
        ("list", "list registered names and who has them"),
    ):
        a = sub.add_parser(action, help=help_)
        if action != "list":
            a.add_argument("names", nargs="+", metavar="NAME")
        a.add_argument("--data-dir", default=None, help=data_dir_help)
        a.set_defaults(handler=_models_cmd)


def register(subparsers: Any) -> None:
    """Add the service verbs to the `higgs` parser (see higgs_cli/main.py)."""
    register_serve(subparsers)
    register_keys(subparsers)
    register_models(subparsers)
