"""Fault injection: the reconciler SIGKILLed at each step between its writes (a crash
point, `service.faults`), then restarted, on SQLite and PostgreSQL. Every job reaches the
state it should: none lost (each unfinished job ends with a current attempt that Ray
runs), none run twice (Ray got each submission id once)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from service.store import Store
from tests.service.test_store import add_job

ROOT = Path(__file__).resolve().parents[2]


def reconcile(db_url: str, data_dir: Path, ray_file: Path, ticks: int, crash: str = "") -> int:
    env = {**os.environ, "PSTAR_CRASH_AT": crash}
    r = subprocess.run(
        [sys.executable, "-m", "tests.service.reconcile_proc", db_url, str(data_dir),
         str(ray_file), str(ticks)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode in (0, -9), r.stderr
    return r.returncode


def ray_of(ray_file: Path) -> dict:
    return json.loads(ray_file.read_text())


def set_ray(ray_file: Path, sid: str, state: str) -> None:
    d = ray_of(ray_file)
    d["state"][sid] = state
    ray_file.write_text(json.dumps(d))


def assert_nothing_lost_or_doubled(store: Store, ray_file: Path, jobs) -> None:
    ray = ray_of(ray_file)
    assert all(n == 1 for n in ray["submits"].values()), ray["submits"]
    for j in jobs:
        job = store.jobs.get(j.id)
        atts = store.attempts.of_job(j.id)
        assert [a.number for a in atts] == list(range(1, job.attempt + 1))
        if job.status in ("succeeded", "failed", "cancelled"):
            continue
        current = atts[-1]
        assert current.state == "submitted", (j.id, current.state)
        assert ray["state"][current.submission_id] == "PENDING"
        assert all(a.state == "ended" for a in atts[:-1])


@pytest.mark.parametrize("crash", ["attempt-recorded", "ray-has-attempt"])
def test_a_crash_while_starting_attempts_loses_none_and_submits_none_twice(db_url, tmp_path, crash):
    store = Store(db_url)
    store.migrate()
    jobs = [add_job(store) for _ in range(3)]
    ray_file = tmp_path / "ray.json"
    assert reconcile(db_url, tmp_path, ray_file, 5, crash) == -9  # died at its first step
    assert reconcile(db_url, tmp_path, ray_file, 3) == 0  # the restart carries it forward
    assert_nothing_lost_or_doubled(store, ray_file, jobs)
    assert [store.jobs.get(j.id).attempt for j in jobs] == [1, 1, 1]
    store.close()


@pytest.mark.parametrize("crash", ["attempt-closed", "ray-has-attempt"])
def test_a_crash_between_ending_an_attempt_and_starting_the_next_loses_nothing(
    db_url, tmp_path, crash
):
    store = Store(db_url)
    store.migrate()
    jobs = [add_job(store) for _ in range(3)]
    lost, last = jobs[0], jobs[1]
    ray_file = tmp_path / "ray.json"
    assert reconcile(db_url, tmp_path, ray_file, 2) == 0
    set_ray(ray_file, f"{lost.id}-a1", "FAILED")  # its driver died: attempt 2 must follow
    with store.db.write() as s:  # the other one is on its last attempt: it must fail instead
        from sqlalchemy import update

        from service.store import Job

        s.execute(update(Job).where(Job.id == last.id).values(max_attempts=1))
    set_ray(ray_file, f"{last.id}-a1", "FAILED")
    assert reconcile(db_url, tmp_path, ray_file, 3, crash) == -9
    assert reconcile(db_url, tmp_path, ray_file, 3) == 0
    assert_nothing_lost_or_doubled(store, ray_file, jobs)
    assert store.jobs.get(lost.id).attempt == 2
    assert store.attempts.get(lost.id, 1).state == "ended"
    failed = store.jobs.get(last.id)
    assert (failed.status, failed.error["code"]) == ("failed", "attempts_exhausted")
    assert store.jobs.get(jobs[2].id).attempt == 1  # untouched
    store.close()
