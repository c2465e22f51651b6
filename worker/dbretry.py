"""Database writes from the worker that ride out an outage (a PostgreSQL restart, a failover,
a dropped connection) instead of abandoning the job attempt.

    value = retry_db(lambda: work(), "heartbeat of job X", budget_s=300)

Each try opens its own session (the callers' functions do `with sessions() as s: ...`), so a
connection that broke mid-transaction is never reused: the pool's pre-ping replaces it. Only
transient errors are retried (connection refused or lost, server shutting down or starting
up, SQLite busy); anything else (a constraint, bad data) is raised at once. The first failure
of an outage is logged once as a warning and its end as info; the tries in between are quiet.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from typing import TypeVar

from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

log = logging.getLogger("worker.db")

T = TypeVar("T")

# Where the worker's database writes open their sessions (one per try).
SessionFactory = sessionmaker[Session]

FIRST_DELAY_S = 0.1
MAX_DELAY_S = 2.0


def is_transient(exc: BaseException) -> bool:
    """True for errors that say the database is (briefly) unreachable, not that the write is bad."""
    if isinstance(exc, (OperationalError, InterfaceError)):
        return True
    return isinstance(exc, DBAPIError) and bool(exc.connection_invalidated)


class DatabaseUnavailableError(RuntimeError):
    """The database stayed unreachable for the whole retry budget."""

    def __init__(self, what: str, seconds: float, cause: BaseException) -> None:
        first = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        super().__init__(
            f"the database was unreachable for {seconds:.0f}s while writing the {what}: {first}"
        )
        self.what = what


def retry_db(
    fn: Callable[[], T],
    what: str,
    budget_s: float,
    *,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> T:
    """fn(), retried with exponential backoff (0.1 s doubling to 2 s, jittered) while it fails
    with a transient database error, for at most `budget_s` seconds in all. Raises
    DatabaseUnavailableError (from the last error) when the budget is spent."""
    start = clock()
    delay = FIRST_DELAY_S
    failures = 0
    while True:
        try:
            value = fn()
        except Exception as exc:
            if not is_transient(exc):
                raise
            failures += 1
            waited = clock() - start
            if failures == 1:
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                log.warning(
                    "database unavailable while writing the %s (%s); retrying for up to %gs",
                    what,
                    first,
                    budget_s,
                )
            if waited + delay > budget_s:
                raise DatabaseUnavailableError(what, waited, exc) from exc
            sleep(min(delay * random.uniform(0.8, 1.2), budget_s - waited))
            delay = min(MAX_DELAY_S, delay * 2)
            continue
        if failures:
            log.info(
                "database back after %.1fs (%s written, %d tries)",
                clock() - start,
                what,
                failures + 1,
            )
        return value
