"""A tenant's storage (`service.control.storage`): what ended jobs keep is measured, counted
against the tenant's quota, reclaimed after retention, and erased with a deleted model or
file; a checkpoint of an erased or reclaimed run is no longer served or downloaded."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from benchmarks.models_made import full_model, lora_model
from service.control import storage
from service.control.exports import content_dir
from service.errors import NotAvailable, NotFound, QuotaExceeded
from service.serving.deployments import delete_model, target_of
from service.settings import Limits, Settings
from service.store import Store
from tests.service.test_store import add_job


def _ended_long_ago(store: Store, job_id: str, days: float) -> None:
    from sqlalchemy import update

    from service.store import Job

    with store.db.write() as s:
        s.execute(
            update(Job)
            .where(Job.id == job_id)
            .values(finished_at=int(time.time() - days * storage.DAY_S))
        )


def test_the_sweep_measures_what_each_ended_job_keeps_once(env):
    settings, store = env
    made = lora_model(store, settings.data_dir)
    assert store.jobs.get(made.job_id).storage_bytes is None
    assert storage.sweep(settings, store) == {"measured": 1, "reclaimed": 0}
    kept = store.jobs.get(made.job_id).storage_bytes
    # the export (adapter + merged model) and the checkpoint's adapter, to the byte
    want = storage.du(settings.finetuned_dir(made.job_id)) + storage.du(
        settings.job_dir(made.job_id)
    )
    assert kept == want > 0
    assert store.jobs.storage_bytes("acme") == kept
    assert store.jobs.storage_bytes("rival") == 0
    assert storage.sweep(settings, store) == {"measured": 0, "reclaimed": 0}


def test_a_job_past_the_tenants_storage_quota_is_refused_with_the_numbers(env):
    settings, store = env
    made = full_model(store, settings.data_dir)
    storage.sweep(settings, store)
    kept = store.jobs.get(made.job_id).storage_bytes
    tight = replace(settings, limits=Limits(max_storage_bytes_per_tenant=kept))
    with pytest.raises(QuotaExceeded) as e:
        storage.check_quota(tight, store, "acme")
    assert e.value.code == "storage_quota_exceeded"
    assert f"{kept:,} bytes" in e.value.message
    assert "PSTAR_MAX_STORAGE_BYTES_PER_TENANT" in e.value.message
    storage.check_quota(tight, store, "rival")  # another tenant's use is its own
    storage.check_quota(replace(tight, limits=Limits(max_storage_bytes_per_tenant=kept + 1)),
                        store, "acme")  # fmt: skip


def test_retention_reclaims_old_runs_and_keeps_the_exported_model(env):
    settings, store = env
    old = lora_model(store, settings.data_dir)
    recent = lora_model(store, settings.data_dir, seed=2)
    _ended_long_ago(store, old.job_id, 31)
    _ended_long_ago(store, recent.job_id, 29)
    got = storage.sweep(settings, store)
    assert got == {"measured": 2, "reclaimed": 1}
    assert not settings.job_dir(old.job_id).exists()
    assert settings.job_dir(recent.job_id).is_dir()
    job = store.jobs.get(old.job_id)
    assert job.run_reclaimed_at is not None
    assert job.storage_bytes == storage.du(settings.finetuned_dir(old.job_id)) > 0
    # the model is served as before; its checkpoint is gone, and says why
    assert target_of(settings, store, "acme", old.model).adapter is not None
    with pytest.raises(NotFound):
        target_of(settings, store, "acme", old.checkpoint)
    ck = store.checkpoints.page(old.job_id, None, 10)[0][0]
    with pytest.raises(NotAvailable, match="retention reclaimed"):
        content_dir(settings, job, ck, "adapter")
    # 0 keeps runs forever
    _ended_long_ago(store, recent.job_id, 3000)
    assert storage.sweep(replace(settings, run_retention_days=0), store)["reclaimed"] == 0
    assert settings.job_dir(recent.job_id).is_dir()


def test_a_deleted_lora_model_takes_its_checkpoints_and_run_with_it(env):
    settings, store = env
    made = lora_model(store, settings.data_dir)
    assert target_of(settings, store, "acme", made.checkpoint).adapter is not None
    delete_model(settings, store, None, "acme", made.model)
    assert not made.export.exists()
    assert not settings.job_dir(made.job_id).exists()
    assert store.jobs.get(made.job_id).storage_bytes == 0
    # before, a deleted LoRA model stayed servable as its checkpoints
    with pytest.raises(NotFound):
        target_of(settings, store, "acme", made.checkpoint)
    job = store.jobs.get(made.job_id)
    ck = store.checkpoints.page(made.job_id, None, 10)[0][0]
    with pytest.raises(NotAvailable, match="model was deleted"):
        content_dir(settings, job, ck, "adapter")


def test_a_deleted_file_takes_the_rows_its_ended_jobs_prepared_from_it(env):
    from service.control.files import delete_file
    from tests.service.test_store import make_file

    settings, store = env
    f = store.files.add(make_file("acme", "train.jsonl"))
    (settings.files_dir / f.storage_name).write_text("{}\n")
    ended = add_job(store, body={"model": "tiny-llama", "training_file": f.id})
    other = add_job(store, body={"model": "tiny-llama", "training_file": "file-other"})
    for job in (ended, other):
        store.jobs.update(job.id, status="succeeded")
        for part in ("data", "tokenizer", "ray"):
            (settings.job_dir(job.id) / part).mkdir(parents=True)
            (settings.job_dir(job.id) / part / "x").write_bytes(b"0" * 100)
    delete_file(settings, store, "acme", f.id)
    assert not (settings.files_dir / f.storage_name).exists()
    run = settings.job_dir(ended.id)
    assert not (run / "data").exists()
    assert not (run / "tokenizer").exists()
    assert (run / "ray" / "x").is_file()  # its checkpoints are the tenant's model, not the file
    assert store.jobs.get(ended.id).storage_bytes == 100
    assert (settings.job_dir(other.id) / "data" / "x").is_file()


def test_retention_days_come_from_the_environment(tmp_path):
    from service.settings import SettingsError

    env = {"PSTAR_DATA_DIR": str(tmp_path)}
    assert Settings.from_env(env).run_retention_days == 30
    assert Settings.from_env({**env, "PSTAR_RUN_RETENTION_DAYS": "0"}).run_retention_days == 0
    assert Settings.from_env({**env, "PSTAR_RUN_RETENTION_DAYS": "7.5"}).run_retention_days == 7.5
    for bad in ("-1", "soon", "inf"):
        with pytest.raises(SettingsError, match="PSTAR_RUN_RETENTION_DAYS"):
            Settings.from_env({**env, "PSTAR_RUN_RETENTION_DAYS": bad})


def test_a_tenants_use_is_asked_of_the_store_once_per_ttl(env):
    settings, store = env
    asked: list[str] = []
    real = store.jobs.storage_bytes

    def counted(tenant: str) -> int:
        asked.append(tenant)
        return real(tenant)

    store.jobs.storage_bytes = counted  # type: ignore[method-assign]
    usage = storage.Usage(settings, store, ttl_s=0.2)
    assert usage.of("acme") == usage.of("acme") == (0, 0)
    assert usage.of("rival") == (0, 0)
    assert asked == ["acme", "rival"]
    time.sleep(0.25)
    usage.of("acme")
    assert asked == ["acme", "rival", "acme"]


def test_a_tenants_session_checkpoints_count_in_its_storage(env):
    settings, store = env
    ckpt = settings.sessions_dir("acme") / "sess-1:train:0" / "weights" / "a"
    ckpt.mkdir(parents=True)
    (ckpt / "engine.bin").write_bytes(b"x" * 1000)
    assert storage.used_bytes(settings, store, "acme") == (0, 1000)
    assert storage.used_bytes(settings, store, "rival") == (0, 0)
