"""Per-tenant quotas and per-job limits, through the API as clients meet them: a job over
a per-job limit is a 400 naming the limit's setting; a tenant at its unfinished-jobs or
storage quota gets 429; nothing refused is stored. Malformed or unbounded uploads are
refused the same way. One server, SQLite, with small limits."""

from __future__ import annotations

import io
import time

import httpx
import openai
import pytest

from service.settings import Limits
from tests.api.conftest import start_api
from tests.api.test_hostile import (
    assert_envelope,
    files_dir_entries,
    post_json,
    stored_files,
    stored_jobs,
)
from tests.tiny import chat_lines

METRICS_TOKEN = "prom-" + "0123456789abcdef"
LIMITS = Limits(
    max_unfinished_jobs_per_tenant=3,
    max_workers_per_job=2,
    max_cpus_per_worker=2.0,
    max_running_workers_per_tenant=4,
    max_running_gpus_per_tenant=1,
    max_file_bytes_per_tenant=48 * 1024,
    max_spill_bytes_per_job=1 << 30,
    max_attempts=4,
    max_event_streams_per_tenant=2,
)


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("limits")
    server, stop = start_api(
        data_dir,
        f"sqlite:///{data_dir / 'store.db'}",
        "sqlite",
        32 * 1024,
        limits=LIMITS,
        metrics_token=METRICS_TOKEN,
    )
    yield server
    stop()


@pytest.fixture(scope="module")
def train_file(api):
    data = ("\n".join(chat_lines(8)) + "\n").encode()
    return api.client().files.create(file=("t.jsonl", io.BytesIO(data)), purpose="fine-tune").id


@pytest.mark.parametrize(
    ("extra", "param", "says"),
    [
        ({"resources": {"num_workers": 3}}, "resources.num_workers", "PSTAR_MAX_WORKERS_PER_JOB"),
        (
            {"resources": {"num_workers": 2, "use_gpu": True}},
            "resources.num_workers",
            "PSTAR_MAX_RUNNING_GPUS_PER_TENANT",
        ),
        (
            {"resources": {"cpus_per_worker": 4}},
            "resources.cpus_per_worker",
            "PSTAR_MAX_CPUS_PER_WORKER",
        ),
        ({"max_attempts": 5}, "max_attempts", "PSTAR_MAX_ATTEMPTS"),
        (
            {"engine": {"memory": {"disk_budget": 10**15}}},
            "engine.memory.disk_budget",
            "PSTAR_MAX_SPILL_BYTES_PER_JOB",
        ),
        (
            {"engine": {"memory": {"disk_budget": 0.5}}},
            "engine.memory.disk_budget",
            "a fraction",
        ),
        # 1.0 is the engine's "all free space", not one byte
        ({"engine": {"memory": {"disk_budget": 1.0}}}, "engine.memory.disk_budget", "a fraction"),
        # the budget is each rank's: two workers at 600 MiB spill 1.2 GiB, over 1 GiB
        (
            {
                "resources": {"num_workers": 2},
                "engine": {"memory": {"disk_budget": 600 << 20}},
            },
            "engine.memory.disk_budget",
            "at most 536870912 per worker",
        ),
    ],
)
def test_a_job_over_a_per_job_limit_is_refused_naming_it_and_stored_nowhere(
    api, train_file, extra, param, says
):
    before = stored_jobs(api)
    r = post_json(
        api, "/fine_tuning/jobs", {"model": "tiny-llama", "training_file": train_file, **extra}
    )
    err = assert_envelope(r, 400, param, "limit_exceeded")
    assert says in err["message"]
    assert stored_jobs(api) == before


def test_a_job_within_the_limits_is_accepted_with_its_spill_budget(api, train_file):
    r = post_json(
        api,
        "/fine_tuning/jobs",
        {
            "model": "tiny-llama",
            "training_file": train_file,
            "resources": {"num_workers": 2, "cpus_per_worker": 2},
            "engine": {"memory": {"disk_budget": 1 << 20}},
            "max_attempts": 4,
        },
    )
    assert r.status_code == 200, r.text
    job = api.store.jobs.get(r.json()["id"])
    assert (job.workers, job.gpus) == (2, 0)
    assert job.plan["engine"]["memory"]["disk_budget"] == 1 << 20
    api.client().fine_tuning.jobs.cancel(job.id)


@pytest.mark.parametrize(
    ("resources", "memory", "param"),
    [
        ({"memory_per_worker": 2 << 30}, {}, "resources.memory_per_worker"),  # under 3 GiB
        # 4 GiB reserved leaves a worker 2 GiB (less max(2 GiB, 10 %)): 3 GiB cannot be
        ({"memory_per_worker": 4 << 30}, {"host_budget": 3 << 30}, "engine.memory.host_budget"),
    ],
)
def test_a_host_budget_past_the_workers_reservation_is_refused(
    api, train_file, resources, memory, param
):
    before = stored_jobs(api)
    body = {"model": "tiny-llama", "training_file": train_file, "resources": resources}
    r = post_json(api, "/fine_tuning/jobs", {**body, "engine": {"memory": memory}})
    err = assert_envelope(r, 400, param)
    assert stored_jobs(api) == before
    if memory:
        assert "2,147,483,648" in err["message"]  # what the reservation leaves a worker


def test_a_reservation_goes_to_ray_and_bounds_the_workers_host_tier(api, train_file):
    from service.spec.job import spec_of
    from service.worker.trainer import per_worker

    r = post_json(
        api,
        "/fine_tuning/jobs",
        {
            "model": "tiny-llama",
            "training_file": train_file,
            "resources": {"memory_per_worker": 6 << 30},
            "engine": {"memory": {"host_budget": 0.5}},
        },
    )
    assert r.status_code == 200, r.text
    spec = spec_of(api.store.jobs.get(r.json()["id"]))
    assert per_worker(spec.resources) == {"CPU": 1.0, "memory": 6 << 30}
    memory = spec.engine_config()["memory"]
    assert (memory["host_reserved"], memory["host_budget"]) == (6 << 30, 0.5)
    api.client().fine_tuning.jobs.cancel(r.json()["id"])


def test_a_tenant_at_its_unfinished_jobs_quota_gets_429_and_another_tenant_does_not(
    api, train_file
):
    c = api.client()
    made = [
        c.fine_tuning.jobs.create(model="tiny-llama", training_file=train_file)
        for _ in range(LIMITS.max_unfinished_jobs_per_tenant)
    ]
    before = stored_jobs(api)
    with pytest.raises(openai.RateLimitError) as e:
        c.fine_tuning.jobs.create(model="tiny-llama", training_file=train_file)
    err = e.value.body
    assert err["code"] == "quota_exceeded"
    assert "3 unfinished jobs" in err["message"]
    assert "PSTAR_MAX_UNFINISHED_JOBS_PER_TENANT" in err["message"]
    assert stored_jobs(api) == before
    # another tenant's share is its own
    rival_file = api.client("rival").files.create(
        file=("r.jsonl", io.BytesIO(("\n".join(chat_lines(4)) + "\n").encode())),
        purpose="fine-tune",
    )
    api.client("rival").fine_tuning.jobs.create(model="tiny-llama", training_file=rival_file.id)
    # a finished job frees its place
    c.fine_tuning.jobs.cancel(made[0].id)
    again = c.fine_tuning.jobs.create(model="tiny-llama", training_file=train_file)
    for j in [*made[1:], again]:
        c.fine_tuning.jobs.cancel(j.id)


def test_uploads_past_the_tenants_storage_quota_get_429_and_leave_nothing(api, train_file):
    c = api.client()
    line = b'{"text": "' + b"x" * 1000 + b'"}\n'
    kept = []
    files, entries = stored_files(api), files_dir_entries(api)
    used = api.store.files.total_bytes("acme")
    while used + 20 * len(line) <= LIMITS.max_file_bytes_per_tenant:
        kept.append(c.files.create(file=("f.jsonl", io.BytesIO(line * 20)), purpose="fine-tune"))
        used = api.store.files.total_bytes("acme")
    with pytest.raises(openai.RateLimitError) as e:
        c.files.create(file=("f.jsonl", io.BytesIO(line * 20)), purpose="fine-tune")
    assert e.value.body["code"] == "quota_exceeded"
    assert f"stores {used:,} bytes" in e.value.body["message"]
    assert "PSTAR_MAX_FILE_BYTES_PER_TENANT" in e.value.body["message"]
    assert stored_files(api) == files | {f.id for f in kept}
    assert files_dir_entries(api) == entries | {f.id for f in kept}
    for f in kept:
        c.files.delete(f.id)
    c.files.create(file=("f.jsonl", io.BytesIO(line * 20)), purpose="fine-tune")  # room again


def _multipart(parts: list[tuple[dict[str, str], bytes]], boundary: str = "b0und") -> bytes:
    out = b""
    for headers, body in parts:
        out += f"--{boundary}\r\n".encode()
        for k, v in headers.items():
            out += f"{k}: {v}\r\n".encode()
        out += b"\r\n" + body + b"\r\n"
    return out + f"--{boundary}--\r\n".encode()


FILE = {"Content-Disposition": 'form-data; name="file"; filename="a.jsonl"'}
PURPOSE = ({"Content-Disposition": 'form-data; name="purpose"'}, b"fine-tune")


@pytest.mark.parametrize(
    ("parts", "status", "says"),
    [
        ([PURPOSE, (FILE, b'{"text": "a"}\n')] + [PURPOSE] * 8, 400, "more than 8 parts"),
        ([PURPOSE, ({**FILE, "X-Pad": "y" * 9000}, b'{"text": "a"}\n')], 400, "header"),
        (
            [PURPOSE, ({**FILE, **{f"X-{i}": "v" for i in range(20)}}, b'{"text": "a"}\n')],
            400,
            "header",  # python-multipart's own count limit comes before ours
        ),
        # the second file part is refused, and its bytes count toward the size limit
        ([PURPOSE, (FILE, b'{"text": "a"}\n'), (FILE, b"z" * 40_000)], 413, "upload limit"),
    ],
)
def test_an_unbounded_multipart_body_is_refused_and_leaves_nothing(api, parts, status, says):
    # tenant rival stores almost nothing: the upload limit, not its quota, is what binds
    files, entries = stored_files(api, "rival"), files_dir_entries(api)
    r = httpx.post(
        f"{api.base}/files",
        content=_multipart(parts),
        headers={**api.headers("rival"), "Content-Type": "multipart/form-data; boundary=b0und"},
    )
    err = assert_envelope(r, status)
    assert says in err["message"]
    assert (stored_files(api, "rival"), files_dir_entries(api)) == (files, entries)


def test_a_chunked_body_without_a_length_is_capped(api):
    files, entries = stored_files(api), files_dir_entries(api)

    def body():
        yield _multipart([PURPOSE, (FILE, b"")])[:-12]  # the file part left open
        for _ in range(200):
            yield b'{"text": "' + b"q" * 1000 + b'"}\n'

    r = httpx.post(
        f"{api.base}/files",
        content=body(),
        headers={**api.headers(), "Content-Type": "multipart/form-data; boundary=b0und"},
    )
    assert r.status_code in (413, 429), r.text
    assert (stored_files(api), files_dir_entries(api)) == (files, entries)


def test_partial_uploads_left_by_a_crash_are_swept_and_fresh_ones_kept(api, tmp_path):
    import os
    import time

    from service.control.files import sweep_partial_uploads

    old = api.settings.files_dir / ".file-dead.part"
    fresh = api.settings.files_dir / ".file-live.part"
    old.write_bytes(b"x")
    fresh.write_bytes(b"y")
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    assert sweep_partial_uploads(api.settings) == 1
    assert (old.exists(), fresh.exists()) == (False, True)
    fresh.unlink()


def test_prometheus_token_counts_every_tenants_jobs_and_opens_nothing_else(api, train_file):
    c = api.client()
    job = c.fine_tuning.jobs.create(model="tiny-llama", training_file=train_file)
    prom = {"Authorization": f"Bearer {METRICS_TOKEN}"}
    # the reconciler moves the new job on (validating_files -> queued) at any moment: a
    # scrape is compared with counts that held both before and after it
    for _ in range(50):
        every = api.store.jobs.count_by_status()
        text = httpx.get(api.url + "/metrics", headers=prom).text
        if api.store.jobs.count_by_status() == every:
            break
    mine = api.store.jobs.count_by_status("acme")
    assert every != mine  # rival has jobs too (an earlier test made one)
    for status, n in every.items():
        assert f'pstar_jobs{{status="{status}"}} {float(n)}' in text, text
    assert 'pstar_jobs{status="paused"}' in text  # every status has its line
    assert httpx.get(api.base + "/files", headers=prom).status_code == 401
    c.fine_tuning.jobs.cancel(job.id)


def test_event_streams_past_the_tenants_limit_get_429_and_a_closed_one_frees_its_place(
    api, train_file
):
    c = api.client()
    job = c.fine_tuning.jobs.create(model="tiny-llama", training_file=train_file)
    url = f"{api.base}/fine_tuning/jobs/{job.id}/events/stream"
    with httpx.Client(timeout=30) as http:
        opened = [http.stream("GET", url, headers=api.headers()) for _ in range(2)]
        responses = [s.__enter__() for s in opened]
        assert [r.status_code for r in responses] == [200, 200]
        # it streams (the iterator is kept: dropping it would close the stream)
        lines = responses[0].iter_lines()
        assert next(lines).startswith("id: ")
        err = assert_envelope(http.get(url, headers=api.headers()), 429, code="too_many_streams")
        assert "2 streams open" in err["message"]
        logs = http.get(
            f"{api.base}/fine_tuning/jobs/{job.id}/logs?follow=true", headers=api.headers()
        )
        assert logs.status_code == 429
        # another tenant's streams are counted apart
        assert http.get(url, headers=api.headers("rival")).status_code == 404
        opened[0].__exit__(None, None, None)
        for _ in range(100):  # the server notices the disconnect at its next poll
            third = http.stream("GET", url, headers=api.headers())
            r = third.__enter__()
            if r.status_code == 200:
                break
            third.__exit__(None, None, None)
            time.sleep(0.1)
        assert r.status_code == 200
        third.__exit__(None, None, None)
        opened[1].__exit__(None, None, None)
    c.fine_tuning.jobs.cancel(job.id)


def test_a_tenant_whose_ended_runs_fill_its_storage_gets_429_for_a_new_job(
    api, train_file, monkeypatch
):
    # what the tenant's ended jobs keep, as the sweep measured it (service.control.storage),
    # asked of the store now (the service keeps a tenant's use for 10 s)
    full = Limits().max_storage_bytes_per_tenant
    monkeypatch.setattr(api.store.jobs, "storage_bytes", lambda tenant: full)
    monkeypatch.setattr(api.ctx.jobs.usage, "ttl_s", 0.0)
    before = stored_jobs(api)
    r = post_json(api, "/fine_tuning/jobs", {"model": "tiny-llama", "training_file": train_file})
    err = assert_envelope(r, 429, None, "storage_quota_exceeded")
    assert "PSTAR_MAX_STORAGE_BYTES_PER_TENANT" in err["message"]
    assert "DELETE /v1/models/{model}" in err["message"]
    assert stored_jobs(api) == before
