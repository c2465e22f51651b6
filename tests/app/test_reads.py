"""The API's read path: autocommit reads (app.db.session.Reads) that survive a connection the
database dropped, pings only for connections idle in the pool (ping_when_idle), and API keys
looked up once per expiry however many requests miss the cache at the same moment."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event, text
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.orm import Session, sessionmaker

from app.artifacts.manifest import artifact_row
from app.db.session import Reads, create_db_engine, ping_when_idle
from app.jobs import repository, service, state
from app.keys.service import AuthKey, KeyCache, create_key
from tests.app.dbutil import POSTGRES_SKIP_REASON, postgres_server_url
from tests.app.factories import make_job


@pytest.fixture
def pg_engine(postgres_session_db: str) -> Iterator[Engine]:
    """The API's engine settings: no pre-ping, ping_when_idle (0.5 s)."""
    engine = create_db_engine(postgres_session_db, pool_pre_ping=False, pool_size=2)
    ping_when_idle(engine, idle_s=0.5)
    try:
        yield engine
    finally:
        engine.dispose()


def _backend_pid(conn: Connection) -> int:
    return int(conn.execute(text("SELECT pg_backend_pid()")).scalar_one())


def _terminate_others(url: str) -> int:
    """Kill every other server process of this database (a failover or a restart, as the
    pooled connections see it); returns how many."""
    admin = create_db_engine(url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            return len(
                conn.execute(
                    text(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                        "WHERE datname = current_database() AND pid <> pg_backend_pid()"
                    )
                ).all()
            )
    finally:
        admin.dispose()


def _statements(engine: Engine) -> list[str]:
    seen: list[str] = []

    @event.listens_for(engine, "before_cursor_execute")
    def _record(_c: Any, _cur: Any, statement: str, *_: Any) -> None:
        seen.append(statement.strip().split()[0].upper())

    return seen


@pytest.mark.skipif(postgres_server_url() is None, reason=POSTGRES_SKIP_REASON)
def test_a_read_on_a_connection_the_database_dropped_is_retried_once(
    pg_engine: Engine, postgres_session_db: str
) -> None:
    reads = Reads(pg_engine)
    first = reads.run(_backend_pid)
    assert _terminate_others(postgres_session_db) >= 1
    # Within the idle window: no ping, so the pooled connection is used, fails as a
    # disconnect, and the read runs again on a new connection.
    second = reads.run(_backend_pid)
    assert second != first


@pytest.mark.skipif(postgres_server_url() is None, reason=POSTGRES_SKIP_REASON)
def test_a_connection_idle_in_the_pool_is_pinged_and_replaced_when_dead(
    pg_engine: Engine, postgres_session_db: str
) -> None:
    with pg_engine.connect() as conn:
        first = _backend_pid(conn)
    assert _terminate_others(postgres_session_db) >= 1
    time.sleep(0.7)  # past idle_s: the checkout pings, finds it dead, connects anew
    with pg_engine.connect() as conn:  # no retry around this one
        assert _backend_pid(conn) != first


@pytest.mark.skipif(postgres_server_url() is None, reason=POSTGRES_SKIP_REASON)
def test_a_read_opens_no_transaction(pg_engine: Engine) -> None:
    def status_after_a_select(conn: Connection) -> str:
        conn.execute(text("SELECT 1")).all()
        raw = conn.connection.driver_connection
        return str(raw.info.transaction_status.name) if raw is not None else "?"

    # psycopg sends BEGIN itself before a statement outside autocommit: the connection says
    # whether one was sent (INTRANS) or not (IDLE).
    assert Reads(pg_engine).run(status_after_a_select) == "IDLE"
    with pg_engine.connect() as conn:  # the same pool, transactional as before
        assert status_after_a_select(conn) == "INTRANS"


def test_concurrent_misses_of_one_key_cost_one_lookup(
    sessions: sessionmaker[Session],
) -> None:
    with sessions() as s:
        _, key = create_key(s, "busy")
    cache = KeyCache(sessions, ttl_s=60)
    engine = sessions.kw["bind"]
    seen = _statements(engine)
    start = threading.Barrier(16)
    found: list[str] = []

    def request() -> None:
        start.wait()
        found.append((cache.cached(key) or cache.load(key)).name)

    threads = [threading.Thread(target=request) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert found == ["busy"] * 16
    assert seen.count("SELECT") == 1, seen


def test_the_job_view_reads_match_the_session_reads(
    sessions: sessionmaker[Session], tmp_path: Path
) -> None:
    """read_owned / read_page (Core, view columns) see what the ORM sees, artifacts included
    for a succeeded job only."""
    with sessions() as s:
        row, _ = create_key(s, "views")
        key = AuthKey.of(row)
        other, _ = create_key(s, "other")
        ids = (
            make_job(s, key.id, age_s=2).id,
            make_job(s, key.id, age_s=1).id,
            make_job(s, other.id).id,
        )
    store = tmp_path / "store" / "native"
    store.mkdir(parents=True)
    (store / "model.safetensors").write_bytes(b"\x01" * 1000)
    with sessions() as s:
        state.claim(s, ids[0], "w")
        state.succeed(s, ids[0], {"layers": []}, [], [artifact_row("native", store)])
        state.claim(s, ids[1], "w")
    reads = Reads(sessions.kw["bind"])
    for job_id in ids[:2]:
        with sessions() as s:
            orm = service.job_view(service.get_job(s, key, job_id))

        def read(c: Connection, job_id: str = job_id) -> repository.JobRecord:
            return service.read_job(c, key, job_id)

        assert service.job_view(reads.run(read)) == orm
    done = reads.run(lambda c: service.read_job(c, key, ids[0]))
    assert [a.format for a in done.artifacts] == ["native"]
    with pytest.raises(state.JobNotFoundError):
        reads.run(lambda c: service.read_job(c, key, ids[2]))  # another key's job

    def page(limit: int, after: str | None = None, status: str | None = None) -> Any:
        return reads.run(
            lambda c: service.list_jobs(
                c, key, status=status, limit=limit, after=after, max_limit=100
            )
        )

    first, cursor = page(1)
    rest, end = page(5, cursor)
    assert [j.id for j in first + rest] == [ids[1], ids[0]] and end is None  # newest first
    assert [j.artifacts for j in first] == [()]
    assert [(j.id, len(j.artifacts)) for j in page(5, status="succeeded")[0]] == [(ids[0], 1)]
