"""Engine and session factory, portable between SQLite (embedded) and PostgreSQL (psycopg 3)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

from sqlalchemy import create_engine, event
from sqlalchemy.engine import Connection, Engine, make_url
from sqlalchemy.exc import DBAPIError, InvalidatePoolError
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import ConnectionPoolEntry, PoolProxiedConnection

SQLITE_BUSY_TIMEOUT_S = 30.0
# ping_when_idle: a pooled connection unused this long is checked before it is handed out.
PING_AFTER_IDLE_S = 1.0
# libpq's connect_timeout for engines made without one (workers, migrations, the CLI).
PG_CONNECT_TIMEOUT_S = 10


def normalise_url(url: str) -> str:
    """Use psycopg 3 for plain postgresql:// URLs (SQLAlchemy would pick psycopg2)."""
    u = make_url(url)
    if u.drivername in ("postgresql", "postgres"):
        u = u.set(drivername="postgresql+psycopg")
    return u.render_as_string(hide_password=False)


def _sqlite_on_connect(dbapi_conn: Any, _record: Any) -> None:
    # WAL lets readers (API) and a writer (worker) work at once from separate processes;
    # busy_timeout makes concurrent writers wait instead of failing with "database is locked".
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute(f"PRAGMA busy_timeout={int(SQLITE_BUSY_TIMEOUT_S * 1000)}")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.close()


def create_db_engine(
    url: str,
    *,
    connect_timeout_s: int = PG_CONNECT_TIMEOUT_S,
    statement_timeout_s: float = 0.0,
    **kwargs: Any,
) -> Engine:
    """An Engine for `url`; SQLite files get WAL + busy_timeout + foreign keys. PostgreSQL
    connections get libpq's connect_timeout, TCP keepalives (a peer that vanished is noticed
    within a minute) and, when statement_timeout_s > 0, a server-side statement_timeout."""
    url = normalise_url(url)
    u = make_url(url)
    if u.get_backend_name() == "sqlite":
        connect_args = {"check_same_thread": False, "timeout": SQLITE_BUSY_TIMEOUT_S}
        engine = create_engine(url, connect_args=connect_args, **kwargs)
        event.listen(engine, "connect", _sqlite_on_connect)
        return engine
    pg_args: dict[str, Any] = {
        "connect_timeout": max(2, int(connect_timeout_s)),
        "keepalives": 1,
        "keepalives_idle": 30,
        "keepalives_interval": 10,
        "keepalives_count": 3,
    }
    if statement_timeout_s > 0:
        pg_args["options"] = f"-c statement_timeout={int(statement_timeout_s * 1000)}"
    kwargs["connect_args"] = {**pg_args, **kwargs.get("connect_args", {})}
    kwargs.setdefault("pool_pre_ping", True)
    kwargs.setdefault("pool_timeout", 10.0)
    kwargs.setdefault("pool_size", 10)
    kwargs.setdefault("max_overflow", 20)
    return create_engine(url, **kwargs)


def ping_when_idle(engine: Engine, idle_s: float = PING_AFTER_IDLE_S) -> None:
    """Check a pooled connection (one round trip) only when it has sat unused in the pool for
    more than `idle_s`, instead of pool_pre_ping's round trip on every checkout: under load a
    connection is handed out again milliseconds after its last answer, and that ping was a
    third of a simple read's cost. A dead connection found here makes the pool discard every
    connection older than now (a database restart kills them all); one that dies while in use
    raises a disconnect error as it would after a passed ping (Reads retries such a read)."""

    @event.listens_for(engine, "checkin")
    def _idle_since(_dbapi_conn: Any, record: ConnectionPoolEntry) -> None:
        record.info["idle_since"] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _ping(dbapi_conn: Any, record: ConnectionPoolEntry, _proxy: PoolProxiedConnection) -> None:
        since = record.info.get("idle_since")
        if since is None or time.monotonic() - since < idle_s:
            return  # a new connection, or one that answered a moment ago
        try:
            engine.dialect.do_ping(dbapi_conn)
        except Exception as e:
            if engine.dialect.is_disconnect(e, dbapi_conn, None):  # type: ignore[arg-type]
                raise InvalidatePoolError(f"pooled connection is dead: {e}") from e
            raise


def session_factory(engine: Engine) -> sessionmaker[Session]:
    """Sessions that keep loaded objects usable after commit (routes render them afterwards)."""
    return sessionmaker(bind=engine, expire_on_commit=False)


T = TypeVar("T")


class Reads:
    """Short reads outside any transaction: `run(fn)` calls fn with a connection in autocommit
    mode (no BEGIN / ROLLBACK round trips: one statement is its own snapshot) and returns the
    connection to the pool before it returns. A connection that turns out to be dead (the
    database restarted since it was pooled; SQLAlchemy then discards the whole pool) is
    replaced once, so a read after a restart does not fail for the old connection."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine.execution_options(isolation_level="AUTOCOMMIT")

    def run(self, fn: Callable[[Connection], T]) -> T:
        try:
            return self._once(fn)
        except DBAPIError as e:
            if not e.connection_invalidated:
                raise
        return self._once(fn)

    def _once(self, fn: Callable[[Connection], T]) -> T:
        with self.engine.connect() as conn:
            return fn(conn)
