"""`store.checkpoints`: the checkpoints a job's attempts record, the newest few kept."""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import delete, select

from service.store.db import Resource
from service.store.events import new_event
from service.store.models import Checkpoint, new_id


class Checkpoints(Resource):
    def add(
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
        with self.db.as_attempt(job_id, attempt) as s:
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
                new_event(
                    job_id,
                    f"{'Final checkpoint' if final else 'Checkpoint'} at step {step}",
                    data={"step": step, "checkpoint": ck.id},
                )
            )
        return ck

    def page(self, job_id: str, after: str | None, limit: int) -> tuple[list[Checkpoint], bool]:
        q = select(Checkpoint).where(Checkpoint.job_id == job_id)
        if after:
            q = q.where(
                Checkpoint.seq
                < self.db.cursor(Checkpoint, after, "checkpoint", Checkpoint.job_id == job_id)
            )
        with self.db.read() as s:
            rows = list(s.scalars(q.order_by(Checkpoint.seq.desc()).limit(limit + 1)))
        return rows[:limit], len(rows) > limit

    def get(self, job_id: str, checkpoint_id: str) -> Checkpoint | None:
        """The checkpoint `checkpoint_id` of job `job_id` (None if the job has no such one;
        the caller has checked that the job is the tenant's)."""
        with self.db.read() as s:
            return s.scalar(
                select(Checkpoint).where(
                    Checkpoint.job_id == job_id, Checkpoint.id == checkpoint_id
                )
            )
