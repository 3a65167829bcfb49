"""A job's status and an attempt's state: the values, and which changes are legal.

As `pstar_core/chunk.py` does for tensors, one table says which status a job may move to
from which (`JOB_TRANSITIONS`). Every store write of a status holds a job to it: it is a
conditional update whose `WHERE` names the statuses the change may come from (`sources`;
the generic `jobs.update` as well as `mark_running` and `pause`; `finish` is fenced to
the current attempt instead), so a change the table forbids changes no row, whatever
another process did to the job in between.
The values are `StrEnum`s: they are the strings the API and the database carry.

    validating_files -> queued -> running -> succeeded   (queued -> succeeded too)
    validating_files | queued | running -> paused -> validating_files | queued
    every status that is not terminal -> failed | cancelled

A job keeps `running` across its attempts (a lost worker's job gets attempt n+1 while
`running`, "recovering" in `status_detail`); a paused job goes back to `validating_files`
when it never had an attempt (its files are checked again), else to `queued`.
"""

from __future__ import annotations

from enum import StrEnum


class JobStatus(StrEnum):
    VALIDATING_FILES = "validating_files"
    QUEUED = "queued"
    RUNNING = "running"
    PAUSED = "paused"  # waits for its owner to resume (or cancel) it
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


# the first three move on by themselves; a paused job waits for its owner; the terminal
# ones never change
ACTIVE = (JobStatus.VALIDATING_FILES, JobStatus.QUEUED, JobStatus.RUNNING)
UNFINISHED = (*ACTIVE, JobStatus.PAUSED)  # holds its files, counts toward the quota
TERMINAL = (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED)

_ENDS = {JobStatus.FAILED, JobStatus.CANCELLED}  # from any status that is not terminal
JOB_TRANSITIONS: dict[JobStatus, frozenset[JobStatus]] = {
    JobStatus.VALIDATING_FILES: frozenset({JobStatus.QUEUED, JobStatus.PAUSED, *_ENDS}),
    # succeeded from queued: an attempt whose "running" mark was not written (the store
    # was down then: its workers train on, see `reporting`) still finishes its job
    JobStatus.QUEUED: frozenset({JobStatus.RUNNING, JobStatus.SUCCEEDED, JobStatus.PAUSED, *_ENDS}),
    JobStatus.RUNNING: frozenset({JobStatus.SUCCEEDED, JobStatus.PAUSED, *_ENDS}),
    JobStatus.PAUSED: frozenset({JobStatus.VALIDATING_FILES, JobStatus.QUEUED, *_ENDS}),
    JobStatus.SUCCEEDED: frozenset(),
    JobStatus.FAILED: frozenset(),
    JobStatus.CANCELLED: frozenset(),
}


class IllegalTransition(ValueError):
    """A job was asked to move between two statuses the table forbids."""


def sources(new: JobStatus | str) -> tuple[JobStatus, ...]:
    """The statuses a job may move to `new` from (what a store write names in its
    `WHERE`)."""
    target = JobStatus(new)
    return tuple(s for s in JobStatus if target in JOB_TRANSITIONS[s])


def check(old: JobStatus | str, new: JobStatus | str) -> None:
    """Raise `IllegalTransition` unless a job may move from `old` to `new`."""
    if JobStatus(new) not in JOB_TRANSITIONS[JobStatus(old)]:
        raise IllegalTransition(f"job status {old} -> {new} is not a legal change")


class AttemptState(StrEnum):
    """Where one attempt (one Ray job) stands, as the reconciler tracks it."""

    SUBMITTING = "submitting"  # recorded; its Ray job may not exist yet
    SUBMITTED = "submitted"  # Ray accepted it
    ENDED = "ended"  # its Ray job is over (its `ray_status` says how)


__all__ = [
    "ACTIVE",
    "JOB_TRANSITIONS",
    "TERMINAL",
    "UNFINISHED",
    "AttemptState",
    "IllegalTransition",
    "JobStatus",
    "check",
    "sources",
]
