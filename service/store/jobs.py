"""`store.jobs`: fine-tuning jobs, from their idempotent creation to their end.

Terminal job states never change: every status write is a conditional UPDATE that
matches only non-terminal rows, so a late report from a driver cannot revive a
cancelled job, and two writers cannot both finish one.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from sqlalchemy import bindparam, case, delete, func, select, update
from sqlalchemy.exc import IntegrityError

from service.store import statements
from service.store.db import Resource
from service.store.events import new_event
from service.store.models import (
    ACTIVE,
    PAUSED,
    PAUSED_RAY_STATUS,
    TERMINAL,
    UNFINISHED,
    Attempt,
    File,
    Job,
)
from service.store.status import AttemptState, JobStatus, sources

# a job that has had no attempt yet is paused at once (`pause`)
_BEFORE_AN_ATTEMPT = (JobStatus.VALIDATING_FILES, JobStatus.QUEUED)


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
    pause_requested: bool
    pauses: int


class ActiveAttempt(NamedTuple):
    job_id: str
    number: int
    state: str
    submission_id: str
    ray_status: str | None

    @property
    def paused(self) -> bool:
        """Ended by a pause: the job waits for its owner, then a new attempt resumes."""
        return self.state == AttemptState.ENDED and self.ray_status == PAUSED_RAY_STATUS


def paused_values() -> dict[str, Any]:
    """What a job's row becomes when it pauses (its workers wrote the pause, or its attempt
    ended while a pause was asked for): a pause spent, nothing asked any more."""
    return {
        "status": PAUSED,
        "status_detail": None,
        "pause_requested": False,
        "pauses": Job.pauses + 1,
    }


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


def request_hash(body: dict[str, Any]) -> str:
    """What tells two bodies under one Idempotency-Key apart (`Job.request_hash`)."""
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()


class Jobs(Resource):
    def create(
        self, job: Job, first_event: str, max_unfinished: int | None = None
    ) -> tuple[Job, bool]:
        """Insert `job` (and its first event); with an idempotency key already used by
        this tenant, return that job instead: (job, created). A different body under the
        same key raises `IdempotencyConflict`; a tenant with `max_unfinished` unfinished
        jobs already, `TooManyUnfinished` (counted in the inserting transaction, one create
        of a tenant at a time: two cannot both take the last place)."""
        if job.idempotency_key:
            existing = self.by_idempotency_key(job.tenant, job.idempotency_key)
            if existing is not None:
                return _same_or_conflict(existing, job), False
        try:
            with self.db.writing() as conn:
                if max_unfinished is not None:
                    if not self.db.is_sqlite:  # creates of one tenant count one at a time
                        conn.execute(statements.TENANT_LOCK, {"tenant": job.tenant})
                    n = statements.unfinished_jobs(conn, job.tenant, max_unfinished)
                    if n >= max_unfinished:
                        raise TooManyUnfinished(n)
                statements.insert_job(conn, job, new_event(job.id, first_event))
        except IntegrityError:
            existing = (
                self.by_idempotency_key(job.tenant, job.idempotency_key)
                if job.idempotency_key
                else None
            )
            if existing is None:
                raise
            return _same_or_conflict(existing, job), False
        return job, True

    def by_idempotency_key(self, tenant: str, key: str) -> Job | None:
        with self.db.read() as s:
            return s.scalar(select(Job).where(Job.tenant == tenant, Job.idempotency_key == key))

    def get(self, job_id: str, tenant: str | None = None) -> Job | None:
        q = select(Job).where(Job.id == job_id)
        if tenant is not None:
            q = q.where(Job.tenant == tenant)
        with self.db.read() as s:
            return s.scalar(q)

    def view(self, job_id: str, tenant: str) -> statements.View | None:
        """What the API shows of a job: its row without the request (`statements.View`)."""
        with self.db.reading() as conn:
            return statements.job(conn, tenant, job_id)

    def page(
        self,
        tenant: str,
        after: str | None,
        limit: int,
        status: str | None = None,
        metadata: dict[str, str] | None = None,
    ) -> tuple[list[statements.View], bool]:
        """A page of the tenant's jobs, newest first, as `view` rows; whether more follow."""
        before = (
            self.db.cursor(Job, after, "fine-tuning job", Job.tenant == tenant) if after else None
        )
        with self.db.reading() as conn:
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

    def count_by_status(self, tenant: str | None = None) -> dict[str, int]:
        q = select(Job.status, func.count()).group_by(Job.status)
        if tenant is not None:
            q = q.where(Job.tenant == tenant)
        with self.db.read() as s:
            return dict(s.execute(q).all())

    def update(
        self,
        job_id: str,
        event: str | None = None,
        *,
        attempt: int | None = None,
        only_from: JobStatus | None = None,
        **values: Any,
    ) -> bool:
        """Set fields of a job that is not terminal yet (a `status` among them may make it
        terminal); False when it already was. `event` is logged in the same transaction.
        With `attempt` the write is that attempt's, fenced (`StaleAttempt`); with
        `only_from`, it changes the job only while that is its status."""
        if values.get("status") in TERMINAL:
            values.setdefault("finished_at", int(time.time()))
        with self.db.write_as(job_id, attempt) as s:
            conn = s.connection()
            changed = statements.update_job(conn, job_id, values, only_from)
            if changed and event:
                level = "error" if values.get("status") == JobStatus.FAILED else "info"
                statements.insert_event(conn, new_event(job_id, event, level=level))
            return changed

    def set_status_details(self, details: dict[str, str | None]) -> None:
        """Many unfinished jobs' `status_detail` in one transaction (the reconciler's
        reasons to wait)."""
        with self.db.write() as s:
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
        with self.db.write() as s:
            res = s.execute(
                update(Job)
                .where(Job.id == job_id, Job.status.in_(sources(JobStatus.RUNNING)))
                .where(Job.attempt == attempt)
                .values(status=JobStatus.RUNNING, started_at=func.coalesce(Job.started_at, now))
                .execution_options(synchronize_session=False)
            )
            if res.rowcount == 1:
                s.add(new_event(job_id, "Fine-tuning job started", data={"attempt": attempt}))
                return True
            return False

    def finish(
        self,
        job_id: str,
        attempt: int,
        results: File,
        before_commit: Callable[[], Any],
        event: str,
        **values: Any,
    ) -> None:
        """Attempt `attempt` succeeds its job: the results file's row replaces any earlier
        one, the job becomes `succeeded` with `values`, in one fenced transaction.
        `before_commit()` (putting the results file in place) runs inside it, after the
        fence, so a refused attempt (`StaleAttempt`) touches no file."""
        with self.db.as_attempt(job_id, attempt) as s:
            s.execute(delete(File).where(File.id == results.id, File.tenant == results.tenant))
            before_commit()
            s.add(results)
            s.execute(
                update(Job)
                .where(Job.id == job_id)
                .values(status=JobStatus.SUCCEEDED, finished_at=int(time.time()), **values)
                .execution_options(synchronize_session=False)
            )
            s.add(new_event(job_id, event))

    # -- pause and resume ---------------------------------------------------------------

    def pause(self, job_id: str, tenant: str) -> str | None:
        """Ask to pause a job: one still waiting for its first attempt is paused at once
        ("paused"); one with an attempt is asked to ("requested": its workers write a
        checkpoint at the next step boundary and pause, see `paused`); None when its status
        allows neither."""
        mine = (Job.id == job_id, Job.tenant == tenant)
        with self.db.write() as s:
            res = s.execute(
                update(Job)
                .where(*mine, Job.status.in_(_BEFORE_AN_ATTEMPT), Job.attempt == 0)
                .values(status=PAUSED, status_detail=None)
                .execution_options(synchronize_session=False)
            )
            if res.rowcount == 1:
                s.add(new_event(job_id, "Job paused before it started; resume queues it again"))
                return "paused"
            res = s.execute(
                update(Job)
                .where(*mine, Job.status.in_((JobStatus.QUEUED, JobStatus.RUNNING)))
                .values(pause_requested=True, status_detail="pausing at the next step boundary")
                .execution_options(synchronize_session=False)
            )
            if res.rowcount == 1:
                s.add(
                    new_event(
                        job_id,
                        "Pause requested: the job writes a checkpoint at the next step boundary, "
                        "frees its workers and pauses",
                    )
                )
                return "requested"
        return None

    def pause_requested(self, job_id: str) -> bool:
        with self.db.read() as s:
            return bool(s.scalar(select(Job.pause_requested).where(Job.id == job_id)))

    def paused(self, job_id: str, attempt: int, step: int) -> bool:
        """Attempt `attempt` wrote its pause's checkpoint at `step`: the job is paused (the
        attempt ends when its driver does). Fenced to the attempt."""
        with self.db.as_attempt(job_id, attempt) as s:
            res = s.execute(
                update(Job)
                .where(Job.id == job_id, Job.status.in_(ACTIVE))
                .values(**paused_values())
                .execution_options(synchronize_session=False)
            )
            if res.rowcount != 1:
                return False
            s.add(
                new_event(
                    job_id,
                    f"Job paused at step {step} with a checkpoint; resume continues from it",
                    data={"step": step, "attempt": attempt},
                )
            )
            return True

    def resume(self, job_id: str, tenant: str) -> bool:
        """A paused job goes back to the queue; its next attempt starts from the pause's
        checkpoint (the reconciler). One paused before its first attempt has its files
        checked again first. False if it was not paused."""
        back = case(
            (Job.attempt == 0, JobStatus.VALIDATING_FILES.value), else_=JobStatus.QUEUED.value
        )
        with self.db.write() as s:
            res = s.execute(
                update(Job)
                .where(Job.id == job_id, Job.tenant == tenant, Job.status == PAUSED)
                .values(status=back, pause_requested=False, status_detail=None)
                .execution_options(synchronize_session=False)
            )
            if res.rowcount != 1:
                return False
            s.add(new_event(job_id, "Job resumed: queued, to continue from its last checkpoint"))
            return True

    def fine_tuned_models(self, tenant: str) -> list[Job]:
        with self.db.read() as s:
            return list(
                s.scalars(
                    select(Job)
                    .where(
                        Job.tenant == tenant,
                        Job.fine_tuned_model.is_not(None),
                        Job.model_deleted_at.is_(None),
                    )
                    .order_by(Job.seq)
                )
            )

    def by_model(self, tenant: str, model_id: str) -> Job | None:
        """The job whose fine-tuned model is `model_id` (None once the model is deleted)."""
        with self.db.read() as s:
            return s.scalar(
                select(Job).where(
                    Job.tenant == tenant,
                    Job.fine_tuned_model == model_id,
                    Job.model_deleted_at.is_(None),
                )
            )

    def delete_model(self, job_id: str, now: int) -> bool:
        """Mark the job's fine-tuned model deleted; False if it already was."""
        with self.db.write() as s:
            res = s.execute(
                update(Job)
                .where(Job.id == job_id, Job.model_deleted_at.is_(None))
                .values(model_deleted_at=now)
            )
            return res.rowcount == 1

    def models_in_use(self) -> set[str]:
        """The models unfinished jobs fine-tune (their files must stay until they end)."""
        with self.db.read() as s:
            return set(s.scalars(select(Job.model).where(Job.status.in_(UNFINISHED))))

    def deleted_models(self) -> list[Job]:
        """Every job whose model was deleted (the sweep removes their files)."""
        with self.db.read() as s:
            return list(s.scalars(select(Job).where(Job.model_deleted_at.is_not(None))))

    # -- storage (service.control.storage) ----------------------------------------------

    def set_storage(self, job_id: str, nbytes: int, reclaimed_at: int | None = None) -> None:
        """What an ended job keeps on the shared volume, as just measured (and, when
        retention reclaimed its run directory, when)."""
        values: dict[str, Any] = {"storage_bytes": nbytes}
        if reclaimed_at is not None:
            values["run_reclaimed_at"] = reclaimed_at
        with self.db.write() as s:
            s.execute(
                update(Job).where(Job.id == job_id, Job.status.in_(TERMINAL)).values(**values)
            )

    def storage_bytes(self, tenant: str) -> int:
        """What the tenant's ended jobs keep, as last measured."""
        with self.db.read() as s:
            total = s.scalar(
                select(func.coalesce(func.sum(Job.storage_bytes), 0)).where(Job.tenant == tenant)
            )
            return int(total or 0)

    def ended_unmeasured(self, limit: int) -> list[str]:
        """Ended jobs whose storage was not measured yet (a driver that died before it
        could, or jobs from before the measure), oldest first."""
        with self.db.read() as s:
            return list(
                s.scalars(
                    select(Job.id)
                    .where(Job.status.in_(TERMINAL), Job.storage_bytes.is_(None))
                    .order_by(Job.seq)
                    .limit(limit)
                )
            )

    def to_reclaim(self, ended_before: int, limit: int) -> list[str]:
        """Ended jobs whose run directory retention should reclaim now."""
        with self.db.read() as s:
            return list(
                s.scalars(
                    select(Job.id)
                    .where(
                        Job.status.in_(TERMINAL),
                        Job.finished_at < ended_before,
                        Job.run_reclaimed_at.is_(None),
                    )
                    .order_by(Job.seq)
                    .limit(limit)
                )
            )

    def ended_reading(self, tenant: str, file_id: str) -> list[str]:
        """The tenant's ended jobs that trained or evaluated on the file."""
        with self.db.read() as s:
            return list(
                s.scalars(
                    select(Job.id).where(
                        Job.tenant == tenant,
                        Job.status.in_(TERMINAL),
                        (Job.training_file == file_id) | (Job.validation_file == file_id),
                    )
                )
            )

    def active_with_attempts(
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
            Attempt.ray_status,
            Job.seq,
        )
        joined = (Attempt.job_id == Job.id) & (Attempt.number == Job.attempt)
        waiting = (Job.status == JobStatus.QUEUED) & (Job.attempt == 0)
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
        with self.db.read() as s:
            rows = [r for q in queries for r in s.execute(q).all()]
        rows.sort(key=lambda r: r.seq)
        return [
            (
                ActiveJob(*r[:n]),
                ActiveAttempt(r.id, *r[n : n + 4]) if r.number is not None else None,
            )
            for r in rows
        ]


def _same_or_conflict(existing: Job, new: Job) -> Job:
    if existing.request_hash != new.request_hash:
        raise IdempotencyConflict(existing)
    return existing
