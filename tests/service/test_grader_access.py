"""A reinforcement job's grader keys (service/control/grader_access.py): one per attempt,
in a file of its own; a later attempt's grant revokes the earlier ones and a stale one's
leaves the later alone; the sweep revokes every key no running attempt holds."""

from __future__ import annotations

from service.control import grader_access
from service.settings import Settings
from service.store import Store
from service.store.status import JobStatus
from tests.service.test_store import running_job


def setup(tmp_path):
    store = Store(f"sqlite:///{tmp_path / 'store.db'}")
    store.migrate()
    settings = Settings(data_dir=tmp_path, db_url="sqlite://", tokens={})
    return settings, store


def live(store: Store) -> list[str]:
    return sorted(k.name for k in store.keys.live("grader"))


def test_each_attempt_has_its_own_key_and_a_stale_grant_leaves_the_later_one(tmp_path):
    settings, store = setup(tmp_path)
    job = running_job(store)
    one = grader_access.grant(settings, store, job.id, job.tenant, 1)
    assert one.name == "grader_key.1"
    assert one.stat().st_mode & 0o777 == 0o600
    two = grader_access.grant(settings, store, job.id, job.tenant, 2)
    assert live(store) == [f"grader of {job.id} attempt 2"]  # attempt 1's revoked
    assert store.keys.find(one.read_text().strip()) is None
    # attempt 1's driver, stale, grants again: attempt 2's key stays, and so does its file
    grader_access.grant(settings, store, job.id, job.tenant, 1)
    assert f"grader of {job.id} attempt 2" in live(store)
    assert store.keys.find(two.read_text().strip()) is not None
    # an attempt's revoke is its own
    assert grader_access.revoke(store, job.id, 1) == 1
    assert live(store) == [f"grader of {job.id} attempt 2"]


def test_the_sweep_revokes_the_keys_no_running_attempt_holds(tmp_path):
    settings, store = setup(tmp_path)
    running = running_job(store)
    paused = running_job(store)
    ended = running_job(store)
    for job in (running, paused, ended):
        grader_access.grant(settings, store, job.id, job.tenant, 1)
    store.keys.create(running.tenant, role="grader", name=f"grader of {running.id} attempt 0")
    store.jobs.update(paused.id, status=JobStatus.PAUSED)
    store.jobs.update(ended.id, status=JobStatus.CANCELLED)
    assert grader_access.sweep(store) == 3  # the paused, the ended, the stale attempt 0
    assert live(store) == [f"grader of {running.id} attempt 1"]


def test_model_graders_anywhere_in_the_grader_need_a_key():
    judge = {"type": "label_model", "name": "l", "model": "m"}
    check = {"type": "string_check", "name": "s"}
    assert grader_access.asks_models(judge)
    assert grader_access.asks_models({**judge, "type": "score_model"})
    assert not grader_access.asks_models(check)
    assert grader_access.asks_models({"type": "multi", "graders": {"a": check, "b": judge}})
    assert grader_access.asks_models({"type": "multi", "graders": judge})  # the SDK's shape
    assert not grader_access.asks_models({"type": "multi", "graders": check})
    # the cosine metric embeds through the API; the other metrics compute in the worker
    near = {"type": "text_similarity", "name": "n", "evaluation_metric": "cosine"}
    assert grader_access.asks_models(near)
    assert grader_access.asks_models({"type": "multi", "graders": {"a": check, "n": near}})
    assert not grader_access.asks_models({**near, "evaluation_metric": "bleu"})
