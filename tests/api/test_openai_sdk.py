"""The API through the unmodified `openai` SDK, on SQLite and PostgreSQL: files, models,
job create/list/retrieve/cancel/events/checkpoints, idempotency, tenants, tokens.
(The launcher here is dry: jobs are submitted as Ray jobs that never run; the Ray tests
run them for real.)"""

from __future__ import annotations

import io
import time

import httpx
import openai
import pytest

from tests.tiny import chat_lines


def upload(client, lines: list[str], name: str = "train.jsonl"):
    data = ("\n".join(lines) + "\n").encode()
    return client.files.create(file=(name, io.BytesIO(data)), purpose="fine-tune")


def wait_submitted(client, job_id: str, timeout: float = 10.0):
    """The job once the reconciler has queued it and submitted attempt 1."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        job = client.fine_tuning.jobs.retrieve(job_id)
        if job.status == "queued" and job.model_extra["attempt"] == 1:
            return job
        time.sleep(0.05)
    raise AssertionError(f"job {job_id} stayed {job.status}, attempt {job.model_extra['attempt']}")


def test_upload_is_validated_counted_and_checksummed(api):
    import hashlib

    c = api.client()
    lines = chat_lines(12)
    f = upload(c, lines)
    body = ("\n".join(lines) + "\n").encode()
    assert f.id.startswith("file-")
    assert (f.bytes, f.purpose, f.status, f.filename) == (
        len(body),
        "fine-tune",
        "processed",
        "train.jsonl",
    )
    assert f.model_extra["examples"] == 12
    assert f.model_extra["format"] == "chat"
    assert f.model_extra["sha256"] == hashlib.sha256(body).hexdigest()
    assert c.files.retrieve(f.id).id == f.id
    assert f.id in [x.id for x in c.files.list()]
    # stored under the id the server chose, byte for byte
    assert (api.settings.files_dir / f.id).read_bytes() == body
    assert httpx.get(f"{api.base}/files/{f.id}/content", headers=api.headers()).content == body


def test_models_lists_base_zoo_and_retrieves_one(api):
    c = api.client()
    ids = {m.id: m for m in c.models.list()}
    assert ids["tiny-llama"].model_extra["kind"] == "base"
    assert ids["gpt-tiny"].model_extra["kind"] == "zoo"
    assert c.models.retrieve("tiny-llama").id == "tiny-llama"
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("no-such-model")


def test_create_resolves_auto_and_the_job_is_queued_and_submitted_to_ray(api):
    c = api.client()
    f = upload(c, chat_lines(20))
    job = c.fine_tuning.jobs.create(
        model="tiny-llama",
        training_file=f.id,
        suffix="mine",
        seed=7,
        metadata={"team": "blue"},
        method={"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 2}}},
        extra_body={"resources": {"num_workers": 2}, "hyperparameters": None, "max_attempts": 2},
    )
    assert job.status == "validating_files"
    assert job.hyperparameters.n_epochs == 2
    assert job.hyperparameters.batch_size == 8  # auto: 8, a multiple of the 2 workers
    assert job.hyperparameters.learning_rate_multiplier == 1.0
    assert (job.seed, job.metadata, job.model) == (7, {"team": "blue"}, "tiny-llama")
    job = wait_submitted(c, job.id)
    assert f"{job.id}-a1" in api.launcher.submitted  # the deterministic submission id
    messages = [e.message for e in c.fine_tuning.jobs.list_events(job.id)]
    assert messages[-1].startswith("Created fine-tuning job")  # newest first
    assert any("Attempt 1 submitted" in m for m in messages)


def test_list_pages_with_after_and_limit_and_filters_by_status(api):
    c = api.client()
    f = upload(c, chat_lines(8))
    made = [c.fine_tuning.jobs.create(model="gpt-tiny", training_file=f.id).id for _ in range(3)]
    page = c.fine_tuning.jobs.list(limit=2)
    assert [j.id for j in page.data] == made[::-1][:2]
    assert page.has_more
    rest = c.fine_tuning.jobs.list(limit=2, after=page.data[-1].id)
    assert rest.data[0].id == made[0]
    every = [j.id for j in c.fine_tuning.jobs.list(limit=2)]  # iterating pages on
    assert every[:3] == made[::-1]
    c.fine_tuning.jobs.cancel(made[1])
    cancelled = c.fine_tuning.jobs.list(extra_query={"status": "cancelled"}).data
    assert made[1] in [j.id for j in cancelled]
    assert all(j.status == "cancelled" for j in cancelled)


def test_cancel_stops_the_ray_job_and_a_second_cancel_is_a_conflict(api):
    c = api.client()
    f = upload(c, chat_lines(8))
    job = c.fine_tuning.jobs.create(model="gpt-tiny", training_file=f.id)
    wait_submitted(c, job.id)
    done = c.fine_tuning.jobs.cancel(job.id)
    assert done.status == "cancelled"
    assert done.finished_at is not None
    assert f"{job.id}-a1" in api.launcher.stopped
    with pytest.raises(openai.ConflictError) as err:
        c.fine_tuning.jobs.cancel(job.id)
    assert "cancelled" in str(err.value)
    time.sleep(0.3)  # the reconciler must not revive it
    assert c.fine_tuning.jobs.retrieve(job.id).status == "cancelled"


def test_a_retried_create_with_the_same_key_returns_the_same_job(api):
    c = api.client()
    f = upload(c, chat_lines(8))
    key = {"Idempotency-Key": f"retry-{api.backend}"}
    a = c.fine_tuning.jobs.create(model="gpt-tiny", training_file=f.id, extra_headers=key)
    b = c.fine_tuning.jobs.create(model="gpt-tiny", training_file=f.id, extra_headers=key)
    assert a.id == b.id
    with pytest.raises(openai.ConflictError) as err:
        c.fine_tuning.jobs.create(model="gpt-tiny", training_file=f.id, seed=3, extra_headers=key)
    assert "different request body" in str(err.value)
    # the same key is another tenant's own business
    g = upload(api.client("rival"), chat_lines(8))
    other = api.client("rival").fine_tuning.jobs.create(
        model="gpt-tiny", training_file=g.id, extra_headers=key
    )
    assert other.id != a.id


def test_tenants_see_only_their_own_objects(api):
    mine, theirs = api.client("acme"), api.client("rival")
    f = upload(mine, chat_lines(8))
    job = mine.fine_tuning.jobs.create(model="gpt-tiny", training_file=f.id)
    with pytest.raises(openai.NotFoundError):
        theirs.files.retrieve(f.id)
    with pytest.raises(openai.NotFoundError):
        theirs.fine_tuning.jobs.retrieve(job.id)
    with pytest.raises(openai.NotFoundError):
        theirs.fine_tuning.jobs.cancel(job.id)
    with pytest.raises(openai.NotFoundError):
        theirs.fine_tuning.jobs.list_events(job.id)
    with pytest.raises(openai.NotFoundError):
        theirs.fine_tuning.jobs.checkpoints.list(job.id)
    with pytest.raises(openai.NotFoundError):
        theirs.files.delete(f.id)
    assert f.id not in [x.id for x in theirs.files.list()]
    assert job.id not in [j.id for j in theirs.fine_tuning.jobs.list()]
    # training on another tenant's file: refused, nothing stored
    before = len(theirs.fine_tuning.jobs.list().data)
    with pytest.raises(openai.BadRequestError) as err:
        theirs.fine_tuning.jobs.create(model="gpt-tiny", training_file=f.id)
    assert err.value.body["param"] == "training_file"
    assert len(theirs.fine_tuning.jobs.list().data) == before


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer wrong-token-123"}, {"Authorization": "Basic abc"}],
)
def test_every_route_but_health_needs_a_token(api, headers):
    for method, path in (
        ("GET", "/v1/files"),
        ("POST", "/v1/files"),
        ("GET", "/v1/models"),
        ("GET", "/v1/fine_tuning/jobs"),
        ("POST", "/v1/fine_tuning/jobs"),
        ("GET", "/v1/fine_tuning/jobs/ftjob-x/events"),
        ("GET", "/metrics"),
    ):
        r = httpx.request(method, api.url + path, headers=headers)
        assert r.status_code == 401, (method, path)
        assert r.json()["error"]["code"] == "invalid_api_key"
        assert r.headers["www-authenticate"] == "Bearer"
    assert httpx.get(api.url + "/healthz").status_code == 200
    assert httpx.get(api.url + "/readyz").json()["checks"] == {"store": "ok", "ray": "ok"}
    # the API's documentation is public (PSTAR_API_DOCS=off removes it; see test_settings)
    assert httpx.get(api.url + "/openapi.json").json()["info"]["title"] == "PatrickStar Service"
    bad = api.client()
    bad.api_key = "wrong-token-123"
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_deleting_a_file_in_use_is_refused_and_a_free_one_goes(api):
    c = api.client()
    f = upload(c, chat_lines(8))
    job = c.fine_tuning.jobs.create(model="gpt-tiny", training_file=f.id)
    with pytest.raises(openai.ConflictError):
        c.files.delete(f.id)
    c.fine_tuning.jobs.cancel(job.id)
    assert c.files.delete(f.id).deleted
    assert not (api.settings.files_dir / f.id).exists()
    with pytest.raises(openai.NotFoundError):
        c.files.retrieve(f.id)


def test_checkpoints_metrics_and_memory_of_a_job_not_started_are_empty(api):
    c = api.client()
    f = upload(c, chat_lines(8))
    job = c.fine_tuning.jobs.create(model="gpt-tiny", training_file=f.id)
    assert c.fine_tuning.jobs.checkpoints.list(job.id).data == []
    m = httpx.get(f"{api.base}/fine_tuning/jobs/{job.id}/metrics", headers=api.headers()).json()
    assert m["series"] == {}
    mem = httpx.get(f"{api.base}/fine_tuning/jobs/{job.id}/memory", headers=api.headers()).json()
    assert mem["available"] is False
    assert mem["moments"] == 0


def test_prometheus_metrics_count_requests_and_jobs(api):
    c = api.client()
    c.models.list()
    text = httpx.get(api.url + "/metrics", headers=api.headers()).text
    assert 'pstar_http_requests_total{method="GET",route="/v1/models",status="200"}' in text, text
    # a tenant counts its own jobs only. Jobs earlier tests left behind still move
    # (validating_files -> queued) while we look, so compare with the store's counts
    # only when they were the same just before and just after the scrape.
    for tenant in ("acme", "rival"):
        deadline = time.monotonic() + 30
        while True:
            before = api.store.jobs.count_by_status(tenant)
            text = httpx.get(api.url + "/metrics", headers=api.headers(tenant)).text
            if api.store.jobs.count_by_status(tenant) == before or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        for status in ("queued", "cancelled"):
            line = f'pstar_jobs{{status="{status}"}} {float(before.get(status, 0))}'
            assert line in text, text


@pytest.mark.parametrize("part", ["store", "ray"])
def test_readyz_is_503_naming_the_part_that_does_not_answer(api, monkeypatch, part):
    from service.errors import Unavailable

    fresh = httpx.get(api.url + "/readyz", headers=api.headers())  # a token: asked now
    assert fresh.json()["checks"] == {"store": "ok", "ray": "ok"}

    def down() -> None:
        raise Unavailable(f"{part} is down (test)")

    monkeypatch.setattr(api.store if part == "store" else api.launcher, "ping", down)
    rep = httpx.get(api.url + "/readyz", headers=api.headers())
    assert rep.status_code == 503
    body = rep.json()
    assert body["status"] == "unavailable"
    assert body["checks"][part] == f"unavailable: {part} is down (test)"
    other = "ray" if part == "store" else "store"
    assert body["checks"][other] == "ok"
    # a probe without a token learns that, and nothing of why or where
    anon = httpx.get(api.url + "/readyz")
    assert anon.status_code == 503
    assert anon.json()["checks"] == {part: "unavailable", other: "ok"}
    assert anon.json()["ray_dashboard_url"] is None
    assert httpx.get(api.url + "/healthz").status_code == 200  # the process still answers


def test_anonymous_probes_are_answered_from_the_last_check_for_2_s(api, monkeypatch):
    """A flood of probes costs the store and Ray one check per 2 s, not one each: an
    anonymous probe gets the last check's answer; a caller with a token a fresh one."""
    from service.errors import Unavailable

    t0 = time.monotonic()
    assert httpx.get(api.url + "/readyz", headers=api.headers()).status_code == 200

    def down() -> None:
        raise Unavailable("store is down (test)")

    monkeypatch.setattr(api.store, "ping", down)
    anon = [httpx.get(api.url + "/readyz").status_code for _ in range(10)]
    if time.monotonic() - t0 < 2.0:  # all within the 2 s: none of them asked the store
        assert anon == [200] * 10
    assert httpx.get(api.url + "/readyz", headers=api.headers()).status_code == 503
    # that fresh check is what the next probe is told
    assert httpx.get(api.url + "/readyz").status_code == 503


def test_validate_reports_data_and_fit_and_stores_nothing(api):
    c = api.client()
    f = upload(c, chat_lines(16))
    before = len(c.fine_tuning.jobs.list(limit=100).data)
    r = httpx.post(
        f"{api.base}/fine_tuning/jobs/validate",
        headers=api.headers(),
        json={"model": "tiny-llama", "training_file": f.id, "resources": {"num_workers": 2}},
    )
    assert r.status_code == 200, r.text
    rep = r.json()
    data = rep["data"]["training_file"]
    assert data["examples"] == 16
    assert data["rows"] == 16
    assert data["truncated_examples"] == 0
    assert rep["data"]["seq_len"] % 16 == 0
    assert rep["data"]["seq_len"] >= data["longest_example_tokens"]
    est = rep["estimate"]
    assert est["steps"] == rep["data"]["total_steps"] == 2 * 7  # 16 rows / 8, 7 epochs (auto)
    per_rank = est["per_rank"]
    assert per_rank["workers"] == 2
    assert per_rank["chunk_bytes"] * 2 == est["chunk_plan"]["chunk_bytes"]
    assert rep["fits"] is True
    assert est["overflow"] is None
    # a host budget below a rank's chunks: does not fit, and says by how much
    r = httpx.post(
        f"{api.base}/fine_tuning/jobs/validate",
        headers=api.headers(),
        json={
            "model": "tiny-llama",
            "training_file": f.id,
            "engine": {"memory": {"host_budget": 1000}},
        },
    )
    rep = r.json()
    assert rep["fits"] is False
    assert rep["estimate"]["overflow"]["tier"] == "host"
    assert rep["estimate"]["overflow"]["bytes"] == rep["estimate"]["per_rank"]["chunk_bytes"] - 1000
    assert len(c.fine_tuning.jobs.list(limit=100).data) == before


def test_validate_reads_a_bounded_sample_and_scales_the_steps_to_the_whole_file(api, monkeypatch):
    """The dry run runs in the API process: it tokenizes the first examples only, says so,
    and counts the job's steps on the whole file."""
    from service.control import estimate

    monkeypatch.setattr(estimate, "SAMPLE_EXAMPLES", 8)
    f = upload(api.client(), chat_lines(40))
    r = httpx.post(
        f"{api.base}/fine_tuning/jobs/validate",
        headers=api.headers(),
        json={"model": "tiny-llama", "training_file": f.id},
    )
    assert r.status_code == 200, r.text
    rep = r.json()
    assert rep["data"]["sampled"] == {"examples": 8, "of": 40}
    assert rep["data"]["training_file"]["examples"] == 8
    # 40 rows of 8 a step (batch "auto"), 3 epochs ("auto" for 40 examples): 5 x 3, not 1 x 3
    assert rep["estimate"]["steps"] == 15


def test_validate_plans_each_rank_per_tier_and_names_the_smallest_change_that_fits(api):
    """The dry run carries the capacity planner's plan (the same as `pstar plan`): each
    list per tier at start and one iteration's forecast. A device budget below what an
    iteration needs does not fit, says so, and names the smallest change that would; the
    job with that change validates as fitting."""
    c = api.client()
    f = upload(c, chat_lines(16))

    def validate(**body):
        r = httpx.post(
            f"{api.base}/fine_tuning/jobs/validate",
            headers=api.headers(),
            json={"model": "tiny-llama", "training_file": f.id, **body},
        )
        assert r.status_code == 200, r.text
        return r.json()

    roomy = validate(hyperparameters={"batch_size": 8})
    rank = roomy["estimate"]["per_rank"]
    it = rank["iteration"]
    assert roomy["fits"] is True
    assert it["least_device_bytes"] > it["non_model_peak_bytes"] > 0
    assert it["device_peak_bytes"] >= it["least_device_bytes"]
    # every chunk of the rank is somewhere at start, on the host here
    at_start = rank["lists_at_start"]
    assert sum(sum(row.values()) for row in at_start.values()) == rank["chunk_bytes"]
    assert roomy["estimate"]["non_model_bytes"] == it["non_model_peak_bytes"]

    # a device budget between what batch 1 and batch 8 need: only a smaller batch fits
    need_8 = it["least_device_bytes"]
    one = validate(hyperparameters={"batch_size": 1})["estimate"]["per_rank"]["iteration"]
    assert one["least_device_bytes"] < need_8
    budget = (one["least_device_bytes"] + need_8) // 2
    tight = validate(
        hyperparameters={"batch_size": 8}, engine={"memory": {"device_budget": budget}}
    )
    assert tight["fits"] is False
    assert tight["estimate"]["overflow"]["tier"] == "device"
    assert tight["estimate"]["overflow"]["bytes"] == need_8 - budget
    assert any("activation_checkpointing" in p for p in tight["problems"])
    change = tight["estimate"]["smallest_change"]
    assert change["change"] in ("activation_checkpointing", "batch")
    if change["change"] == "batch":
        fixed = validate(
            hyperparameters={"batch_size": change["value"]},
            engine={"memory": {"device_budget": budget}},
        )
    else:
        fixed = validate(
            hyperparameters={"batch_size": 8},
            engine={"memory": {"device_budget": budget}, "activation_checkpointing": True},
        )
    assert fixed["fits"] is True
