"""service/driver: how an attempt's end is written to the store."""

from __future__ import annotations

import pytest
from sqlalchemy import update

from service.driver import fail, finish_success, results_file_id
from service.store import Job, StaleAttempt
from tests.service.test_store import running_job


@pytest.fixture
def world(local_service):
    return local_service


def _results(settings, store, tenant="acme"):
    files = store.list_files(tenant, None, 100, "fine-tune-results")[0]
    on_disk = sorted(p.name for p in settings.files_dir.iterdir())
    return [f.id for f in files], on_disk


def test_success_writes_one_metrics_csv_even_when_an_attempt_finishes_twice(world):
    settings, store = world
    job = running_job(store, status="running")
    store.record_metrics(job.id, 1, 1, {"train_loss": 2.5, "step": 1}, "Step 1")
    # a driver that died after writing its results: the next attempt finishes again
    finish_success(settings, store, job, 1)
    with store.write() as s:  # as if the first end had not been recorded
        s.execute(update(Job).where(Job.id == job.id).values(status="running"))
    finish_success(settings, store, store.get_job(job.id), 1)
    done = store.get_job(job.id)
    assert done.status == "succeeded"
    fid = results_file_id(job.id)
    assert done.result_files == [fid]
    assert _results(settings, store) == ([fid], [fid])
    assert (settings.files_dir / fid).read_text().splitlines()[1].startswith("1,2.5,")


def test_a_job_cancelled_before_its_driver_finished_keeps_no_results_file(world):
    settings, store = world
    job = running_job(store, status="running")
    store.update_job(job.id, status="cancelled")
    with pytest.raises(StaleAttempt, match="cancelled"):
        finish_success(settings, store, job, 1)
    assert store.get_job(job.id).status == "cancelled"
    assert _results(settings, store) == ([], [])


def test_a_replaced_attempt_can_neither_succeed_nor_fail_the_job(world):
    settings, store = world
    job = running_job(store, status="running")
    store.close_attempt(job.id, 1, "FAILED", next_reason="Attempt 2 resumes")
    with pytest.raises(StaleAttempt):
        finish_success(settings, store, job, 1)
    with pytest.raises(StaleAttempt):
        fail(store, job.id, 1, "training_failed", "zombie")
    now = store.get_job(job.id)
    assert (now.status, now.attempt, now.error, now.result_files) == ("running", 2, None, [])
    assert _results(settings, store) == ([], [])
    finish_success(settings, store, now, 2)
    assert store.get_job(job.id).status == "succeeded"
