"""`store.events`: what a job tells its owner while it runs: events (OpenAI's job events),
metric points per step, and the engine's stats (the tracer's trace, memory per tier)."""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import delete, func, select

from service.store.db import Resource
from service.store.models import Event, JobStats, MetricPoint

# the names OpenAI's metrics events and checkpoints use, from ours
OPENAI_METRIC_NAMES = {
    "train_loss": "train_loss",
    "train_mean_token_accuracy": "train_mean_token_accuracy",
    "valid_loss": "valid_loss",
    "valid_mean_token_accuracy": "valid_mean_token_accuracy",
    "full_valid_loss": "full_valid_loss",
    "full_valid_mean_token_accuracy": "full_valid_mean_token_accuracy",
    "tokens_per_second": "tokens_per_second",
    # DPO's (service.methods.dpo_objective), for training and the validation pairs
    **{
        f"{prefix}{name}": f"{prefix}{name}"
        for prefix in ("", "valid_", "full_valid_")
        for name in ("reward_margin", "chosen_reward", "rejected_reward", "reward_accuracy")
    },
    "valid_logp_margin": "valid_logp_margin",
    "full_valid_logp_margin": "full_valid_logp_margin",
    # when the job is expected to end, renewed with every step (service.worker.eta)
    "estimated_finish": "estimated_finish",
}


LEVELS = ("info", "warn", "error")  # OpenAI's event levels


def new_event(
    job_id: str,
    message: str,
    *,
    level: str = "info",
    type: str = "message",
    data: dict[str, Any] | None = None,
) -> Event:
    """An event row of job `job_id`, stamped now (the other resources log through it);
    `level` one of OpenAI's (`LEVELS`: the API returns no other)."""
    if level not in LEVELS:
        raise ValueError(f"an event's level is one of {LEVELS}, got {level!r}")
    return Event(
        job_id=job_id, created_at=time.time(), level=level, type=type, message=message, data=data
    )


def _openai_metrics(values: dict[str, Any]) -> dict[str, Any]:
    return {k: values[k] for k in OPENAI_METRIC_NAMES if values.get(k) is not None}


class Events(Resource):
    def add(
        self,
        job_id: str,
        message: str,
        *,
        level: str = "info",
        type: str = "message",
        data: dict[str, Any] | None = None,
        attempt: int | None = None,
    ) -> None:
        with self.db.write_as(job_id, attempt) as s:
            s.add(new_event(job_id, message, level=level, type=type, data=data))

    def page(
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
        with self.db.read() as s:
            rows = list(s.scalars(q))
        return rows[:limit], len(rows) > limit

    def record_metrics(
        self, job_id: str, attempt: int, step: int, values: dict[str, Any], message: str
    ) -> None:
        """A step's numbers (replacing a row for the same step from an earlier attempt) and
        the OpenAI-style metrics event, in one transaction, fenced to `attempt`."""
        with self.db.as_attempt(job_id, attempt) as s:
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
                new_event(
                    job_id, message, type="metrics", data={"step": step, **_openai_metrics(values)}
                )
            )

    def metric_points(
        self,
        job_id: str,
        step_from: int | None = None,
        step_to: int | None = None,
        max_points: int | None = None,
    ) -> list[MetricPoint]:
        """The job's points in the step range, in step order. With `max_points`, a range
        holding more comes back thinned in the database: every k-th step (k the least that
        leaves at most `max_points`), and the range's last point always."""
        where = [MetricPoint.job_id == job_id]
        if step_from is not None:
            where.append(MetricPoint.step >= step_from)
        if step_to is not None:
            where.append(MetricPoint.step <= step_to)
        with self.db.read() as s:
            q = select(MetricPoint).where(*where)
            if max_points is not None:
                n, last = s.execute(
                    select(func.count(), func.max(MetricPoint.step)).where(*where)
                ).one()
                if n > max_points:
                    k = -(-n // max(1, max_points - 1))  # one place left for the last point
                    q = q.where((MetricPoint.step % k == 0) | (MetricPoint.step == last))
            return list(s.scalars(q.order_by(MetricPoint.step)))

    def set_stats(
        self,
        job_id: str,
        trace: dict[str, Any] | None = None,
        tiers: dict[str, Any] | None = None,
        *,
        attempt: int | None = None,
    ) -> None:
        with self.db.write_as(job_id, attempt) as s:
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
        with self.db.read() as s:
            return s.get(JobStats, job_id)
