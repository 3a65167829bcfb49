"""service/control/reconciler: the store brought in line with what Ray says, one tick at a time,
with a launcher whose Ray job states the test sets (the Ray tests run the real thing)."""

from __future__ import annotations

import threading
import time

import pytest
from sqlalchemy import update

from service.control import logs, reconciler
from service.control.launcher import DryLauncher, SubmissionRefused
from service.control.reconciler import Reconciler
from service.errors import Unavailable
from service.store import Job
from tests.service.test_store import add_job, events_of, make_file


class ScriptedLauncher(DryLauncher):
    """Ray as the test says: a state per submission id, submissions counted."""

    def __init__(self) -> None:
        super().__init__()
        self.state: dict[str, str | None] = {}
        self.submits: list[str] = []
        self.asked: list[set[str]] = []  # what each tick asked Ray about
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

    def statuses(self, submission_ids) -> dict[str, str]:
        self.asked.append(set(submission_ids))
        return {k: v for k, v in self.state.items() if v and k in submission_ids}


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
    assert store.jobs.get(job.id).attempt == 1
    assert store.attempts.get(job.id, 1).state == "submitted"


def test_a_tick_asks_ray_about_open_attempts_only(world):
    rec, store, ray = world
    done, running = add_job(store), add_job(store)
    rec.tick()  # both submitted
    store.jobs.update(done.id, status="succeeded")
    ray.state[f"{done.id}-a1"] = "SUCCEEDED"
    waiting = [add_job(store) for _ in range(5)]  # past the tenant's 4 running jobs
    ray.asked.clear()
    rec.tick()  # the finished job's attempt is still open: asked once more, then closed
    assert ray.asked == [{f"{done.id}-a1", f"{running.id}-a1"}]
    rec.tick()
    assert ray.asked[-1] == {f"{running.id}-a1", *(f"{j.id}-a1" for j in waiting[:3])}
    rec.tick()
    assert f"{done.id}-a1" not in ray.asked[-1]
    assert len(ray.asked[-1]) == 4


def test_an_attempt_ray_lost_becomes_the_next_attempt_until_none_are_left(world):
    rec, store, ray = world
    job = add_job(store)  # max_attempts 3
    rec.tick()
    for n in (1, 2):
        ray.state[f"{job.id}-a{n}"] = "FAILED"  # the driver died without reporting
        rec.tick()
        assert ray.submits[-1] == f"{job.id}-a{n + 1}"
        assert store.attempts.get(job.id, n).state == "ended"
        assert store.jobs.get(job.id).status_detail == "recovering"
    ray.state.pop(f"{job.id}-a3")  # the head restarted: Ray no longer knows attempt 3
    rec.tick()
    done = store.jobs.get(job.id)
    assert done.status == "failed"
    assert done.error["code"] == "attempts_exhausted"
    assert ray.submits == [f"{job.id}-a{n}" for n in (1, 2, 3)]
    msgs = [e.message for e in events_of(store, job.id)]
    assert any("no attempts left" in m and "no longer knows" in m for m in msgs)
    assert store.attempts.get(job.id, 3).ray_status == "LOST"
    rec.tick()  # a failed job stays failed and gets nothing more
    assert len(ray.submits) == 3
    assert store.jobs.get(job.id).status == "failed"


def test_an_attempt_left_submitting_by_a_crash_is_looked_up_before_it_is_submitted(world):
    rec, store, ray = world
    # a control plane died between recording attempt 1 and hearing back from Ray: Ray
    # has the job, so it must not be submitted again
    found = add_job(store)
    store.attempts.start(found.id, 1, "Attempt 1 submitted to Ray")
    ray.state[f"{found.id}-a1"] = "RUNNING"
    # ... and one died before Ray got it: that one is submitted now
    missing = add_job(store)
    store.attempts.start(missing.id, 1, "Attempt 1 submitted to Ray")
    rec.tick()
    assert ray.submits == [f"{missing.id}-a1"]
    assert store.attempts.get(found.id, 1).state == "submitted"
    assert store.attempts.get(missing.id, 1).state == "submitted"


def test_a_job_that_finished_while_its_attempt_ran_gets_no_new_attempt(world):
    rec, store, ray = world
    job = add_job(store)
    rec.tick()
    store.jobs.update(job.id, status="succeeded")  # the driver reported the end
    ray.state[f"{job.id}-a1"] = "SUCCEEDED"
    rec.tick()
    assert ray.submits == [f"{job.id}-a1"]
    assert store.attempts.get(job.id, 1).state == "ended"
    assert store.jobs.get(job.id).status == "succeeded"


def test_a_cancelled_job_whose_ray_job_still_runs_is_stopped(world):
    rec, store, ray = world
    job = add_job(store)
    rec.tick()
    ray.state[f"{job.id}-a1"] = "RUNNING"
    store.jobs.update(job.id, status="cancelled")  # the stop did not reach Ray
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


# -- faults -------------------------------------------------------------------------------


class Refusing(ScriptedLauncher):
    """Ray refuses every submission of the jobs in `poison` (a bad runtime env, say)."""

    def __init__(self, poison: set[str]) -> None:
        super().__init__()
        self.poison = poison
        self.refusals = 0

    def submit(self, submission_id, job_id, attempt, env) -> None:
        if job_id in self.poison:
            self.refusals += 1
            raise SubmissionRefused(f"Ray refused the submission {submission_id}: bad env")
        super().submit(submission_id, job_id, attempt, env)


@pytest.fixture
def fast_backoff(monkeypatch):
    monkeypatch.setattr(reconciler, "BACKOFF_S", 0.0)


def test_a_poison_job_fails_alone_after_its_retries_and_never_holds_up_the_others(
    local_service, fast_backoff
):
    settings, store = local_service
    poison = add_job(store)  # the oldest: walked first on every tick
    healthy = [add_job(store) for _ in range(3)]
    ray = Refusing({poison.id})
    rec = Reconciler(settings, store, ray)
    rec.tick()
    # one tick: the poison job raised, every job after it was submitted anyway
    assert ray.submits == [f"{j.id}-a1" for j in healthy]
    assert store.jobs.get(poison.id).status == "queued"
    for _ in range(reconciler.MAX_JOB_ERRORS + 2):
        rec.tick()
    assert ray.refusals == reconciler.MAX_JOB_ERRORS
    failed = store.jobs.get(poison.id)
    assert failed.status == "failed"
    assert failed.error["code"] == "submission_refused"
    assert "bad env" in failed.error["message"]
    assert "5 tries" in failed.error["message"]
    assert all(store.jobs.get(j.id).status == "queued" for j in healthy)
    assert len(ray.submits) == len(healthy)  # none submitted twice


def test_a_job_that_raises_waits_out_its_backoff_then_recovers(local_service, monkeypatch):
    settings, store = local_service
    job, other = add_job(store), add_job(store)
    ray = ScriptedLauncher()
    rec = Reconciler(settings, store, ray)
    real = store.attempts.update
    broken = {"on": True}

    def flaky(job_id, number, **values):
        if job_id == job.id and broken["on"]:
            raise OSError("disk I/O error (test)")
        return real(job_id, number, **values)

    monkeypatch.setattr(store.attempts, "update", flaky)
    rec.tick()
    assert store.attempts.get(other.id, 1).state == "submitted"
    assert store.attempts.get(job.id, 1).state == "submitting"  # its write failed
    rec.tick()  # within its backoff: not tried again
    assert rec._trouble[job.id].errors == 1
    broken["on"] = False
    monkeypatch.setattr(reconciler, "BACKOFF_S", 0.0)
    rec._trouble[job.id] = rec._trouble[job.id]._replace(retry_at=0.0)
    rec.tick()  # Ray has it (the submission went through): recorded, not resubmitted
    assert store.attempts.get(job.id, 1).state == "submitted"
    assert ray.submits.count(f"{job.id}-a1") == 1
    assert job.id not in rec._trouble
    assert store.jobs.get(job.id).status == "queued"


def test_an_attempt_ended_without_its_consequence_is_carried_forward(world):
    rec, store, ray = world
    job = add_job(store)
    rec.tick()
    # what an older control plane killed between its two writes left behind
    store.attempts.update(job.id, 1, state="ended", ray_status="FAILED")
    ray.state[f"{job.id}-a1"] = "FAILED"
    rec.tick()
    assert ray.submits == [f"{job.id}-a1", f"{job.id}-a2"]
    assert store.jobs.get(job.id).attempt == 2
    assert store.attempts.get(job.id, 2).state == "submitted"


def test_a_log_that_cannot_be_kept_does_not_keep_the_job_from_its_next_attempt(world, monkeypatch):
    rec, store, ray = world
    job = add_job(store)
    rec.tick()

    def disk_full(*_a, **_k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(logs, "save_attempt_log", disk_full)
    ray.state[f"{job.id}-a1"] = "FAILED"
    rec.tick()
    assert ray.submits[-1] == f"{job.id}-a2"
    assert store.attempts.get(job.id, 1).state == "ended"
    assert job.id not in rec._trouble


def test_files_are_checked_off_the_reconciler_thread_against_size_and_checksum(local_service):
    import hashlib

    settings, store = local_service
    good, bad = b'{"text": "hello"}\n', b'{"text": "hellO"}\n'
    rows = []
    for name, stored, on_disk in (("good", good, good), ("bad", good, bad), ("short", good, b"x")):
        f = make_file("acme", name)
        f.bytes, f.sha256 = len(stored), hashlib.sha256(stored).hexdigest()
        store.files.add(f)
        (settings.files_dir / name).write_bytes(on_disk)
        rows.append(add_job(store, status="validating_files", body=None))
        with store.db.write() as s:
            s.execute(update(Job).where(Job.id == rows[-1].id).values(training_file=f.id))
    ray = ScriptedLauncher()
    rec = Reconciler(settings, store, ray)
    seen_threads = set()
    real = rec._file_problem
    rec._file_problem = lambda job: (seen_threads.add(threading.current_thread().name), real(job))[
        1
    ]
    for _ in range(50):
        rec.tick()
        if all(store.jobs.get(j.id).status != "validating_files" for j in rows):
            break
        time.sleep(0.05)
    ok, changed, short = (store.jobs.get(j.id) for j in rows)
    assert ok.status == "queued"
    assert (changed.status, changed.error["code"]) == ("failed", "invalid_training_file")
    assert "checksum differs" in changed.error["message"]
    assert "size differs" in short.error["message"]
    assert len(seen_threads) == 1
    assert next(iter(seen_threads)).startswith("pstar-file-check")
    rec.stop()


def test_jobs_past_the_tenants_running_limits_wait_in_queued_saying_why(local_service):
    from dataclasses import replace

    from service.settings import Limits

    settings, store = local_service
    settings = replace(
        settings, limits=Limits(max_running_jobs_per_tenant=2, max_running_workers_per_tenant=3)
    )
    ray = ScriptedLauncher()
    rec = Reconciler(settings, store, ray)
    first = add_job(store)
    wide = add_job(store)
    with store.db.write() as s:  # a 3-worker job: with the first, over the 3 workers
        s.execute(update(Job).where(Job.id == wide.id).values(workers=3))
    third = add_job(store)
    fourth = add_job(store)
    theirs = add_job(store, tenant="rival")
    rec.tick()
    # the first and the third fit (2 jobs, 2 workers); the wide one would make 4 workers,
    # the fourth a third job; rival's share is its own
    assert sorted(ray.submits) == sorted(f"{j.id}-a1" for j in (first, third, theirs))
    waiting = store.jobs.get(wide.id)
    assert (waiting.status, waiting.attempt) == ("queued", 0)
    assert waiting.status_detail == (
        "waiting: the tenant runs 1 workers of its 3 (PSTAR_MAX_RUNNING_WORKERS_PER_TENANT); "
        "this job needs 3"
    )
    assert store.jobs.get(fourth.id).status_detail == (
        "waiting: the tenant runs 2 jobs of its 2 (PSTAR_MAX_RUNNING_JOBS_PER_TENANT); "
        "this job needs 1"
    )
    rec.tick()
    assert len(ray.submits) == 3
    for done in (first, third):
        store.jobs.update(done.id, status="succeeded")
        ray.state[f"{done.id}-a1"] = "SUCCEEDED"
    rec.tick()  # nothing runs: the wide job (older) starts, then the fourth is over 3 workers
    started = store.jobs.get(wide.id)
    assert ray.submits[-1] == f"{wide.id}-a1"
    assert (started.attempt, started.status_detail) == (1, None)
    assert "PSTAR_MAX_RUNNING_WORKERS_PER_TENANT" in store.jobs.get(fourth.id).status_detail


def test_training_sessions_engines_count_toward_the_tenants_running_workers(local_service):
    """A tenant's session engines (Tinker's training models) and its jobs share
    PSTAR_MAX_RUNNING_WORKERS_PER_TENANT both ways: a job waits while the engines hold the
    room, saying so, and `job_workers` gives the sessions what the running jobs take."""
    from dataclasses import replace

    from service.control.reconciler import job_workers
    from service.settings import Limits

    settings, store = local_service
    settings = replace(settings, limits=Limits(max_running_workers_per_tenant=3))
    ray = ScriptedLauncher()
    held = {"acme": 3}
    rec = Reconciler(settings, store, ray, session_workers=lambda: dict(held))
    job = add_job(store)
    theirs = add_job(store, tenant="rival")
    assert job_workers(store, "acme") == 0
    rec.tick()
    assert ray.submits == [f"{theirs.id}-a1"]
    assert store.jobs.get(job.id).status_detail == (
        "waiting: the tenant runs 3 workers of its 3 (PSTAR_MAX_RUNNING_WORKERS_PER_TENANT, "
        "3 in training sessions); this job needs 1"
    )
    held["acme"] = 2  # a session ended: its engine's worker is free
    rec.tick()
    assert ray.submits[-1] == f"{job.id}-a1"
    assert job_workers(store, "acme") == 1
    assert job_workers(store, "rival") == 1


def test_a_store_outage_blames_no_job_and_the_jobs_go_on_once_it_is_back(
    local_service, monkeypatch, fast_backoff
):
    from sqlalchemy.exc import OperationalError

    settings, store = local_service
    ray = ScriptedLauncher()
    rec = Reconciler(settings, store, ray)
    jobs = [add_job(store) for _ in range(2)]
    rec.tick()
    ray.state[f"{jobs[0].id}-a1"] = "FAILED"  # needs a next attempt while the store is down
    real = {name: getattr(store.attempts, name) for name in ("close", "update")}
    down = {"on": True}

    def flaky(name):
        def call(*a, **k):
            if down["on"]:
                raise OperationalError("UPDATE", {}, Exception("server closed the connection"))
            return real[name](*a, **k)

        return call

    for name in real:
        monkeypatch.setattr(store.attempts, name, flaky(name))
    for _ in range(3 * reconciler.MAX_JOB_ERRORS):  # far more ticks than a poison job gets
        rec.tick()
    assert rec._trouble == {}
    assert [store.jobs.get(j.id).status for j in jobs] == ["queued", "queued"]
    down["on"] = False
    rec.tick()
    assert ray.submits[-1] == f"{jobs[0].id}-a2"
    assert store.attempts.get(jobs[0].id, 2).state == "submitted"


# -- pause and resume ------------------------------------------------------------------------


def test_a_paused_attempt_is_not_lost_and_a_resume_starts_the_next_without_spending_one(world):
    rec, store, ray = world
    job = add_job(store, max_attempts=1)
    rec.tick()
    store.jobs.mark_running(job.id, 1)
    assert store.jobs.pause(job.id, "acme") == "requested"
    assert store.jobs.paused(job.id, 1, step=7)  # the workers wrote the pause's checkpoint
    ray.state[f"{job.id}-a1"] = "RUNNING"  # its driver is still winding down
    rec.tick()
    assert ray.stopped == []  # a paused job's driver is not stopped: it ends by itself
    store.attempts.end_paused(job.id, 1)
    ray.state[f"{job.id}-a1"] = "SUCCEEDED"
    for _ in range(2):
        rec.tick()
    assert store.jobs.get(job.id).status == "paused"
    assert ray.submits == [f"{job.id}-a1"]  # paused: nothing new
    assert store.jobs.resume(job.id, "acme")
    rec.tick()
    got = store.jobs.get(job.id)
    # max_attempts 1, yet attempt 2: the pause's attempt does not count
    assert (got.status, got.attempt, got.pauses) == ("queued", 2, 1)
    assert ray.submits[-1] == f"{job.id}-a2"
    assert any("resumes the paused job" in e.message for e in events_of(store, job.id))
    ray.state[f"{job.id}-a2"] = "FAILED"  # a real loss now: no attempt left
    rec.tick()
    assert store.jobs.get(job.id).status == "failed"


def test_a_resume_before_the_paused_driver_ended_waits_for_it(world):
    rec, store, ray = world
    job = add_job(store)
    rec.tick()
    store.jobs.mark_running(job.id, 1)
    store.jobs.pause(job.id, "acme")
    store.jobs.paused(job.id, 1, step=3)
    assert store.jobs.resume(job.id, "acme")  # the owner is quick
    ray.state[f"{job.id}-a1"] = "RUNNING"
    rec.tick()
    assert ray.submits == [f"{job.id}-a1"]  # attempt 1 still holds its workers
    store.attempts.end_paused(job.id, 1)  # its driver saw the pause in the last report
    rec.tick()
    assert ray.submits == [f"{job.id}-a1", f"{job.id}-a2"]


def test_a_pause_asked_of_a_job_waiting_in_ray_pauses_it_when_its_attempt_ends(world):
    rec, store, ray = world
    job = add_job(store)
    rec.tick()  # attempt 1 waits (PENDING) for resources
    assert store.jobs.pause(job.id, "acme") == "requested"
    assert store.jobs.get(job.id).status == "queued"
    ray.state[f"{job.id}-a1"] = "STOPPED"  # the API stopped it
    rec.tick()
    got = store.jobs.get(job.id)
    assert (got.status, got.pause_requested, got.pauses) == ("paused", False, 1)
    assert store.attempts.get(job.id, 1).ray_status == "PAUSED"
    rec.tick()
    assert ray.submits == [f"{job.id}-a1"]


def test_a_job_paused_before_its_first_attempt_gets_none_until_resumed(world):
    rec, store, ray = world
    job = add_job(store)
    assert store.jobs.pause(job.id, "acme") == "paused"
    rec.tick()
    assert ray.submits == []
    assert store.attempts.start(job.id, 1, "a late reconciler") is None  # nor by a race
    assert store.jobs.resume(job.id, "acme")
    assert store.jobs.get(job.id).status == "validating_files"  # its files checked again
    assert not store.jobs.resume(job.id, "acme")
    assert store.jobs.pause(job.id, "rival") is None  # another tenant's: not found as such


def _validating_with_a_good_file(local_service) -> Job:
    """A job whose training file is on disk with its stored size and checksum, waiting in
    `validating_files` for the reconciler to check it."""
    import hashlib

    settings, store = local_service
    data = b'{"text": "hello"}\n'
    f = make_file("acme", "good")
    f.bytes, f.sha256 = len(data), hashlib.sha256(data).hexdigest()
    store.files.add(f)
    (settings.files_dir / "good").write_bytes(data)
    job = add_job(store, status="validating_files", body=None)
    with store.db.write() as s:
        s.execute(update(Job).where(Job.id == job.id).values(training_file=f.id))
    return job


def test_a_checked_job_is_submitted_without_waiting_out_the_interval(local_service):
    settings, store = local_service
    job = _validating_with_a_good_file(local_service)
    ray = ScriptedLauncher()
    # three steps (check, queued, submitted), each of which used to wait an interval
    rec = Reconciler(settings, store, ray, interval_s=60)
    rec.start()
    try:
        deadline = time.monotonic() + 20
        while not ray.submits and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        rec.stop()
    assert ray.submits == [f"{job.id}-a1"]
    assert rec.ticks <= 4


def test_a_job_paused_while_its_files_are_checked_stays_paused(local_service):
    settings, store = local_service
    job = _validating_with_a_good_file(local_service)
    rec = Reconciler(settings, store, ScriptedLauncher(), interval_s=60)
    [(seen, _)] = store.jobs.active_with_attempts()  # a tick's view: validating_files
    rec._validate_files(seen)  # the check starts on its thread
    assert rec._checking[job.id].result(timeout=10) is None  # the files are good
    assert store.jobs.pause(job.id, "acme") == "paused"  # the owner pauses meanwhile
    rec._validate_files(seen)  # the verdict, acted on from the earlier view
    assert store.jobs.get(job.id).status == "paused"  # not queued behind the owner's back
    rec._checks.shutdown()
