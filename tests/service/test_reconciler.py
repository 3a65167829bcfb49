"""service/reconciler: the store brought in line with what Ray says, one tick at a time,
with a launcher whose Ray job states the test sets (the Ray tests run the real thing)."""

from __future__ import annotations

import pytest

from service.errors import Unavailable
from service.launcher import DryLauncher
from service.reconciler import Reconciler
from tests.service.test_store import add_job, events_of


class ScriptedLauncher(DryLauncher):
    """Ray as the test says: a state per submission id, submissions counted."""

    def __init__(self) -> None:
        super().__init__()
        self.state: dict[str, str | None] = {}
        self.submits: list[str] = []
        self.down = False

    def ping(self) -> None:
        if self.down:
            raise Unavailable("Ray is down (test)")

    def submit(self, submission_id, job_id, attempt, env) -> None:
        super().submit(submission_id, job_id, attempt, env)
        self.submits.append(submission_id)
        self.state[submission_id] = "PENDING"

    def status(self, submission_id: str) -> str | None:
        return self.state.get(submission_id)

    def statuses(self) -> dict[str, str]:
        return {k: v for k, v in self.state.items() if v}


@pytest.fixture
def world(local_service):
    settings, store = local_service
    launcher = ScriptedLauncher()
    return Reconciler(settings, store, launcher), store, launcher


def test_a_queued_job_gets_attempt_1_submitted_once_across_ticks(world):
    rec, store, ray = world
    job = add_job(store)
    for _ in range(3):
        rec.tick()
    assert ray.submits == [f"{job.id}-a1"]
    assert store.get_job(job.id).attempt == 1
    assert store.get_attempt(job.id, 1).state == "submitted"


def test_an_attempt_ray_lost_becomes_the_next_attempt_until_none_are_left(world):
    rec, store, ray = world
    job = add_job(store)  # max_attempts 3
    rec.tick()
    for n in (1, 2):
        ray.state[f"{job.id}-a{n}"] = "FAILED"  # the driver died without reporting
        rec.tick()
        assert ray.submits[-1] == f"{job.id}-a{n + 1}"
        assert store.get_attempt(job.id, n).state == "ended"
        assert store.get_job(job.id).status_detail == "recovering"
    ray.state.pop(f"{job.id}-a3")  # the head restarted: Ray no longer knows attempt 3
    rec.tick()
    done = store.get_job(job.id)
    assert done.status == "failed"
    assert done.error["code"] == "attempts_exhausted"
    assert ray.submits == [f"{job.id}-a{n}" for n in (1, 2, 3)]
    msgs = [e.message for e in events_of(store, job.id)]
    assert any("no attempts left" in m and "no longer knows" in m for m in msgs)
    assert store.get_attempt(job.id, 3).ray_status == "LOST"
    rec.tick()  # a failed job stays failed and gets nothing more
    assert len(ray.submits) == 3
    assert store.get_job(job.id).status == "failed"


def test_an_attempt_left_submitting_by_a_crash_is_looked_up_before_it_is_submitted(world):
    rec, store, ray = world
    # a control plane died between recording attempt 1 and hearing back from Ray: Ray
    # has the job, so it must not be submitted again
    found = add_job(store)
    store.start_attempt(found.id, 1, "Attempt 1 submitted to Ray")
    ray.state[f"{found.id}-a1"] = "RUNNING"
    # ... and one died before Ray got it: that one is submitted now
    missing = add_job(store)
    store.start_attempt(missing.id, 1, "Attempt 1 submitted to Ray")
    rec.tick()
    assert ray.submits == [f"{missing.id}-a1"]
    assert store.get_attempt(found.id, 1).state == "submitted"
    assert store.get_attempt(missing.id, 1).state == "submitted"


def test_a_job_that_finished_while_its_attempt_ran_gets_no_new_attempt(world):
    rec, store, ray = world
    job = add_job(store)
    rec.tick()
    store.update_job(job.id, status="succeeded")  # the driver reported the end
    ray.state[f"{job.id}-a1"] = "SUCCEEDED"
    rec.tick()
    assert ray.submits == [f"{job.id}-a1"]
    assert store.get_attempt(job.id, 1).state == "ended"
    assert store.get_job(job.id).status == "succeeded"


def test_a_cancelled_job_whose_ray_job_still_runs_is_stopped(world):
    rec, store, ray = world
    job = add_job(store)
    rec.tick()
    ray.state[f"{job.id}-a1"] = "RUNNING"
    store.update_job(job.id, status="cancelled")  # the stop did not reach Ray
    rec.tick()
    assert ray.stopped == [f"{job.id}-a1"]


def test_while_ray_is_down_nothing_is_submitted_and_the_supervisor_is_called(world):
    rec, store, ray = world
    calls = []
    rec.on_ray_down = lambda: calls.append(1)
    job = add_job(store)
    ray.down = True
    rec.tick()
    rec.tick()
    assert (ray.submits, len(calls), rec.ray_ok) == ([], 2, False)
    ray.down = False
    rec.tick()
    assert ray.submits == [f"{job.id}-a1"]
    assert rec.ray_ok
