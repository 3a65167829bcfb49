"""service/control/driver: how an attempt's end is written to the store."""

from __future__ import annotations

import pytest
from sqlalchemy import update

from service.control.driver import fail, finish_success, results_file_id
from service.store import Job, StaleAttempt
from tests.service.runs import run_plan
from tests.service.test_store import running_job


@pytest.fixture
def world(local_service):
    return local_service


def _results(settings, store, tenant="acme"):
    files = store.files.page(tenant, None, 100, "fine-tune-results")[0]
    on_disk = sorted(p.name for p in settings.files_dir.iterdir())
    return [f.id for f in files], on_disk


def test_success_writes_one_metrics_csv_even_when_an_attempt_finishes_twice(world):
    settings, store = world
    job = running_job(store, status="running")
    store.events.record_metrics(job.id, 1, 1, {"train_loss": 2.5, "step": 1}, "Step 1")
    # a driver that died after writing its results: the next attempt finishes again
    finish_success(settings, store, job, 1)
    with store.db.write() as s:  # as if the first end had not been recorded
        s.execute(update(Job).where(Job.id == job.id).values(status="running"))
    finish_success(settings, store, store.jobs.get(job.id), 1)
    done = store.jobs.get(job.id)
    assert done.status == "succeeded"
    fid = results_file_id(job.id)
    assert done.result_files == [fid]
    assert _results(settings, store) == ([fid], [fid])
    assert (settings.files_dir / fid).read_text().splitlines()[1].startswith("1,2.5,")


def test_a_job_cancelled_before_its_driver_finished_keeps_no_results_file(world):
    settings, store = world
    job = running_job(store, status="running")
    store.jobs.update(job.id, status="cancelled")
    with pytest.raises(StaleAttempt, match="cancelled"):
        finish_success(settings, store, job, 1)
    assert store.jobs.get(job.id).status == "cancelled"
    assert _results(settings, store) == ([], [])


def test_a_replaced_attempt_can_neither_succeed_nor_fail_the_job(world):
    settings, store = world
    job = running_job(store, status="running")
    store.attempts.close(job.id, 1, "FAILED", next_reason="Attempt 2 resumes")
    with pytest.raises(StaleAttempt):
        finish_success(settings, store, job, 1)
    with pytest.raises(StaleAttempt):
        fail(store, job.id, 1, "training_failed", "zombie")
    now = store.jobs.get(job.id)
    assert (now.status, now.attempt, now.error, now.result_files) == ("running", 2, None, [])
    assert _results(settings, store) == ([], [])
    finish_success(settings, store, now, 2)
    assert store.jobs.get(job.id).status == "succeeded"


class _Outage:
    """The store, down while `down` is set: every call raises as a lost connection does."""

    def __init__(self, store) -> None:
        self.store, self.down, self.refused = store, False, 0

    def __getattr__(self, name):
        return _Down(self, getattr(self.store, name))


class _Down:
    """One of the store's resources (`store.jobs`, ...) behind `_Outage`'s switch."""

    def __init__(self, outage: _Outage, resource) -> None:
        self.outage, self.resource = outage, resource

    def __getattr__(self, name):
        real = getattr(self.resource, name)

        def call(*args, **kwargs):
            if self.outage.down:
                from sqlalchemy.exc import OperationalError

                self.outage.refused += 1
                raise OperationalError("SELECT 1", {}, Exception("connection refused"))
            return real(*args, **kwargs)

        return call


def _reporter(store, job_id: str):
    from service.worker.reporting import Reporter

    config = {
        "job_id": job_id,
        "attempt": 1,
        "run": run_plan(storage_path="/x"),
    }
    return Reporter(config, 0, store)


def test_a_worker_keeps_its_writes_through_a_store_outage_and_writes_them_in_order(world):
    _, store = world
    job = running_job(store, status="running")
    down = _Outage(store)
    rep = _reporter(down, job.id)
    rep.metrics(1, {"train_loss": 3.0}, total=6)
    down.down = True
    for step in (2, 3, 4):  # the store is down: training goes on, nothing is lost
        rep.metrics(step, {"train_loss": 3.0 - step / 10}, total=6)
    rep.checkpoint(4, {"train_loss": 2.6}, False, "checkpoint_000001")
    assert down.refused > 0
    assert [p.step for p in store.events.metric_points(job.id)] == [1]
    down.down = False
    rep.metrics(5, {"train_loss": 2.5}, total=6)  # the first write after it: all go in
    points = store.events.metric_points(job.id)
    assert [p.step for p in points] == [1, 2, 3, 4, 5]
    assert points[2].values["train_loss"] == pytest.approx(2.7)
    assert [c.step for c in store.checkpoints.page(job.id, None, 10)[0]] == [4]
    assert store.jobs.get(job.id).progress_step == 5  # the newest progress, written last
    assert rep.flush(timeout_s=0)


def test_a_long_run_records_every_kth_step_each_evaluation_and_each_checkpoint(world, monkeypatch):
    from service.worker import reporting

    monkeypatch.setattr(reporting, "MAX_RECORDED_STEPS", 10)
    _, store = world
    job = running_job(store, status="running")
    rep = _reporter(store, job.id)
    total = 40  # 4x the cap: every 4th step
    for step in range(1, total + 1):
        values = {"train_loss": 5.0 - step / 10}
        if step == 6:
            values["valid_loss"] = 4.5  # an evaluation is always kept
        rep.metrics(step, values, total=total)
        if step == 9:  # a checkpoint on a step left out: its numbers go in after all
            rep.checkpoint(9, values, False, "checkpoint_000001")
    steps = [p.step for p in store.events.metric_points(job.id)]
    assert steps == [4, 6, 8, 9, 12, 16, 20, 24, 28, 32, 36, 40]
    events = store.events.page(job.id, None, 100, type="metrics")[0]
    assert sorted(e.data["step"] for e in events) == steps
    assert store.jobs.get(job.id).progress_step == 40
    # a resumed attempt reads the checkpoint step's numbers
    assert rep.values_at(9)["train_loss"] == pytest.approx(4.1)
    # a run within the cap records every step
    assert all(reporting.recorded(s, 10, {}) for s in range(1, 11))


def test_a_worker_stops_when_a_kept_write_turns_out_stale(world):
    _, store = world
    job = running_job(store, status="running")
    down = _Outage(store)
    rep = _reporter(down, job.id)
    down.down = True
    rep.metrics(1, {"train_loss": 3.0})
    store.attempts.close(job.id, 1, "FAILED", next_reason="Attempt 2 resumes")
    down.down = False
    with pytest.raises(StaleAttempt):
        rep.metrics(2, {"train_loss": 2.9})
    assert store.events.metric_points(job.id) == []


def test_a_driver_waits_out_a_store_outage_to_record_its_success(world, monkeypatch):
    from service.control import driver

    settings, store = world
    job = running_job(store, status="running")
    down = _Outage(store)
    down.down = True
    sleeps = []

    def sleep(s):  # the outage ends while the driver waits its third time
        sleeps.append(s)
        down.down = len(sleeps) < 3

    monkeypatch.setattr(driver.time, "sleep", sleep)
    driver.through_outage(finish_success, settings, down, job, 1)
    assert sleeps == [1.0, 2.0, 4.0]
    assert store.jobs.get(job.id).status == "succeeded"
    # past its patience the error is the driver's to report
    down.down = True
    monkeypatch.setattr(driver.time, "sleep", lambda s: None)
    from sqlalchemy.exc import OperationalError

    with pytest.raises(OperationalError):
        driver.through_outage(down.jobs.get, job.id, within_s=0.0)
