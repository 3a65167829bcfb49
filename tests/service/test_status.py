"""Job statuses: one table of legal changes, which the store's writes obey."""

from __future__ import annotations

import typing

import pytest

from api.routes.jobs import JobStatus as FilterStatus
from api.schemas import FineTuningJob
from service.store.status import (
    ACTIVE,
    JOB_TRANSITIONS,
    TERMINAL,
    UNFINISHED,
    IllegalTransition,
    JobStatus,
    check,
    sources,
)
from tests.service.test_store import add_job


def test_the_table_ends_every_unfinished_job_and_nothing_leaves_an_ended_one():
    for status in UNFINISHED:
        assert {JobStatus.FAILED, JobStatus.CANCELLED} <= JOB_TRANSITIONS[status]
    for status in TERMINAL:
        assert JOB_TRANSITIONS[status] == frozenset()
        with pytest.raises(IllegalTransition, match=f"{status} -> queued"):
            check(status, JobStatus.QUEUED)
    assert set(ACTIVE) | {JobStatus.PAUSED} | set(TERMINAL) == set(JobStatus)
    # sources is the table read the other way
    for new in JobStatus:
        assert set(sources(new)) == {old for old, to in JOB_TRANSITIONS.items() if new in to}
    assert sources(JobStatus.RUNNING) == (JobStatus.QUEUED,)
    check(JobStatus.PAUSED, JobStatus.QUEUED)  # a resume
    with pytest.raises(IllegalTransition):
        check(JobStatus.RUNNING, JobStatus.QUEUED)  # a job keeps running across attempts


def test_the_api_documents_exactly_the_statuses_there_are():
    documented = typing.get_args(FineTuningJob.model_fields["status"].annotation)
    assert list(documented) == [s.value for s in JobStatus]
    assert list(typing.get_args(FilterStatus)) == [s.value for s in JobStatus]


def test_the_store_marks_a_job_running_only_from_where_the_table_allows(local_service):
    _, store = local_service
    for now in JobStatus:
        job = add_job(store, status=now)
        assert store.jobs.mark_running(job.id, 0) is (JobStatus.RUNNING in JOB_TRANSITIONS[now])
        after = store.jobs.get(job.id).status
        assert after == (JobStatus.RUNNING if now in sources(JobStatus.RUNNING) else now)
