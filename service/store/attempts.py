"""`store.attempts`: the attempts of a job, one Ray job each, and the fence on their writes.

The end of an attempt and what follows from it (the next attempt, or the job's failure)
are one transaction (`close`).
"""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError

from service.store.db import Resource, StaleAttempt, check_current
from service.store.events import new_event
from service.store.jobs import paused_values
from service.store.models import ACTIVE, PAUSED_RAY_STATUS, TERMINAL, Attempt, Job
from service.store.status import AttemptState, JobStatus


class Attempts(Resource):
    def start(self, job_id: str, number: int, reason: str) -> Attempt | None:
        """Record attempt `number` before it is submitted (state `submitting`); None if the
        job is terminal or the attempt exists (another reconciler got there first)."""
        att = Attempt(
            job_id=job_id,
            number=number,
            submission_id=f"{job_id}-a{number}",
            state=AttemptState.SUBMITTING,
            reason=reason,
            created_at=time.time(),
        )
        try:
            with self.db.write() as s:
                res = s.execute(
                    update(Job)
                    # a paused job gets no attempt until it is resumed
                    .where(Job.id == job_id, Job.status.in_(ACTIVE), Job.attempt == number - 1)
                    .values(attempt=number)
                    .execution_options(synchronize_session=False)
                )
                if res.rowcount != 1:
                    return None
                s.add(att)
                s.add(new_event(job_id, reason, data={"attempt": number}))
        except IntegrityError:
            return None
        return att

    def get(self, job_id: str, number: int) -> Attempt | None:
        with self.db.read() as s:
            return s.get(Attempt, (job_id, number))

    def of_job(self, job_id: str) -> list[Attempt]:
        """The job's attempts, first first."""
        with self.db.read() as s:
            return list(
                s.scalars(select(Attempt).where(Attempt.job_id == job_id).order_by(Attempt.number))
            )

    def is_current(self, job_id: str, attempt: int) -> bool:
        """Whether attempt `attempt` may still write (a read; the writes fence themselves)."""
        with self.db.read() as s:
            try:
                check_current(s, job_id, attempt, lock=False)
            except StaleAttempt:
                return False
            return True

    def open(self) -> list[Attempt]:
        """Every attempt not marked ended."""
        with self.db.read() as s:
            return list(s.scalars(select(Attempt).where(Attempt.state != AttemptState.ENDED)))

    def open_of_finished_jobs(self) -> list[tuple[Attempt, Job]]:
        """Attempts not marked ended whose job is: what Ray may still run for nothing."""
        q = (
            select(Attempt, Job)
            .join(Job, Job.id == Attempt.job_id)
            .where(Attempt.state != AttemptState.ENDED, Job.status.not_in(ACTIVE))
        )
        with self.db.read() as s:
            return [(att, job) for att, job in s.execute(q).all()]

    def end_paused(self, job_id: str, number: int) -> None:
        """The driver of attempt `number` ends after its workers paused the job."""
        self.update(
            job_id,
            number,
            state=AttemptState.ENDED,
            ray_status=PAUSED_RAY_STATUS,
            ended_at=time.time(),
        )

    def update(self, job_id: str, number: int, **values: Any) -> None:
        with self.db.write() as s:
            s.execute(
                update(Attempt)
                .where(Attempt.job_id == job_id, Attempt.number == number)
                .values(**values)
                .execution_options(synchronize_session=False)
            )

    def close(
        self,
        job_id: str,
        number: int,
        ray_status: str | None,
        *,
        next_reason: str | None = None,
        failure: dict[str, Any] | None = None,
        pause: str | None = None,
    ) -> Attempt | None:
        """End attempt `number` and write what follows, in one transaction: with
        `next_reason` the next attempt (`submitting`, returned), with `failure` (`event`
        and `error`) the job's failure, with `pause` (the event) the job's pause (a pause
        was asked for and the attempt ended before its workers wrote it); none of them,
        only the end. An attempt that is already ended (a crash of an older control plane
        between the two writes) is carried forward the same way. Nothing follows for a job
        that is terminal or whose current attempt is another one."""
        now = time.time()
        nxt = None
        with self.db.write() as s:
            s.execute(
                update(Attempt)
                .where(
                    Attempt.job_id == job_id,
                    Attempt.number == number,
                    Attempt.state != AttemptState.ENDED,
                )
                .values(
                    state=AttemptState.ENDED,
                    ray_status=PAUSED_RAY_STATUS if pause else (ray_status or "LOST"),
                    ended_at=now,
                )
                .execution_options(synchronize_session=False)
            )
            current = (Job.id == job_id, Job.status.not_in(TERMINAL), Job.attempt == number)
            if next_reason is not None:
                res = s.execute(
                    update(Job)
                    .where(*current, Job.status.in_(ACTIVE))
                    .values(attempt=number + 1, status_detail="recovering")
                    .execution_options(synchronize_session=False)
                )
                if res.rowcount == 1:
                    nxt = Attempt(
                        job_id=job_id,
                        number=number + 1,
                        submission_id=f"{job_id}-a{number + 1}",
                        state=AttemptState.SUBMITTING,
                        reason=next_reason,
                        created_at=now,
                    )
                    s.add(nxt)
                    s.add(new_event(job_id, next_reason, data={"attempt": number + 1}))
            elif pause is not None:
                res = s.execute(
                    update(Job)
                    .where(*current, Job.status.in_(ACTIVE))
                    .values(**paused_values())
                    .execution_options(synchronize_session=False)
                )
                if res.rowcount == 1:
                    s.add(new_event(job_id, pause))
            elif failure is not None:
                res = s.execute(
                    update(Job)
                    .where(*current)
                    .values(
                        status=JobStatus.FAILED,
                        status_detail=None,
                        finished_at=int(now),
                        error=failure["error"],
                    )
                    .execution_options(synchronize_session=False)
                )
                if res.rowcount == 1:
                    s.add(new_event(job_id, failure["event"], level="error"))
        return nxt
