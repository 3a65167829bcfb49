"""The store's one engine and its transactions, shared by every resource of the store.

`Database(url)` opens SQLite (WAL, a busy timeout, one in-process writer at a time so the
control plane's threads never spin in SQLite's busy handler) or PostgreSQL. Each
resource (`store.files`, `store.jobs`, ...) opens a short transaction per call through
it: `read()` and `write()` give an ORM session, `reading()` and `writing()` a connection
for the prebuilt statements of `statements`.

Writes that come from an attempt (metrics, checkpoints, events, status detail, the end)
go through `as_attempt`: they happen only while that attempt is the job's current,
unended one, checked in the same transaction; otherwise `StaleAttempt` is raised and
nothing is written.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, event, select
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.orm import Session, sessionmaker

from service.errors import UnknownCursor
from service.store import statements
from service.store.models import TERMINAL, Attempt, Job
from service.store.status import AttemptState


class StaleAttempt(Exception):
    """A write from an attempt that is not the job's current, unended one: a zombie
    driver or worker whose successor runs, or one whose job has finished."""

    def __init__(self, job_id: str, attempt: int, why: str) -> None:
        super().__init__(f"job {job_id} attempt {attempt} may no longer write: {why}")
        self.job_id, self.attempt, self.why = job_id, attempt, why


def is_outage(exc: BaseException) -> bool:
    """Whether `exc` says the store cannot be reached or used now (a lost connection, a
    server down or restarting, a full pool, SQLite locked past its timeout): a condition
    to wait out and retry, not a bug."""
    from sqlalchemy import exc as sx

    if isinstance(exc, (sx.OperationalError, sx.InterfaceError, sx.TimeoutError)):
        return True
    return isinstance(exc, sx.DBAPIError) and bool(exc.connection_invalidated)


class Database:
    """The engine, its session factories and the write lock: one per `Store`."""

    def __init__(self, url: str, *, pool_size: int = 20) -> None:
        self.url = url
        self.is_sqlite = url.startswith("sqlite")
        kwargs: dict[str, Any] = {}
        if self.is_sqlite:
            kwargs["connect_args"] = {"check_same_thread": False, "timeout": 30}
            # as many pooled connections as request threads use at once: past the default
            # 5 (+10 overflow) each request opened, set up and closed its own (measured:
            # ~6% of the API's CPU under load)
            kwargs.update(pool_size=pool_size, max_overflow=pool_size)
        else:
            kwargs.update(pool_size=pool_size, max_overflow=pool_size, pool_pre_ping=True)
            if url.startswith("postgresql"):
                # a server that does not answer (a failover, a lost route) fails a connect in
                # seconds: the callers' outage handling takes over, no thread hangs
                kwargs["connect_args"] = {"connect_timeout": 10}
        if self.is_sqlite and (path := url.split("///", 1)[-1]) and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.engine: Engine = create_engine(
            url, json_serializer=statements.dumps, json_deserializer=statements.loads, **kwargs
        )
        write_bind = self.engine
        if self.is_sqlite:
            event.listen(self.engine, "connect", _sqlite_connect)
            event.listen(self.engine, "begin", _sqlite_begin)
            # writers take SQLite's write lock at BEGIN: a deferred transaction that reads
            # and then writes fails at once when another process (a job driver) writes
            write_bind = self.engine.execution_options(sqlite_immediate=True)
        self._write_bind = write_bind
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)
        self._write_sessions = sessionmaker(write_bind, expire_on_commit=False)
        # SQLite takes one writer at a time; serializing ours in-process keeps the
        # control plane's threads out of its sleeping busy handler (a latency cliff).
        self._write_lock = threading.Lock() if self.is_sqlite else contextlib.nullcontext()

    @contextlib.contextmanager
    def read(self) -> Iterator[Session]:
        with self._sessions() as s:
            yield s

    @contextlib.contextmanager
    def write(self) -> Iterator[Session]:
        with self._write_lock, self._write_sessions() as s, s.begin():
            yield s

    @contextlib.contextmanager
    def reading(self) -> Iterator[Connection]:
        """A pooled connection for the prebuilt statements of `statements`."""
        with self.engine.connect() as conn:
            yield conn

    @contextlib.contextmanager
    def writing(self) -> Iterator[Connection]:
        """A write transaction on a connection (Core statements, Alembic)."""
        with self._write_lock, self._write_bind.begin() as conn:
            yield conn

    @contextlib.contextmanager
    def as_attempt(self, job_id: str, attempt: int) -> Iterator[Session]:
        """A write transaction of attempt `attempt` of job `job_id`: it opens only while
        that attempt is the job's current, unended one (else `StaleAttempt`), and the job's
        row stays locked until it commits (PostgreSQL; SQLite writes one at a time)."""
        with self.write() as s:
            check_current(s, job_id, attempt, lock=True)
            yield s

    def write_as(
        self, job_id: str, attempt: int | None
    ) -> contextlib.AbstractContextManager[Session]:
        """`as_attempt` when the write is an attempt's (`attempt` given), else `write`."""
        return self.write() if attempt is None else self.as_attempt(job_id, attempt)

    def cursor(self, model: Any, after: str, what: str, scope: Any) -> int:
        """The position of the object `after` names in its list. One the list does not hold
        (never there, another tenant's, or deleted since the previous page) is an error:
        starting over from the first page would hand the client rows it has already seen."""
        with self.read() as s:
            seq = s.scalar(select(model.seq).where(model.id == after, scope))
        if seq is None:
            raise UnknownCursor(
                f"after: no {what} '{after}' in this list (deleted, or not from a previous "
                "page); list again without 'after'",
                param="after",
                code="cursor_not_found",
            )
        return seq


class Resource:
    """The reads and writes of one resource, in transactions of the shared `Database`."""

    def __init__(self, db: Database) -> None:
        self.db = db


def check_current(s: Session, job_id: str, attempt: int, *, lock: bool) -> None:
    """Raise `StaleAttempt` unless attempt `attempt` is job `job_id`'s current, unended one;
    with `lock`, the job's row stays locked until `s` commits."""
    q = (
        select(Job.attempt, Job.status, Attempt.state)
        .outerjoin(Attempt, (Attempt.job_id == Job.id) & (Attempt.number == Job.attempt))
        .where(Job.id == job_id)
    )
    row = s.execute(q.with_for_update(of=Job) if lock else q).first()
    if row is None:
        raise StaleAttempt(job_id, attempt, "no such job")
    if row.attempt != attempt:
        raise StaleAttempt(job_id, attempt, f"attempt {row.attempt} is the current one")
    if row.status in TERMINAL:
        raise StaleAttempt(job_id, attempt, f"the job is {row.status}")
    if row.state == AttemptState.ENDED:
        raise StaleAttempt(job_id, attempt, "the reconciler has ended this attempt")


def _sqlite_connect(dbapi_conn: Any, _record: Any) -> None:
    # SQLAlchemy emits BEGIN itself (below), so pysqlite must not open transactions
    dbapi_conn.isolation_level = None
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.execute("PRAGMA busy_timeout=30000")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.close()


def _sqlite_begin(conn: Any) -> None:
    # writers take the write lock at BEGIN; a read is one statement at a time in
    # autocommit (each SELECT sees one consistent snapshot), which spares every read a
    # BEGIN and a ROLLBACK round trip
    if conn.get_execution_options().get("sqlite_immediate", False):
        conn.exec_driver_sql("BEGIN IMMEDIATE")
