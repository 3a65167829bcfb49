"""service/store: the schema Alembic builds, idempotent creation, terminal states that never
change, exclusive attempts, event paging, metrics, checkpoint retention and tenant filters.

Every test runs on SQLite and on a throw-away PostgreSQL, since the guarantees rest on each
backend's locking and conditional UPDATEs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import func, select

from service.store import (
    Event,
    File,
    IdempotencyConflict,
    Job,
    MetricPoint,
    StaleAttempt,
    Store,
    TooManyUnfinished,
    new_id,
    request_hash,
)
from service.store.models import Base
from tests.conftest import fresh_database

THREADS = 8


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def backend_store(request, tmp_path_factory):
    """One migrated store per backend for the module: a new PostgreSQL database costs up
    to a second, so behaviour tests share one and empty it (schema tests use `db_url`)."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path_factory.mktemp('store') / 'store.db'}"
    else:
        url = fresh_database(request.getfixturevalue("pg_server"))
    s = Store(url)
    s.migrate()
    yield s
    s.close()


@pytest.fixture
def store(backend_store):
    with backend_store.db.write() as s:
        for table in reversed(Base.metadata.sorted_tables):
            s.execute(table.delete())
    return backend_store


def spec_plan(model: str = "tiny-llama", training_file: str = "file-1") -> dict[str, Any]:
    """The smallest stored job spec (`service.spec.job.JobSpec`) a job can have."""
    return {
        "version": 1,
        "base_model": model,
        "method": {"type": "supervised"},
        "model": {"id": model, "kind": "base", "path": None},
        "training_file": {"id": training_file, "format": "chat", "examples": 8},
        "hyperparameters": {
            "n_epochs": 1,
            "batch_size": 2,
            "learning_rate_multiplier": 1.0,
            "learning_rate": 1e-4,
        },
    }


def make_job(
    tenant: str = "acme",
    *,
    key: str | None = None,
    body: dict[str, Any] | None = None,
    status: str = "queued",
    metadata: dict[str, str] | None = None,
    attempt: int = 0,
    max_attempts: int = 3,
) -> Job:
    body = body if body is not None else {"model": "tiny-llama", "training_file": "file-1"}
    return Job(
        id=new_id("ftjob"),
        tenant=tenant,
        model=body["model"],
        training_file=body["training_file"],
        seed=1,
        metadata_=metadata,
        request=body,
        request_hash=request_hash(body),
        idempotency_key=key,
        plan=spec_plan(body["model"], body["training_file"]),
        status=status,
        progress_step=0,
        progress_total=0,
        result_files=[],
        attempt=attempt,
        max_attempts=max_attempts,
        cancel_requested=False,
        created_at=1_700_000_000,
    )


def add_job(store: Store, **kwargs: Any) -> Job:
    job, created = store.jobs.create(make_job(**kwargs), "Created")
    assert created
    return job


def running_job(store: Store, **kwargs: Any) -> Job:
    """A job whose attempt 1 has been recorded, as a driver sees it: its writes pass the
    attempt fence."""
    job = add_job(store, **kwargs)
    assert store.attempts.start(job.id, 1, "Attempt 1 submitted to Ray") is not None
    return store.jobs.get(job.id)


def driver_attempt(store: Store, job_id: str) -> int:
    """The attempt a driver of this unfinished job would write as: the current one, or
    attempt 1 recorded now when the reconciler has not started one."""
    if store.jobs.get(job_id).attempt == 0:
        # None when a running reconciler recorded it first: then that one is current
        store.attempts.start(job_id, 1, "Attempt 1 submitted to Ray")
    return store.jobs.get(job_id).attempt


def make_file(tenant: str, name: str) -> File:
    return File(
        id=new_id("file"),
        tenant=tenant,
        filename=name,
        purpose="fine-tune",
        bytes=10,
        sha256="0" * 64,
        created_at=1_700_000_000,
        status="processed",
        format="chat",
        examples=1,
        storage_name=name,
    )


def run_together(n: int, fn: Callable[[int], Any]) -> list[Any]:
    """`fn(i)` in `n` threads released at once; each result, or the exception it raised."""
    barrier = threading.Barrier(n)
    results: list[Any] = [None] * n

    def worker(i: int) -> None:
        barrier.wait()
        try:
            results[i] = fn(i)
        except Exception as e:
            results[i] = e

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return results


def count(store: Store, model: type, *where: Any) -> int:
    with store.db.read() as s:
        return s.scalar(select(func.count()).select_from(model).where(*where))


def events_of(store: Store, job_id: str) -> list[Event]:
    return store.events.page(job_id, None, 100)[0]


# -- schema ---------------------------------------------------------------------------------


def schema_diffs(store: Store) -> list[Any]:
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    with store.engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"compare_type": True})
        return compare_metadata(ctx, Base.metadata)


def test_migration_creates_exactly_the_models_schema(fresh_store):
    assert schema_diffs(fresh_store) == []


def test_migrating_twice_keeps_schema_and_rows(fresh_store):
    job = add_job(fresh_store)
    fresh_store.migrate()
    assert schema_diffs(fresh_store) == []
    assert fresh_store.jobs.get(job.id).id == job.id


# -- idempotent creation --------------------------------------------------------------------


def test_create_with_a_used_key_and_same_body_returns_the_first_job(store):
    first = add_job(store, key="k1")
    again, created = store.jobs.create(make_job(key="k1"), "Created")
    assert not created
    assert again.id == first.id
    assert count(store, Job) == 1


def test_create_with_a_used_key_and_another_body_raises_conflict(store):
    first = add_job(store, key="k1")
    other = make_job(key="k1", body={"model": "tiny-llama", "training_file": "file-2"})
    with pytest.raises(IdempotencyConflict) as err:
        store.jobs.create(other, "Created")
    assert err.value.job.id == first.id
    assert count(store, Job) == 1


def test_idempotency_keys_are_per_tenant(store):
    a = add_job(store, tenant="acme", key="k1")
    b = add_job(store, tenant="rival", key="k1")
    assert a.id != b.id


def test_concurrent_creates_with_one_key_store_one_job(store):
    results = run_together(THREADS, lambda _i: store.jobs.create(make_job(key="k"), "Created"))
    assert all(isinstance(r, tuple) for r in results), results
    assert len({job.id for job, _ in results}) == 1
    assert sum(created for _, created in results) == 1
    assert count(store, Job) == 1
    assert count(store, Event) == 1  # only the winner logged its first event


def test_concurrent_creates_past_a_tenants_unfinished_limit_store_exactly_the_limit(store):
    add_job(store, tenant="rival")  # another tenant's job counts for it, not for acme
    add_job(store, status="succeeded")  # a finished one counts for no one
    results = run_together(THREADS, lambda _i: store.jobs.create(make_job(), "Created", 3))
    created = [r for r in results if isinstance(r, tuple)]
    refused = [r for r in results if isinstance(r, TooManyUnfinished)]
    assert len(created) == 3, results
    assert len(refused) == THREADS - 3, results
    assert {r.n for r in refused} == {3}
    assert store.jobs.count_by_status("acme") == {"queued": 3, "succeeded": 1}


def test_concurrent_creates_with_one_key_and_two_bodies_conflict_for_the_losers(store):
    bodies = [{"model": "tiny-llama", "training_file": f"file-{i % 2}"} for i in range(THREADS)]
    results = run_together(
        THREADS, lambda i: store.jobs.create(make_job(key="k", body=bodies[i]), "Created")
    )
    (row,) = store.jobs.page("acme", None, 10)[0]
    row = store.jobs.get(row.id)  # the list's rows leave out the request
    for body, r in zip(bodies, results, strict=True):
        if body == row.request:
            assert isinstance(r, tuple), r
            assert r[0].id == row.id
        else:
            assert isinstance(r, IdempotencyConflict), r
            assert r.job.id == row.id


# -- terminal states ------------------------------------------------------------------------


@pytest.mark.parametrize("final", ["succeeded", "failed", "cancelled"])
def test_update_of_a_terminal_job_is_refused_and_changes_nothing(store, final):
    job = add_job(store)
    assert store.jobs.update(job.id, event="done", status=final)
    before = store.jobs.get(job.id)
    n_events = len(events_of(store, job.id))

    assert not store.jobs.update(job.id, event="late", status="running", status_detail="late")

    after = store.jobs.get(job.id)
    assert (after.status, after.status_detail, after.finished_at) == (
        final,
        before.status_detail,
        before.finished_at,
    )
    assert len(events_of(store, job.id)) == n_events


def test_update_to_a_terminal_state_sets_finished_at_and_logs_the_event(store):
    job = add_job(store)
    assert store.jobs.update(job.id, event="Job failed", status="failed")
    assert store.jobs.get(job.id).finished_at is not None
    newest = events_of(store, job.id)[0]
    assert (newest.message, newest.level) == ("Job failed", "error")


def test_racing_writers_finish_a_job_exactly_once(store):
    job = add_job(store, status="running")
    finals = ["succeeded" if i % 2 else "cancelled" for i in range(THREADS)]
    won = run_together(
        THREADS, lambda i: store.jobs.update(job.id, event=f"writer {i}", status=finals[i])
    )
    assert won.count(True) == 1, won
    winner = won.index(True)
    assert store.jobs.get(job.id).status == finals[winner]
    messages = [e.message for e in events_of(store, job.id)]
    assert [m for m in messages if m.startswith("writer")] == [f"writer {winner}"]


# -- attempts and mark_running --------------------------------------------------------------


def test_start_attempt_records_the_attempt_and_bumps_the_job(store):
    job = add_job(store)
    att = store.attempts.start(job.id, 1, "Attempt 1 submitted")
    assert (att.number, att.state, att.submission_id) == (1, "submitting", f"{job.id}-a1")
    assert store.jobs.get(job.id).attempt == 1
    assert store.attempts.get(job.id, 1) is not None


def test_start_attempt_with_the_same_number_twice_gives_none_the_second_time(store):
    job = add_job(store)
    assert store.attempts.start(job.id, 1, "first") is not None
    assert store.attempts.start(job.id, 1, "again") is None
    assert [a.number for a in store.attempts.of_job(job.id)] == [1]


def test_start_attempt_cannot_skip_a_number(store):
    job = add_job(store)
    assert store.attempts.start(job.id, 2, "skips 1") is None
    assert store.attempts.of_job(job.id) == []


def test_concurrent_start_attempt_gives_exactly_one_attempt(store):
    job = add_job(store)
    results = run_together(THREADS, lambda i: store.attempts.start(job.id, 1, f"reconciler {i}"))
    assert sum(r is not None for r in results) == 1, results
    assert len(store.attempts.of_job(job.id)) == 1


def test_terminal_job_gets_no_attempt(store):
    job = add_job(store)
    store.jobs.update(job.id, status="cancelled")
    assert store.attempts.start(job.id, 1, "too late") is None
    assert store.attempts.of_job(job.id) == []
    assert store.jobs.get(job.id).attempt == 0


def test_mark_running_moves_a_queued_job_of_the_current_attempt(store):
    job = add_job(store)
    store.attempts.start(job.id, 1, "a1")
    assert store.jobs.mark_running(job.id, 1)
    fresh = store.jobs.get(job.id)
    assert fresh.status == "running"
    assert fresh.started_at is not None
    assert events_of(store, job.id)[0].message == "Fine-tuning job started"


def test_mark_running_is_refused_to_a_stale_attempt(store):
    job = add_job(store)
    store.attempts.start(job.id, 1, "a1")
    store.attempts.start(job.id, 2, "a2")
    assert not store.jobs.mark_running(job.id, 1)
    assert store.jobs.get(job.id).status == "queued"


@pytest.mark.parametrize("status", ["validating_files", "running", "cancelled"])
def test_mark_running_only_moves_queued_jobs(store, status):
    job = add_job(store, status=status, attempt=1)
    n_events = len(events_of(store, job.id))
    assert not store.jobs.mark_running(job.id, 1)
    assert store.jobs.get(job.id).status == status
    assert len(events_of(store, job.id)) == n_events


# -- events, metrics, checkpoints -----------------------------------------------------------


def test_events_are_listed_newest_first_in_pages(store):
    job = add_job(store)  # logs "Created"
    for i in range(5):
        store.events.add(job.id, f"e{i}")
    expected = ["e4", "e3", "e2", "e1", "e0", "Created"]

    pages, after, has_more = [], None, True
    while has_more:
        page, has_more = store.events.page(job.id, after, 2)
        pages.append([e.message for e in page])
        after = page[-1].seq
    assert pages == [expected[0:2], expected[2:4], expected[4:6]]


def test_events_page_has_more_only_when_older_events_remain(store):
    job = add_job(store)
    store.events.add(job.id, "e0")
    page, has_more = store.events.page(job.id, None, 1)
    assert [e.message for e in page] == ["e0"]
    assert has_more
    page, has_more = store.events.page(job.id, page[-1].seq, 1)
    assert [e.message for e in page] == ["Created"]
    assert not has_more


def test_events_are_filtered_by_type(store):
    job = running_job(store)
    store.events.record_metrics(job.id, 1, 1, {"train_loss": 2.0}, "Step 1")
    page, _ = store.events.page(job.id, None, 10, type="metrics")
    assert [e.message for e in page] == ["Step 1"]


def test_record_metrics_for_one_step_twice_keeps_the_latest_point(store):
    job = running_job(store)
    store.events.record_metrics(job.id, 1, 5, {"train_loss": 2.0}, "Step 5/10: 2.0")
    store.attempts.close(job.id, 1, "FAILED", next_reason="Attempt 2 resumes")
    store.events.record_metrics(job.id, 2, 5, {"train_loss": 1.5}, "Step 5/10: 1.5")
    (point,) = store.events.metric_points(job.id)
    assert (point.step, point.attempt, point.values) == (5, 2, {"train_loss": 1.5})
    assert count(store, MetricPoint) == 1


def test_record_metrics_writes_the_openai_metrics_event(store):
    job = running_job(store)
    store.events.record_metrics(job.id, 1, 3, {"train_loss": 2.0, "grad_norm": 0.5}, "Step 3")
    newest = events_of(store, job.id)[0]
    assert (newest.type, newest.message) == ("metrics", "Step 3")
    assert newest.data == {"step": 3, "train_loss": 2.0}
    assert store.events.metric_points(job.id)[0].values == {"train_loss": 2.0, "grad_norm": 0.5}


def test_metric_points_are_read_by_step_range(store):
    job = running_job(store)
    for step in range(1, 6):
        store.events.record_metrics(job.id, 1, step, {"train_loss": float(step)}, f"Step {step}")
    assert [p.step for p in store.events.metric_points(job.id, 2, 4)] == [2, 3, 4]


def test_a_long_range_of_metric_points_comes_back_thinned_with_its_last_step(store):
    job = running_job(store)
    for step in range(0, 101):
        store.events.record_metrics(job.id, 1, step, {"train_loss": float(step)}, f"Step {step}")
    thin = [p.step for p in store.events.metric_points(job.id, max_points=10)]
    assert len(thin) <= 10
    assert thin == [0, 12, 24, 36, 48, 60, 72, 84, 96, 100]  # every 12th, and the last
    assert [p.step for p in store.events.metric_points(job.id, 50, 60, max_points=20)] == list(
        range(50, 61)
    )  # fits: every point
    assert len(store.events.metric_points(job.id, max_points=101)) == 101


def test_add_checkpoint_keeps_the_newest_non_final_ones_and_the_final(store):
    job = running_job(store)
    for step in (10, 20, 30, 40):
        store.checkpoints.add(job.id, step, {"train_loss": 1.0}, f"/ck/{step}", keep=2, attempt=1)
    assert [c.step for c in store.checkpoints.page(job.id, None, 10)[0]] == [40, 30]

    store.checkpoints.add(job.id, 50, {}, "/ck/final", keep=2, final=True, attempt=1)
    store.checkpoints.add(job.id, 60, {}, "/ck/60", keep=2, attempt=1)
    kept = store.checkpoints.page(job.id, None, 10)[0]
    assert [(c.step, c.final) for c in kept] == [(60, False), (50, True), (40, False)]


def test_add_checkpoint_at_a_recorded_step_replaces_it(store):
    job = running_job(store)
    first = store.checkpoints.add(job.id, 10, {"train_loss": 2.0}, "/ck/a", keep=3, attempt=1)
    second = store.checkpoints.add(job.id, 10, {"train_loss": 1.0}, "/ck/b", keep=3, attempt=1)
    (only,) = store.checkpoints.page(job.id, None, 10)[0]
    assert only.id == second.id != first.id
    assert only.path == "/ck/b"


def test_a_replaced_attempt_writes_nothing_and_its_successor_everything(store):
    job = running_job(store)
    store.events.record_metrics(job.id, 1, 1, {"train_loss": 3.0}, "Step 1")
    nxt = store.attempts.close(job.id, 1, "FAILED", next_reason="Attempt 2 resumes")
    assert (nxt.number, nxt.state) == (2, "submitting")
    before = (count(store, MetricPoint), len(events_of(store, job.id)))
    zombie = [
        lambda: store.events.record_metrics(job.id, 1, 2, {"train_loss": 9.0}, "Step 2"),
        lambda: store.checkpoints.add(job.id, 2, {}, "/ck/zombie", keep=3, attempt=1),
        lambda: store.jobs.update(job.id, attempt=1, status_detail="training"),
        lambda: store.jobs.update(job.id, attempt=1, status="failed", error={"code": "x"}),
        lambda: store.events.add(job.id, "zombie says hello", attempt=1),
        lambda: store.events.set_stats(job.id, trace={"z": 1}, attempt=1),
    ]
    for write in zombie:
        with pytest.raises(StaleAttempt, match="attempt 2 is the current one"):
            write()
    assert (count(store, MetricPoint), len(events_of(store, job.id))) == before
    assert store.checkpoints.page(job.id, None, 10)[0] == []
    assert store.events.get_stats(job.id) is None
    now = store.jobs.get(job.id)
    assert (now.status, now.status_detail, now.attempt) == ("queued", "recovering", 2)
    # the current attempt writes as before
    store.events.record_metrics(job.id, 2, 2, {"train_loss": 2.0}, "Step 2")
    assert store.jobs.update(job.id, attempt=2, status_detail="training")
    assert [p.attempt for p in store.events.metric_points(job.id)] == [1, 2]


def test_an_ended_attempt_or_a_finished_job_refuses_its_attempts_writes(store):
    job = running_job(store)
    store.attempts.close(job.id, 1, "FAILED")  # ended, nothing follows yet
    with pytest.raises(StaleAttempt, match="reconciler has ended"):
        store.events.record_metrics(job.id, 1, 1, {"train_loss": 1.0}, "Step 1")
    assert not store.attempts.is_current(job.id, 1)
    other = running_job(store)
    assert store.attempts.is_current(other.id, 1)
    store.jobs.update(other.id, status="cancelled")
    with pytest.raises(StaleAttempt, match="the job is cancelled"):
        store.checkpoints.add(other.id, 1, {}, "/ck/1", keep=3, attempt=1)
    with pytest.raises(StaleAttempt, match="no such job"):
        store.events.add("ftjob-nope", "x", attempt=1)


def test_closing_an_attempt_writes_its_consequence_once(store):
    job = running_job(store)  # max_attempts 3
    nxt = store.attempts.close(job.id, 1, None, next_reason="Attempt 2 resumes")
    assert store.attempts.get(job.id, 1).ray_status == "LOST"
    # a second reconciler acting on the same snapshot gets nothing: attempt 2 exists
    assert store.attempts.close(job.id, 1, None, next_reason="Attempt 2 resumes") is None
    assert [a.number for a in store.attempts.of_job(job.id)] == [1, 2]
    assert nxt.submission_id == f"{job.id}-a2"
    fail = {"event": "no attempts left", "error": {"code": "attempts_exhausted"}}
    store.attempts.close(job.id, 1, "FAILED", failure=fail)  # a stale failure: ignored
    assert store.jobs.get(job.id).status == "queued"
    store.attempts.close(job.id, 2, "FAILED", failure=fail)
    done = store.jobs.get(job.id)
    assert (done.status, done.error, done.finished_at is not None) == (
        "failed",
        {"code": "attempts_exhausted"},
        True,
    )
    assert store.attempts.get(job.id, 2).state == "ended"
    assert events_of(store, job.id)[0].message == "no attempts left"


# -- tenants and listing --------------------------------------------------------------------


def test_get_job_with_another_tenant_finds_nothing(store):
    job = add_job(store, tenant="acme")
    assert store.jobs.get(job.id, tenant="rival") is None
    assert store.jobs.get(job.id, tenant="acme").id == job.id


def test_list_jobs_shows_only_the_tenants_jobs_newest_first(store):
    mine = [add_job(store, tenant="acme").id for _ in range(3)]
    add_job(store, tenant="rival")
    rows, has_more = store.jobs.page("acme", None, 10)
    assert [j.id for j in rows] == mine[::-1]
    assert not has_more


def test_list_jobs_pages_after_a_job(store):
    ids = [add_job(store).id for _ in range(5)]
    rows, has_more = store.jobs.page("acme", ids[3], 2)
    assert [j.id for j in rows] == [ids[2], ids[1]]
    assert has_more


def test_list_jobs_filters_on_metadata(store):
    a1 = add_job(store, metadata={"team": "a", "run": "1"})
    add_job(store, metadata={"team": "b"})
    add_job(store, metadata=None)
    a2 = add_job(store, metadata={"team": "a"})
    add_job(store, tenant="rival", metadata={"team": "a"})

    rows, has_more = store.jobs.page("acme", None, 10, metadata={"team": "a"})
    assert [j.id for j in rows] == [a2.id, a1.id]
    assert not has_more
    rows, has_more = store.jobs.page("acme", None, 1, metadata={"team": "a"})
    assert [j.id for j in rows] == [a2.id]
    assert has_more
    rows, _ = store.jobs.page("acme", None, 10, metadata={"team": "a", "run": "1"})
    assert [j.id for j in rows] == [a1.id]

    # with status and a cursor, as the query's own filters
    add_job(store, metadata={"team": "a"}, status="running")
    rows, _ = store.jobs.page("acme", None, 10, status="queued", metadata={"team": "a"})
    assert [j.id for j in rows] == [a2.id, a1.id]
    rows, _ = store.jobs.page("acme", a2.id, 10, metadata={"team": "a"})
    assert [j.id for j in rows] == [a1.id]


def test_json_columns_hold_strict_json_on_both_backends(store):
    """A diverged loss (NaN, inf) is stored as null: PostgreSQL's json refuses the
    `NaN` that Python's json writes; integers past 64 bits and non-ASCII text round-trip."""
    job = add_job(store)
    store.jobs.update(
        job.id, runtime={"nan": float("nan"), "inf": float("-inf"), "big": 2**70, "name": "é"}
    )
    want = {"nan": None, "inf": None, "big": 2**70, "name": "é"}
    assert store.jobs.get(job.id).runtime == want
    assert store.jobs.view(job.id, "acme").runtime == want
    assert store.jobs.view(job.id, "rival") is None


def test_rows_that_json_wrote_with_nan_still_read():
    """Rows written before the strict encoder hold `NaN`; the decoder takes them."""
    from service.store.statements import loads

    got = loads('{"loss": NaN, "x": Infinity, "n": 1}')
    assert got["loss"] != got["loss"]
    assert got["x"] == float("inf")
    assert loads(b'{"n": 1}') == {"n": 1}


def test_files_of_another_tenant_are_invisible(store):
    f = store.files.add(make_file("acme", "train.jsonl"))
    store.files.add(make_file("rival", "theirs.jsonl"))
    assert store.files.get("rival", f.id) is None
    assert store.files.delete("rival", f.id) is None
    assert [x.id for x in store.files.page("acme", None, 10, None)[0]] == [f.id]
    assert store.files.get("acme", f.id).filename == "train.jsonl"


def test_a_cursor_the_list_does_not_hold_is_refused_not_restarted(store):
    from service.errors import UnknownCursor

    files = [store.files.add(make_file("acme", f"f{i}.jsonl")) for i in range(3)]
    theirs = store.files.add(make_file("rival", "theirs.jsonl"))
    job = add_job(store)
    store.files.delete("acme", files[1].id)  # deleted between two pages
    for after in (files[1].id, theirs.id, "file-never-was"):
        with pytest.raises(UnknownCursor, match="list again without 'after'") as e:
            store.files.page("acme", after, 10, None)
        assert e.value.param == "after"
    with pytest.raises(UnknownCursor, match="no fine-tuning job"):
        store.jobs.page("rival", job.id, 10)
    with pytest.raises(UnknownCursor, match="no checkpoint"):
        store.checkpoints.page(job.id, "ftckpt-never-was", 10)
    # a cursor the list holds still pages
    assert [f.id for f in store.files.page("acme", files[2].id, 10, None)[0]] == [files[0].id]


def test_active_jobs_come_with_their_current_attempt_in_one_list(store):
    fresh = add_job(store)
    running = add_job(store)
    store.attempts.start(running.id, 1, "a1")
    store.attempts.start(running.id, 2, "a2")
    done = add_job(store)
    store.attempts.start(done.id, 1, "a1")
    store.jobs.update(done.id, status="succeeded")
    pairs = store.jobs.active_with_attempts()
    assert [(j.id, a.number if a else None) for j, a in pairs] == [
        (fresh.id, None),
        (running.id, 2),
    ]
    # the finished job's attempt is still open: it is listed for the orphan check only
    assert [(a.job_id, a.number, j.status) for a, j in store.attempts.open_of_finished_jobs()] == [
        (done.id, 1, "succeeded")
    ]
    store.attempts.update(done.id, 1, state="ended")
    assert store.attempts.open_of_finished_jobs() == []


def test_of_a_long_queue_only_each_tenants_oldest_waiting_jobs_are_read(store):
    started = add_job(store)
    store.attempts.start(started.id, 1, "a1")
    waiting = [add_job(store, tenant="acme" if i % 4 else "rival") for i in range(40)]
    validating = add_job(store, status="validating_files")
    pairs = store.jobs.active_with_attempts(waiting_per_tenant=3)
    acme = [j for j in waiting if j.tenant == "acme"][:3]
    rival = [j for j in waiting if j.tenant == "rival"][:3]
    want = sorted([*acme, *rival], key=lambda j: j.seq)
    assert [j.id for j, _ in pairs] == [started.id, *(j.id for j in want), validating.id]
    assert pairs[0][1] is not None
    assert pairs[0][1].number == 1
    assert all(a is None for _, a in pairs[1:])
    # unbounded: every unfinished job, in the order they came
    everything = [j.id for j, _ in store.jobs.active_with_attempts()]
    assert everything == [started.id, *(j.id for j in waiting), validating.id]


def test_a_status_write_the_table_forbids_changes_nothing(store):
    from service.store.status import JOB_TRANSITIONS, JobStatus

    job = add_job(store, status="validating_files")
    # validating_files -> succeeded is not in the table: no row changes, nothing else set
    assert JobStatus.SUCCEEDED not in JOB_TRANSITIONS[JobStatus.VALIDATING_FILES]
    assert not store.jobs.update(job.id, status="succeeded", fine_tuned_model="ft:x")
    got = store.jobs.get(job.id)
    assert (got.status, got.fine_tuned_model) == ("validating_files", None)
    # the legal path, and a write that keeps the status
    assert store.jobs.update(job.id, status="queued")
    assert store.jobs.update(job.id, status="queued", status_detail="waiting")
    assert store.jobs.update(job.id, status="succeeded")
    assert not store.jobs.update(job.id, status="failed")  # terminal: never again
