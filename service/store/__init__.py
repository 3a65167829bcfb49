"""The store: the record of files, jobs, attempts, events, metrics and checkpoints.

`Store(url)` opens SQLite (WAL, a busy timeout, one in-process writer at a time so the
control plane's threads never spin in SQLite's busy handler) or PostgreSQL, and
`migrate()` brings the schema to Alembic's head. Methods open a short session each and
return detached rows; every read a client can cause filters on the tenant.

Terminal job states never change: every status write is a conditional UPDATE that
matches only non-terminal rows, so a late report from a driver cannot revive a
cancelled job, and two writers cannot both finish one.

Writes that come from an attempt (metrics, checkpoints, events, status detail, the end)
are fenced: they take the attempt's number and happen only while that attempt is the
job's current, unended one, checked in the same transaction; otherwise `StaleAttempt`
is raised and nothing is written. The end of an attempt and what follows from it (the
next attempt, or the job's failure) are one transaction (`close_attempt`).
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

from sqlalchemy import bindparam, create_engine, delete, event, func, select, update
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from service.errors import UnknownCursor
from service.store import statements
from service.store.models import (
    ACTIVE,
    TERMINAL,
    Attempt,
    Base,
    Checkpoint,
    Event,
    File,
    Job,
    JobStats,
    MetricPoint,
)

__all__ = [
    "ACTIVE",
    "TERMINAL",
    "Attempt",
    "Base",
    "Checkpoint",
    "Event",
    "File",
    "IdempotencyConflict",
    "Job",
    "JobStats",
    "MetricPoint",
    "StaleAttempt",
    "Store",
    "TooManyUnfinished",
    "new_id",
]

MIGRATIONS = Path(__file__).with_name("migrations")


class ActiveJob(NamedTuple):
    """What the reconciler reads of an unfinished job."""

    id: str
    tenant: str
    status: str
    status_detail: str | None
    attempt: int
    max_attempts: int
    training_file: str
    validation_file: str | None
    workers: int
    gpus: int


class ActiveAttempt(NamedTuple):
    job_id: str
    number: int
    state: str
    submission_id: str


class IdempotencyConflict(Exception):
    """The same Idempotency-Key came with a different request body."""

    def __init__(self, job: Job) -> None:
        super().__init__(job.id)
        self.job = job


class TooManyUnfinished(Exception):
    """The tenant already has as many unfinished jobs as it may."""

    def __init__(self, n: int) -> None:
        super().__init__(f"{n} unfinished jobs")
        self.n = n


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


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def request_hash(body: dict[str, Any]) -> str:
    import json

    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()


class Store:
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

    # -- plumbing -----------------------------------------------------------------------

    def migrate(self) -> None:
        """Bring the schema to the newest Alembic revision (idempotent)."""
        from alembic import command
        from alembic.config import Config

        cfg = Config()
        cfg.set_main_option("script_location", str(MIGRATIONS))
        with self._write_lock, self._write_bind.begin() as conn:
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "head")

    @contextlib.contextmanager
    def read(self) -> Iterator[Session]:
        with self._sessions() as s:
            yield s

    @contextlib.contextmanager
    def _reading(self) -> Iterator[Connection]:
        """A pooled connection for the prebuilt statements of `statements`."""
        with self.engine.connect() as conn:
            yield conn

    @contextlib.contextmanager
    def write(self) -> Iterator[Session]:
        with self._write_lock, self._write_sessions() as s, s.begin():
            yield s

    @contextlib.contextmanager
    def as_attempt(self, job_id: str, attempt: int) -> Iterator[Session]:
        """A write transaction of attempt `attempt` of job `job_id`: it opens only while
        that attempt is the job's current, unended one (else `StaleAttempt`), and the job's
        row stays locked until it commits (PostgreSQL; SQLite writes one at a time)."""
        with self.write() as s:
            _check_current(s, job_id, attempt, lock=True)
            yield s

    def attempt_is_current(self, job_id: str, attempt: int) -> bool:
        """Whether attempt `attempt` may still write (a read; the writes fence themselves)."""
        with self.read() as s:
            try:
                _check_current(s, job_id, attempt, lock=False)
            except StaleAttempt:
                return False
            return True

    def ping(self) -> None:
        with self.read() as s:
            s.execute(select(1))

    def close(self) -> None:
        self.engine.dispose()

    # -- files --------------------------------------------------------------------------

    def add_file(self, f: File) -> File:
        with self.write() as s:
            s.add(f)
        return f

    def get_file(self, tenant: str, file_id: str) -> statements.View | None:
        """The file's row (the attributes of `File`, read-only), or None."""
        with self._reading() as conn:
            return statements.file(conn, tenant, file_id)

    def list_files(
        self, tenant: str, after: str | None, limit: int, purpose: str | None, order: str = "desc"
    ) -> tuple[list[File], bool]:
        q = select(File).where(File.tenant == tenant)
        if purpose:
            q = q.where(File.purpose == purpose)
        desc = order == "desc"
        if after:
            cursor = self._cursor(File, after, "file", File.tenant == tenant)
            q = q.where(File.seq < cursor if desc else File.seq > cursor)
        q = q.order_by(File.seq.desc() if desc else File.seq.asc()).limit(limit + 1)
        with self.read() as s:
            rows = list(s.scalars(q))
        return rows[:limit], len(rows) > limit

    def _cursor(self, model: Any, after: str, what: str, scope: Any) -> int:
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

    def delete_file(self, tenant: str, file_id: str) -> File | None:
        with self.write() as s:
            f = s.scalar(select(File).where(File.id == file_id, File.tenant == tenant))
            if f is not None:
                s.delete(f)
            return f

    def file_in_use(self, tenant: str, file_id: str) -> str | None:
        """The id of an unfinished job that trains on this file, if any."""
        with self.read() as s:
            return s.scalar(
                select(Job.id)
                .where(Job.tenant == tenant, Job.status.in_(ACTIVE))
                .where((Job.training_file == file_id) | (Job.validation_file == file_id))
                .limit(1)
            )

    # -- jobs ---------------------------------------------------------------------------

    def create_job(
        self, job: Job, first_event: str, max_unfinished: int | None = None
    ) -> tuple[Job, bool]:
        """Insert `job` (and its first event); with an idempotency key already used by
        this tenant, return that job instead: (job, created). A different body under the
        same key raises `IdempotencyConflict`; a tenant with `max_unfinished` unfinished
        jobs already, `TooManyUnfinished` (counted in the inserting transaction, one create
        of a tenant at a time: two cannot both take the last place)."""
        if job.idempotency_key:
            existing = self.job_by_idempotency_key(job.tenant, job.idempotency_key)
            if existing is not None:
                return self._same_or_conflict(existing, job), False
        try:
            with self._write_lock, self._write_bind.begin() as conn:
                if max_unfinished is not None:
                    if not self.is_sqlite:  # creates of one tenant count one at a time
                        conn.execute(statements.TENANT_LOCK, {"tenant": job.tenant})
                    n = statements.unfinished_jobs(conn, job.tenant, max_unfinished)
                    if n >= max_unfinished:
                        raise TooManyUnfinished(n)
                statements.insert_job(conn, job, _event(job.id, first_event))
        except IntegrityError:
            existing = (
                self.job_by_idempotency_key(job.tenant, job.idempotency_key)
                if job.idempotency_key
                else None
            )
            if existing is None:
                raise
            return self._same_or_conflict(existing, job), False
        return job, True

    def job_by_idempotency_key(self, tenant: str, key: str) -> Job | None:
        with self.read() as s:
            return s.scalar(select(Job).where(Job.tenant == tenant, Job.idempotency_key == key))

    @staticmethod
    def _same_or_conflict(existing: Job, new: Job) -> Job:
        if existing.request_hash != new.request_hash:
            raise IdempotencyConflict(existing)
        return existing

    def get_job(self, job_id: str, tenant: str | None = None) -> Job | None:
        q = select(Job).where(Job.id == job_id)
        if tenant is not None:
            q = q.where(Job.tenant == tenant)
        with self.read() as s:
            return s.scalar(q)

    def job_view(self, job_id: str, tenant: str) -> statements.View | None:
        """What the API shows of a job: its row without the request (`statements.View`)."""
        with self._reading() as conn:
            return statements.job(conn, tenant, job_id)

    def list_jobs(
        self,
        tenant: str,
        after: str | None,
        limit: int,
        status: str | None = None,
        metadata: dict[str, str] | None = None,
    ) -> tuple[list[statements.View], bool]:
        """A page of the tenant's jobs, newest first, as `job_view` rows; whether more follow."""
        before = (
            self._cursor(Job, after, "fine-tuning job", Job.tenant == tenant) if after else None
        )
        with self._reading() as conn:
            if not metadata:
                rows = statements.jobs_page(conn, tenant, status, before, limit + 1)
                return rows[:limit], len(rows) > limit
            # metadata is a small JSON object: filter after the query (portable across
            # SQLite and PostgreSQL JSON operators), reading until `limit` + 1 match
            rows = []
            for job in statements.jobs_page(conn, tenant, status, before, None):
                if all((job.metadata_ or {}).get(k) == v for k, v in metadata.items()):
                    rows.append(job)
                    if len(rows) > limit:
                        break
        return rows[:limit], len(rows) > limit

    def file_bytes(self, tenant: str) -> int:
        """What the tenant's stored files take (results files included)."""
        with self.read() as s:
            return int(s.scalar(select(func.sum(File.bytes)).where(File.tenant == tenant)) or 0)

    def count_jobs_by_status(self, tenant: str | None = None) -> dict[str, int]:
        q = select(Job.status, func.count()).group_by(Job.status)
        if tenant is not None:
            q = q.where(Job.tenant == tenant)
        with self.read() as s:
            return dict(s.execute(q).all())

    def update_job(
        self, job_id: str, event: str | None = None, *, attempt: int | None = None, **values: Any
    ) -> bool:
        """Set fields of a job that is not terminal yet (a `status` among them may make it
        terminal); False when it already was. `event` is logged in the same transaction.
        With `attempt` the write is that attempt's, fenced (`StaleAttempt`)."""
        if values.get("status") in TERMINAL:
            values.setdefault("finished_at", int(time.time()))
        tx = self.write() if attempt is None else self.as_attempt(job_id, attempt)
        with tx as s:
            conn = s.connection()
            changed = statements.update_job(conn, job_id, values)
            if changed and event:
                level = "error" if values.get("status") == "failed" else "info"
                statements.insert_event(conn, _event(job_id, event, level=level))
            return changed

    def set_status_details(self, details: dict[str, str | None]) -> None:
        """Many unfinished jobs' `status_detail` in one transaction (the reconciler's
        reasons to wait)."""
        with self.write() as s:
            s.connection().execute(
                update(Job.__table__)
                # not terminal, spelled without IN (executemany takes no expanding list)
                .where(Job.id == bindparam("job_id"), *(Job.status != t for t in TERMINAL))
                .values(status_detail=bindparam("detail")),
                [{"job_id": k, "detail": v} for k, v in details.items()],
            )

    def mark_running(self, job_id: str, attempt: int) -> bool:
        """queued -> running, by the attempt that owns the job; logged once per job."""
        now = int(time.time())
        with self.write() as s:
            res = s.execute(
                update(Job)
                .where(Job.id == job_id, Job.status == "queued")
                .where(Job.attempt == attempt)
                .values(status="running", started_at=func.coalesce(Job.started_at, now))
                .execution_options(synchronize_session=False)
            )
            if res.rowcount == 1:
                s.add(_event(job_id, "Fine-tuning job started", data={"attempt": attempt}))
                return True
            return False

    def fine_tuned_models(self, tenant: str) -> list[Job]:
        with self.read() as s:
            return list(
                s.scalars(
                    select(Job)
                    .where(Job.tenant == tenant, Job.fine_tuned_model.is_not(None))
                    .order_by(Job.seq)
                )
            )

    def job_by_model(self, tenant: str, model_id: str) -> Job | None:
        with self.read() as s:
            return s.scalar(
                select(Job).where(Job.tenant == tenant, Job.fine_tuned_model == model_id)
            )

    # -- attempts -----------------------------------------------------------------------

    def start_attempt(self, job_id: str, number: int, reason: str) -> Attempt | None:
        """Record attempt `number` before it is submitted (state `submitting`); None if the
        job is terminal or the attempt exists (another reconciler got there first)."""
        att = Attempt(
            job_id=job_id,
            number=number,
            submission_id=f"{job_id}-a{number}",
            state="submitting",
            reason=reason,
            created_at=time.time(),
        )
        try:
            with self.write() as s:
                res = s.execute(
                    update(Job)
                    .where(Job.id == job_id, Job.status.not_in(TERMINAL), Job.attempt == number - 1)
                    .values(attempt=number)
                    .execution_options(synchronize_session=False)
                )
                if res.rowcount != 1:
                    return None
                s.add(att)
                s.add(_event(job_id, reason, data={"attempt": number}))
        except IntegrityError:
            return None
        return att

    def get_attempt(self, job_id: str, number: int) -> Attempt | None:
        with self.read() as s:
            return s.get(Attempt, (job_id, number))

    def attempts(self, job_id: str) -> list[Attempt]:
        with self.read() as s:
            return list(
                s.scalars(select(Attempt).where(Attempt.job_id == job_id).order_by(Attempt.number))
            )

    def active_jobs_with_attempts(
        self, waiting_per_tenant: int | None = None
    ) -> list[tuple[ActiveJob, ActiveAttempt | None]]:
        """Every unfinished job with its current attempt (None before its first), oldest
        job first. Only the columns the reconciler reads: it asks this every second, and
        decoding each job's JSON request and plan would cost more than the rest of its tick.

        Of the jobs still waiting for their first attempt, only each tenant's oldest
        `waiting_per_tenant` are read (None: all): a tenant's running limits admit only a
        few in a tick, so a queue of thousands costs the reconciler what a short one does."""
        cols = (
            *(getattr(Job, f) for f in ActiveJob._fields),
            Attempt.number,
            Attempt.state,
            Attempt.submission_id,
            Job.seq,
        )
        joined = (Attempt.job_id == Job.id) & (Attempt.number == Job.attempt)
        waiting = (Job.status == "queued") & (Job.attempt == 0)
        if waiting_per_tenant is None:
            queries = [select(*cols).outerjoin(Attempt, joined).where(Job.status.in_(ACTIVE))]
        else:
            rank = func.row_number().over(partition_by=Job.tenant, order_by=Job.seq)
            head = select(Job.seq, rank.label("rank")).where(waiting).subquery()
            queries = [
                select(*cols).outerjoin(Attempt, joined).where(Job.status.in_(ACTIVE), ~waiting),
                select(*cols)
                .outerjoin(Attempt, joined)
                .join(head, head.c.seq == Job.seq)
                .where(head.c.rank <= waiting_per_tenant),
            ]
        n = len(ActiveJob._fields)
        with self.read() as s:
            rows = [r for q in queries for r in s.execute(q).all()]
        rows.sort(key=lambda r: r.seq)
        return [
            (
                ActiveJob(*r[:n]),
                ActiveAttempt(r.id, *r[n : n + 3]) if r.number is not None else None,
            )
            for r in rows
        ]

    def open_attempts_of_finished_jobs(self) -> list[tuple[Attempt, Job]]:
        """Attempts not marked ended whose job is: what Ray may still run for nothing."""
        q = (
            select(Attempt, Job)
            .join(Job, Job.id == Attempt.job_id)
            .where(Attempt.state != "ended", Job.status.not_in(ACTIVE))
        )
        with self.read() as s:
            return [(att, job) for att, job in s.execute(q).all()]

    def open_attempts(self) -> list[Attempt]:
        with self.read() as s:
            return list(s.scalars(select(Attempt).where(Attempt.state != "ended")))

    def update_attempt(self, job_id: str, number: int, **values: Any) -> None:
        with self.write() as s:
            s.execute(
                update(Attempt)
                .where(Attempt.job_id == job_id, Attempt.number == number)
                .values(**values)
                .execution_options(synchronize_session=False)
            )

    def close_attempt(
        self,
        job_id: str,
        number: int,
        ray_status: str | None,
        *,
        next_reason: str | None = None,
        failure: dict[str, Any] | None = None,
    ) -> Attempt | None:
        """End attempt `number` and write what follows, in one transaction: with
        `next_reason` the next attempt (`submitting`, returned), with `failure` (`event`
        and `error`) the job's failure; neither, only the end. An attempt that is already
        ended (a crash of an older control plane between the two writes) is carried
        forward the same way. Nothing follows for a job that is terminal or whose current
        attempt is another one."""
        now = time.time()
        nxt = None
        with self.write() as s:
            s.execute(
                update(Attempt)
                .where(Attempt.job_id == job_id, Attempt.number == number, Attempt.state != "ended")
                .values(state="ended", ray_status=ray_status or "LOST", ended_at=now)
                .execution_options(synchronize_session=False)
            )
            current = (Job.id == job_id, Job.status.not_in(TERMINAL), Job.attempt == number)
            if next_reason is not None:
                res = s.execute(
                    update(Job)
                    .where(*current)
                    .values(attempt=number + 1, status_detail="recovering")
                    .execution_options(synchronize_session=False)
                )
                if res.rowcount == 1:
                    nxt = Attempt(
                        job_id=job_id,
                        number=number + 1,
                        submission_id=f"{job_id}-a{number + 1}",
                        state="submitting",
                        reason=next_reason,
                        created_at=now,
                    )
                    s.add(nxt)
                    s.add(_event(job_id, next_reason, data={"attempt": number + 1}))
            elif failure is not None:
                res = s.execute(
                    update(Job)
                    .where(*current)
                    .values(
                        status="failed",
                        status_detail=None,
                        finished_at=int(now),
                        error=failure["error"],
                    )
                    .execution_options(synchronize_session=False)
                )
                if res.rowcount == 1:
                    s.add(_event(job_id, failure["event"], level="error"))
        return nxt

    def finish_job(
        self,
        job_id: str,
        attempt: int,
        results: File,
        before_commit: Any,
        event: str,
        **values: Any,
    ) -> None:
        """Attempt `attempt` succeeds its job: the results file's row replaces any earlier
        one, the job becomes `succeeded` with `values`, in one fenced transaction.
        `before_commit()` (putting the results file in place) runs inside it, after the
        fence, so a refused attempt (`StaleAttempt`) touches no file."""
        with self.as_attempt(job_id, attempt) as s:
            s.execute(delete(File).where(File.id == results.id, File.tenant == results.tenant))
            before_commit()
            s.add(results)
            s.execute(
                update(Job)
                .where(Job.id == job_id)
                .values(status="succeeded", finished_at=int(time.time()), **values)
                .execution_options(synchronize_session=False)
            )
            s.add(_event(job_id, event))

    # -- events, metrics, checkpoints, stats --------------------------------------------

    def add_event(
        self,
        job_id: str,
        message: str,
        *,
        level: str = "info",
        type: str = "message",
        data: dict[str, Any] | None = None,
        attempt: int | None = None,
    ) -> None:
        tx = self.write() if attempt is None else self.as_attempt(job_id, attempt)
        with tx as s:
            s.add(_event(job_id, message, level=level, type=type, data=data))

    def list_events(
        self,
        job_id: str,
        after: int | None,
        limit: int,
        type: str | None = None,
        order: str = "desc",
    ) -> tuple[list[Event], bool]:
        """Events newest first (OpenAI's order); `after` is the seq of the last one seen,
        so the next page holds older events. `order="asc"` reads forward instead."""
        q = select(Event).where(Event.job_id == job_id)
        if type:
            q = q.where(Event.type == type)
        desc = order == "desc"
        if after is not None:
            q = q.where(Event.seq < after if desc else Event.seq > after)
        q = q.order_by(Event.seq.desc() if desc else Event.seq.asc()).limit(limit + 1)
        with self.read() as s:
            rows = list(s.scalars(q))
        return rows[:limit], len(rows) > limit

    def record_metrics(
        self, job_id: str, attempt: int, step: int, values: dict[str, Any], message: str
    ) -> None:
        """A step's numbers (replacing a row for the same step from an earlier attempt) and
        the OpenAI-style metrics event, in one transaction, fenced to `attempt`."""
        with self.as_attempt(job_id, attempt) as s:
            s.execute(
                delete(MetricPoint).where(MetricPoint.job_id == job_id, MetricPoint.step == step)
            )
            now = time.time()
            s.add(
                MetricPoint(
                    job_id=job_id, step=step, attempt=attempt, created_at=now, values=values
                )
            )
            s.add(
                _event(
                    job_id, message, type="metrics", data={"step": step, **_openai_metrics(values)}
                )
            )

    def metric_points(
        self, job_id: str, step_from: int | None = None, step_to: int | None = None
    ) -> list[MetricPoint]:
        q = select(MetricPoint).where(MetricPoint.job_id == job_id)
        if step_from is not None:
            q = q.where(MetricPoint.step >= step_from)
        if step_to is not None:
            q = q.where(MetricPoint.step <= step_to)
        with self.read() as s:
            return list(s.scalars(q.order_by(MetricPoint.step)))

    def add_checkpoint(
        self,
        job_id: str,
        step: int,
        metrics: dict[str, Any],
        path: str,
        keep: int,
        final: bool = False,
        *,
        attempt: int,
    ) -> Checkpoint:
        """Record attempt `attempt`'s checkpoint (fenced); keep the newest `keep` non-final
        ones (as Ray Train keeps them on disk) plus the final one."""
        ck = Checkpoint(
            id=new_id("ftckpt"),
            job_id=job_id,
            step=step,
            metrics=metrics,
            path=path,
            final=final,
            created_at=int(time.time()),
        )
        with self.as_attempt(job_id, attempt) as s:
            s.execute(
                delete(Checkpoint).where(Checkpoint.job_id == job_id, Checkpoint.step == step)
            )
            s.add(ck)
            s.flush()
            old = list(
                s.scalars(
                    select(Checkpoint.seq)
                    .where(Checkpoint.job_id == job_id, Checkpoint.final.is_(False))
                    .order_by(Checkpoint.step.desc())
                    .offset(keep)
                )
            )
            if old:
                s.execute(delete(Checkpoint).where(Checkpoint.seq.in_(old)))
            s.add(
                _event(
                    job_id,
                    f"{'Final checkpoint' if final else 'Checkpoint'} at step {step}",
                    data={"step": step, "checkpoint": ck.id},
                )
            )
        return ck

    def list_checkpoints(
        self, job_id: str, after: str | None, limit: int
    ) -> tuple[list[Checkpoint], bool]:
        q = select(Checkpoint).where(Checkpoint.job_id == job_id)
        if after:
            q = q.where(
                Checkpoint.seq
                < self._cursor(Checkpoint, after, "checkpoint", Checkpoint.job_id == job_id)
            )
        with self.read() as s:
            rows = list(s.scalars(q.order_by(Checkpoint.seq.desc()).limit(limit + 1)))
        return rows[:limit], len(rows) > limit

    def get_checkpoint(self, job_id: str, checkpoint_id: str) -> Checkpoint | None:
        """The checkpoint `checkpoint_id` of job `job_id` (None if the job has no such one;
        the caller has checked that the job is the tenant's)."""
        with self.read() as s:
            return s.scalar(
                select(Checkpoint).where(
                    Checkpoint.job_id == job_id, Checkpoint.id == checkpoint_id
                )
            )

    def set_stats(
        self,
        job_id: str,
        trace: dict[str, Any] | None = None,
        tiers: dict[str, Any] | None = None,
        *,
        attempt: int | None = None,
    ) -> None:
        tx = self.write() if attempt is None else self.as_attempt(job_id, attempt)
        with tx as s:
            row = s.get(JobStats, job_id)
            if row is None:
                row = JobStats(job_id=job_id, updated_at=time.time())
                s.add(row)
            row.updated_at = time.time()
            if trace is not None:
                row.trace = trace
            if tiers is not None:
                row.tiers = tiers

    def get_stats(self, job_id: str) -> JobStats | None:
        with self.read() as s:
            return s.get(JobStats, job_id)


def _check_current(s: Session, job_id: str, attempt: int, *, lock: bool) -> None:
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
    if row.state == "ended":
        raise StaleAttempt(job_id, attempt, "the reconciler has ended this attempt")


def _event(
    job_id: str,
    message: str,
    *,
    level: str = "info",
    type: str = "message",
    data: dict[str, Any] | None = None,
) -> Event:
    return Event(
        job_id=job_id, created_at=time.time(), level=level, type=type, message=message, data=data
    )


# the names OpenAI's metrics events and checkpoints use, from ours
OPENAI_METRIC_NAMES = {
    "train_loss": "train_loss",
    "train_mean_token_accuracy": "train_mean_token_accuracy",
    "valid_loss": "valid_loss",
    "valid_mean_token_accuracy": "valid_mean_token_accuracy",
    "full_valid_loss": "full_valid_loss",
    "full_valid_mean_token_accuracy": "full_valid_mean_token_accuracy",
    "tokens_per_second": "tokens_per_second",
}


def _openai_metrics(values: dict[str, Any]) -> dict[str, Any]:
    return {k: values[k] for k in OPENAI_METRIC_NAMES if values.get(k) is not None}


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
