"""The service end to end on a real local Ray: `pstar serve` as users start it (its own Ray
head), driven through the unmodified `openai` SDK. Jobs train a tiny Llama on 2 Ray Train
workers with chunk ZeRO (gloo). One Ray head serves the whole module: the SIGKILL test
re-attaches to it; the graceful restart (last) stops it and starts another.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from pstar_core.hf import load_causal_lm
from tests.served import (
    RIVAL_TOKEN,
    TINKER_TOKEN,
    TOKEN,
    Serve,
    create_job,
    start_serve,
    stop_serve,
    upload_chat_files,
    wait_for,
)
from tests.tiny import chat_lines, make_tiny_llama

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def serve(tmp_path_factory):
    s = start_serve(tmp_path_factory.mktemp("svc"))
    yield s
    stop_serve(s)


@pytest.fixture(scope="module")
def files(serve):
    return upload_chat_files(serve)


def create(serve, files, steps: int, **extra):
    return create_job(serve, files, steps, **extra)


def _auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKEN}"}


def store_of(serve):
    from service.store import Store

    return Store(f"sqlite:///{serve.data_dir / 'store.db'}")


def metric_steps(serve, job_id: str) -> list[int]:
    return [p.step for p in store_of(serve).events.metric_points(job_id)]


def events(client, job_id: str):
    return list(client.fine_tuning.jobs.list_events(job_id, limit=100))[::-1]


def checkpoint_at(serve, job_id: str, step: int):
    c = serve.client()
    return any(ck.step_number >= step for ck in c.fine_tuning.jobs.checkpoints.list(job_id))


def test_the_local_ray_head_answers_no_one_without_its_token(serve):
    head = json.loads((serve.data_dir / "ray" / "head.json").read_text())
    token_file = serve.data_dir / "ray" / "auth_token"
    assert token_file.stat().st_mode & 0o777 == 0o600  # its owner's only
    # what `/readyz` gives a tenant is an address, not a way in
    ray_url = httpx.get(serve.url + "/readyz", headers=_auth()).json()["ray_dashboard_url"]
    assert ray_url == head["dashboard_url"]
    anonymous = httpx.get(ray_url + "/api/jobs/")
    assert anonymous.status_code == 401, anonymous.text
    wrong = httpx.get(ray_url + "/api/jobs/", headers={"Authorization": "Bearer " + "0" * 64})
    assert wrong.status_code == 403, wrong.text
    token = token_file.read_text().strip()
    ok = httpx.get(ray_url + "/api/jobs/", headers={"Authorization": f"Bearer {token}"})
    assert ok.status_code == 200, ok.text
    # the head advertises loopback; its GCS listens beyond it (Ray has no setting for
    # that), and refuses a Ray client without the token
    assert head["gcs_address"].startswith("127.0.0.1:")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    code = f"import ray; ray.init(address={head['gcs_address']!r})"
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode != 0
    assert "token-auth" in out.stderr, out.stderr[-2000:]


def test_a_training_sessions_engine_runs_in_a_ray_actor_on_the_servers_own_head(serve):
    """The service's default for Tinker's training models (PSTAR_SESSION_ENGINES unset):
    the engine in a Ray actor on `pstar serve`'s head, which the API reaches through Ray's
    client with the head's token (its process is no Ray driver). It trains through the
    unmodified SDK, the dashboard's listing says where it runs, and the actor is gone once
    the session is finished."""
    import tinker

    from service import ray_auth

    head = json.loads((serve.data_dir / "ray" / "head.json").read_text())

    def actors(name: str) -> list[str]:
        r = httpx.get(
            f"{head['dashboard_url']}/api/v0/actors",
            params={"filter_keys": "name", "filter_predicates": "=", "filter_values": name},
            headers=ray_auth.headers(serve.ray_env()),
            timeout=60,
        )
        r.raise_for_status()
        return [a["state"] for a in r.json()["data"]["result"]["result"]]

    seq = [5, 9, 14, 3, 22, 7, 11]
    datum = tinker.types.Datum(
        model_input=tinker.types.ModelInput.from_ints(seq[:-1]),
        loss_fn_inputs={"target_tokens": seq[1:], "weights": [1.0] * (len(seq) - 1)},
    )
    with tinker.ServiceClient(base_url=serve.url, api_key=TINKER_TOKEN) as sc:
        tc = sc.create_lora_training_client(base_model="tiny-llama", rank=4, seed=0).result()
        losses = []
        for _ in range(3):
            out = tc.forward_backward([datum], "cross_entropy").result()
            losses.append(out.metrics["loss:sum"])
            tc.optim_step(tinker.types.AdamParams(learning_rate=1e-2)).result()
        assert losses[2] < losses[0], losses
        listed = httpx.get(serve.url + "/v1/training_sessions", headers=_auth()).json()
        (model,) = [m for s in listed["data"] for m in s["models"] if m["id"] == tc.model_id]
        name = f"session-engine {tc.model_id}"
        assert model["where"] == f"Ray actor '{name}'"
        assert actors(name) == ["ALIVE"]
    wait_for(lambda: actors(name) == ["DEAD"], 60, "the engine's actor to end")


def test_a_job_succeeds_across_a_sigkill_of_the_control_plane_without_running_twice(serve, files):
    c = serve.client()
    job = create(serve, files, steps=60)
    wait_for(lambda: checkpoint_at(serve, job.id, 10), 240, "the first checkpoint")
    # while it trains: running, in a named phase, with progress out of the total
    live = c.fine_tuning.jobs.retrieve(job.id)
    assert live.status == "running"
    assert live.model_extra["status_detail"] in ("training", "evaluating", "checkpointing")
    assert live.model_extra["progress"]["total"] == 60
    assert 10 <= live.model_extra["progress"]["step"] <= 60
    assert live.estimated_finish is not None
    head = serve.head_pid()
    serve.kill9()
    # the control plane is gone; the Ray job keeps training and reporting to the store
    reached = metric_steps(serve, job.id)[-1]
    wait_for(lambda: metric_steps(serve, job.id)[-1] > reached, 60, "progress while down")
    serve.start()
    assert serve.head_pid() == head  # re-attached to the same head, not a new one
    done = wait_for(
        lambda: (j := c.fine_tuning.jobs.retrieve(job.id)).status in ("succeeded", "failed") and j,
        300,
        "the job to end",
    )
    assert done.status == "succeeded", done.error
    assert done.model_extra["attempt"] == 1  # one Ray job: nothing ran twice
    assert done.fine_tuned_model == f"ft:tiny-llama:e2e:{job.id}"
    assert done.trained_tokens
    assert done.trained_tokens > 0
    # events are continuous: every step once, in order, from before the kill to the end
    assert metric_steps(serve, job.id) == list(range(0, 61))
    ev = events(c, job.id)
    steps = [e.data["step"] for e in ev if e.type == "metrics"]
    assert steps == list(range(0, 61))
    msgs = [e.message for e in ev if e.type == "message"]
    assert msgs[0].startswith("Created fine-tuning job")
    assert sum(m.startswith("Attempt") for m in msgs) == 1
    assert msgs[-1].startswith("The job has successfully completed")
    assert done.model_extra["status_detail"] is None
    assert done.model_extra["progress"] == {"step": 60, "total": 60}
    # metrics events carry OpenAI's fields: the training numbers every step, valid_loss
    # every eval_every (10) steps, the whole validation file before and at the end
    by_step = {e.data["step"]: e.data for e in ev if e.type == "metrics"}
    first = by_step[0]
    for step in range(1, 61):
        assert {"train_loss", "train_mean_token_accuracy", "tokens_per_second"} <= set(
            by_step[step]
        ), by_step[step]
    assert [k for k in sorted(by_step) if "valid_loss" in by_step[k]] == list(range(0, 60, 10))
    assert [k for k in sorted(by_step) if "full_valid_loss" in by_step[k]] == [0, 60]
    # checkpoints: the newest three plus the final one, with metrics
    cks = list(c.fine_tuning.jobs.checkpoints.list(job.id))
    assert [ck.step_number for ck in cks] == [60, 50, 40, 30]
    final = cks[0]
    assert final.model_extra["final"] is True
    assert final.metrics.full_valid_loss < first["full_valid_loss"]  # it learned
    assert final.metrics.full_valid_loss == by_step[60]["full_valid_loss"]
    assert final.fine_tuned_model_checkpoint == f"{done.fine_tuned_model}:ckpt-step-60"
    # the fine-tuned model is listed and loads with transformers
    assert done.fine_tuned_model in [m.id for m in c.models.list()]
    assert c.models.retrieve(done.fine_tuned_model).owned_by == "acme"
    # ... and another tenant sees nothing of it: not the model, the job or its result file
    rival = serve.client(RIVAL_TOKEN)
    assert done.fine_tuned_model not in [m.id for m in rival.models.list()]
    with pytest.raises(openai.NotFoundError):
        rival.models.retrieve(done.fine_tuned_model)
    with pytest.raises(openai.NotFoundError):
        rival.fine_tuning.jobs.retrieve(job.id)
    with pytest.raises(openai.NotFoundError):
        rival.files.content(done.result_files[0])
    from transformers import AutoTokenizer

    export = serve.data_dir / "models" / ".ft" / job.id
    model = load_causal_lm(export)
    tok = AutoTokenizer.from_pretrained(export)
    enc = tok.apply_chat_template(
        [{"role": "user", "content": "What does apple mean?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    assert model(**enc).logits.isfinite().all()
    # the result file is OpenAI's metrics CSV, one row per step
    csv_text = c.files.content(done.result_files[0]).text
    rows = list(csv.DictReader(io.StringIO(csv_text)))
    assert csv_text.startswith("step,train_loss")
    assert [int(r["step"]) for r in rows] == list(range(0, 61))
    assert float(rows[-1]["full_valid_loss"]) == by_step[60]["full_valid_loss"]
    assert float(rows[10]["valid_loss"]) == by_step[10]["valid_loss"]
    # ours: metric series, the tracer timeline, logs
    h = {"Authorization": f"Bearer {TOKEN}"}
    series = httpx.get(f"{serve.url}/v1/fine_tuning/jobs/{job.id}/metrics", headers=h).json()[
        "series"
    ]
    assert series["train_loss"]["steps"] == list(range(1, 61))
    for name in ("lr", "step_time_s", "tflops", "tokens_per_second", "peak_non_model_bytes"):
        assert series[name]["steps"] == list(range(1, 61)), name
        assert all(v > 0 for v in series[name]["values"]), name
    assert series["valid_loss"]["steps"] == list(range(0, 60, 10))
    moved = [k for k in series if k.startswith("bytes_moved_")]
    assert moved  # per direction, e.g. bytes_moved_host_to_device
    tiers = zip(
        series["model_data_bytes_device"]["values"],
        series["model_data_bytes_host"]["values"],
        strict=True,
    )
    assert all(dev + host > 0 for dev, host in tiers)  # model data lives on some tier
    assert all(v > 0 for v in series["tokens_per_second"]["values"])
    assert series["comm_bytes_sent"]["values"][-1] > 0  # chunk ZeRO between the 2 workers
    mem = httpx.get(f"{serve.url}/v1/fine_tuning/jobs/{job.id}/memory", headers=h).json()
    assert mem["available"]
    assert mem["moments"] == len(mem["names"]) == len(mem["non_model_bytes"]) > 10
    assert mem["peak_non_model_bytes"] == max(mem["non_model_bytes"]) > 0
    assert len(mem["chunk_bytes"]) == len(mem["chunk_allowance_bytes"]) == mem["moments"]
    assert len(mem["chunk_peak_bytes"]) == mem["moments"]
    assert all(p >= c for p, c in zip(mem["chunk_peak_bytes"], mem["chunk_bytes"], strict=True))
    assert mem["peak_device_bytes"] >= mem["peak_non_model_bytes"]
    budget, nm = mem["device_budget_bytes"], mem["non_model_bytes"]
    assert budget == mem["tiers"]["device"]["budget"] > 0
    j = nm.index(mem["peak_non_model_bytes"])  # A_j = budget - max(N_j, N_j+1)
    assert mem["chunk_allowance_bytes"][j] == max(0, budget - max(nm[j : j + 2]))
    logs = httpx.get(f"{serve.url}/v1/fine_tuning/jobs/{job.id}/logs", headers=h, timeout=60).text
    assert f"Ray job {job.id}-a1" in logs
    assert "succeeded" in logs
    # the data was tokenized in a Ray task shaped like one of the job's workers (its CPU),
    # in a worker process: not in the driver, which runs on the head
    (task,) = serve.ray_tasks(f"prepare {job.id}")
    assert task["state"] == "FINISHED"
    assert task["required_resources"] == {"CPU": 1.0}
    driver = [j for j in serve.ray_jobs().list_jobs() if j.submission_id == f"{job.id}-a1"]
    assert task["worker_pid"] != int(driver[0].driver_info.pid)


def test_cancel_stops_the_ray_job_and_its_workers(serve, files):
    c = serve.client()
    job = create(serve, files, steps=100_000)
    wait_for(lambda: len(metric_steps(serve, job.id)) >= 3, 240, "training to start")
    # the workers' numbers are Ray metrics too, tagged by job, attempt and rank
    port = json.loads((serve.data_dir / "ray" / "head.json").read_text())["metrics_export_port"]

    def scraped() -> list[str]:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        return [
            x for x in text.splitlines() if x.startswith("ray_pstar_train_loss{") and job.id in x
        ]

    # each worker exports on its own ~5 s clock: rank 1's lines may be in before rank 0's
    lines = wait_for(
        lambda: (got := scraped()) and any('rank="0"' in x for x in got) and got,
        90,
        "rank 0's ray_pstar_train_loss on Ray's metrics port",
        poll=2,
    )
    assert all('attempt="1"' in x for x in lines)
    # the running job's log, followed: the driver's lines and both workers' lines
    assert _followed_log_shows(serve, job.id, [f"rank {r} of 2" for r in (0, 1)])
    done = c.fine_tuning.jobs.cancel(job.id)
    assert done.status == "cancelled"
    ray_jobs = serve.ray_jobs()
    wait_for(
        lambda: str(ray_jobs.get_job_info(f"{job.id}-a1").status.value) == "STOPPED",
        60,
        "Ray to stop the job",
    )
    wait_for(lambda: not _driver_pids(job.id), 60, "the driver process to exit")
    time.sleep(2)
    n = len(metric_steps(serve, job.id))
    time.sleep(2)  # ~10 steps' time: a worker training on would have reported
    assert len(metric_steps(serve, job.id)) == n  # no worker trains on
    assert c.fine_tuning.jobs.retrieve(job.id).status == "cancelled"


def _followed_log_shows(serve, job_id: str, wanted: list[str], timeout: float = 90) -> str:
    """Follow GET .../logs?follow=true of a running job until every wanted text arrived."""
    h = {"Authorization": f"Bearer {TOKEN}"}
    url = f"{serve.url}/v1/fine_tuning/jobs/{job_id}/logs?follow=true"
    seen = ""
    deadline = time.time() + timeout
    with httpx.stream("GET", url, headers=h, timeout=httpx.Timeout(10, read=timeout)) as r:
        assert r.status_code == 200
        for text in r.iter_text():
            seen += text
            if all(w in seen for w in wanted):
                return seen
            if time.time() > deadline:
                break
    raise AssertionError(f"the followed log lacks {wanted}:\n{seen[-3000:]}")


def _driver_pids(job_id: str, attempt: int = 1) -> list[int]:
    out = subprocess.run(
        ["pgrep", "-f", f"service.control.driver {job_id} {attempt}"],
        capture_output=True,
        text=True,
    ).stdout
    return [int(x) for x in out.split()]


def test_a_job_that_cannot_get_its_resources_stays_queued(serve, files):
    c = serve.client()
    # 2 workers x 3 CPUs on a head with 4: Ray cannot place the worker group, as the dry
    # run says beforehand
    body = {
        "model": "tiny-llama",
        "training_file": files[0],
        "resources": {"num_workers": 2, "cpus_per_worker": 3},
    }
    h = {"Authorization": f"Bearer {TOKEN}"}
    rep = httpx.post(f"{serve.url}/v1/fine_tuning/jobs/validate", json=body, headers=h, timeout=60)
    assert rep.status_code == 200, rep.text
    placed = rep.json()["estimate"]["resources"]
    assert placed["fits"] is False
    assert placed["cluster"]["CPU"] == 4
    assert placed["placeable_workers"] == 1
    assert rep.json()["fits"] is False
    # memory Ray reserves counts the same way: no node has a TiB for one worker
    body["resources"] = {"memory_per_worker": 1 << 40}
    rep = httpx.post(f"{serve.url}/v1/fine_tuning/jobs/validate", json=body, headers=h, timeout=60)
    placed = rep.json()["estimate"]["resources"]
    assert (placed["placeable_workers"], placed["fits"]) == (0, False), placed
    assert 0 < placed["cluster"]["memory"] < 1 << 40
    job = create(serve, files, steps=10, resources={"num_workers": 2, "cpus_per_worker": 3})
    wait_for(
        lambda: c.fine_tuning.jobs.retrieve(job.id).model_extra["attempt"] == 1, 60, "submission"
    )
    time.sleep(10)  # a placeable group starts training within ~5 s here
    got = c.fine_tuning.jobs.retrieve(job.id)
    assert got.status == "queued"
    assert metric_steps(serve, job.id) == []
    assert c.fine_tuning.jobs.cancel(job.id).status == "cancelled"
    wait_for(lambda: not _driver_pids(job.id), 60, "the driver process to exit")


def test_pstar_run_submits_a_spec_follows_it_and_prints_the_summary(serve, tmp_path):
    """The main job's command, pointed at a service that already runs (so it starts none
    and stops none): uploads the spec's files, submits, follows to the end, summarizes."""
    (tmp_path / "train.jsonl").write_text("\n".join(chat_lines(32)) + "\n")
    (tmp_path / "valid.jsonl").write_text("\n".join(chat_lines(8, 500)) + "\n")
    spec = tmp_path / "job.yaml"
    spec.write_text(
        "model: tiny-llama\ntraining_file: train.jsonl\nvalidation_file: valid.jsonl\n"
        "suffix: run\n"
        "hyperparameters: {batch_size: 8, max_steps: 6, learning_rate_multiplier: 30}\n"
        "resources: {num_workers: 2}\nengine: {dtype: fp32}\n"
    )
    env = {**os.environ, "PSTAR_API_TOKEN": TOKEN, "COLUMNS": "200"}
    out = subprocess.run(
        [sys.executable, "-m", "pstar", "run", str(spec), "--port", str(serve.port)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    text = out.stdout
    assert "uploaded train.jsonl" in text
    assert "starting the control plane" not in text  # one answered on the port
    assert "shutting the service down" not in text
    job_id = next(w for w in text.split() if w.startswith("ftjob-")).strip(":()")
    job = serve.client().fine_tuning.jobs.retrieve(job_id)
    assert job.status == "succeeded"
    assert f"{job_id}: succeeded" in text
    before, after = map(float, re.search(r"held-out loss\W+([\d.]+) -> ([\d.]+)", text).groups())
    assert after < before
    assert job.fine_tuned_model in text
    assert httpx.get(serve.url + "/readyz").status_code == 200  # still serving


def test_a_control_plane_on_postgresql_runs_jobs_on_an_existing_ray_cluster(
    serve, tmp_path, request
):
    """A second control plane, as in production: PostgreSQL for the store, RAY_ADDRESS for
    a cluster it did not start (the first one's head). The driver and the workers write to
    PostgreSQL; stopping this control plane leaves the cluster alone."""
    from service.control.local_ray import pid_alive
    from service.store import Store
    from tests.conftest import fresh_database

    # a password in the URL (the test server trusts 127.0.0.1 and ignores it): it must
    # not reach Ray, whose dashboard anyone with its address reads
    password = "pw-" + os.urandom(12).hex()
    db_url = fresh_database(request.getfixturevalue("pg_server")).replace(
        "postgres@", f"postgres:{password}@"
    )
    assert password in db_url
    ray_url = httpx.get(serve.url + "/readyz", headers=_auth()).json()["ray_dashboard_url"]
    make_tiny_llama(tmp_path / "models" / "tiny-llama", hidden=128, layers=4)
    # the existing cluster wants its token, as a KubeRay cluster's comes from a Secret
    pg = Serve(tmp_path, env={"PSTAR_DB_URL": db_url, "RAY_ADDRESS": ray_url, **serve.ray_env()})
    pg.start()
    try:
        c = pg.client()
        train = c.files.create(
            file=("train.jsonl", io.BytesIO("\n".join(chat_lines(32)).encode())),
            purpose="fine-tune",
        )
        valid = c.files.create(
            file=("valid.jsonl", io.BytesIO("\n".join(chat_lines(8, 500)).encode())),
            purpose="fine-tune",
        )
        # with host memory reserved in Ray for each worker (its host tier plans within it)
        job = create(
            pg,
            (train.id, valid.id),
            steps=12,
            resources={"num_workers": 2, "memory_per_worker": 3 << 30},
        )
        done = wait_for(
            lambda: (
                (j := c.fine_tuning.jobs.retrieve(job.id)).status
                in ("succeeded", "failed", "cancelled")
                and j
            ),
            300,
            "the job to end",
        )
        assert done.status == "succeeded", done.error
        assert done.fine_tuned_model in [m.id for m in c.models.list()]
        store = Store(db_url)
        assert [p.step for p in store.events.metric_points(job.id)] == list(range(0, 13))
        stats = store.events.get_stats(job.id)
        assert stats.trace["non_model_bytes"]  # the tracer, from rank 0
        # its host tier planned within what Ray reserved: 3 GiB less the 2 GiB margin
        assert stats.tiers["host"]["budget"] == 1 << 30, stats.tiers
        assert [ck.step_number for ck in c.fine_tuning.jobs.checkpoints.list(job.id)] == [
            12,
            10,
        ]
        store.close()
        assert (tmp_path / "models" / ".ft" / job.id / "config.json").is_file()
        seen = ray_says(ray_url, f"{job.id}-a1", serve.ray_env())
        assert len(seen) > 5_000  # the scan read what Ray holds of the job and its actors
        assert password not in seen
        assert "PSTAR_DB_URL_FILE" in seen  # the path, not the URL, reached the driver
        secret = tmp_path / "secrets" / "db_url"
        assert (secret.stat().st_mode & 0o777, secret.read_text().strip()) == (0o600, db_url)
    finally:
        pg.terminate()
    assert pid_alive(serve.head_pid())  # not this control plane's cluster to stop
    assert httpx.get(serve.url + "/readyz").status_code == 200


def ray_says(ray_url: str, submission_id: str, env: dict[str, str]) -> str:
    """Everything Ray's job, actor, task, worker and Train APIs return about what ran:
    the text a reader of the Ray dashboard (one with its token) can see."""
    from service import ray_auth

    paths = [
        "/api/jobs/",
        f"/api/jobs/{submission_id}",
        f"/api/jobs/{submission_id}/logs",
        "/api/v0/actors?detail=true&limit=10000",
        "/api/v0/tasks?detail=true&limit=10000",
        "/api/v0/workers?detail=true&limit=10000",
        "/api/v0/placement_groups?detail=true&limit=10000",
        "/api/train/v2/runs",
        "/logical/actors",
        "/nodes?view=summary",
    ]
    out = []
    for p in paths:
        r = httpx.get(ray_url + p, headers=ray_auth.headers(env), timeout=60)
        assert r.status_code not in (401, 403), p  # read as one who has the token
        out.append(f"{p} {r.status_code}\n{r.text}")
    return "\n".join(out)


def _download(serve, url: str, out, token: str = TOKEN) -> int:
    """Stream a checkpoint's content into `out` (a directory): the tar's members there."""
    import tarfile

    archive = out.with_suffix(".tar")
    h = {"Authorization": f"Bearer {token}"}
    with httpx.stream("GET", f"{serve.url}{url}", headers=h, timeout=120) as r:
        if r.status_code != 200:
            return r.status_code
        assert r.headers["content-type"] == "application/x-tar"
        with archive.open("wb") as f:
            for part in r.iter_bytes():
                f.write(part)
    with tarfile.open(archive) as t:
        t.extractall(out, filter="data")
    return 200


def test_a_lora_job_trains_adapters_on_the_frozen_base_and_each_checkpoint_downloads(
    serve, files, tmp_path
):
    import torch
    from peft import PeftModel
    from transformers import logging as hf_logging

    hf_logging.set_verbosity_error()
    c = serve.client()
    method = {"type": "lora", "lora": {"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]}}
    ours = {
        "hyperparameters": {
            "n_epochs": 50,
            "batch_size": 8,
            "learning_rate_multiplier": 100,
            "max_steps": 12,
        },
        "resources": {"num_workers": 2},
        "engine": {"dtype": "fp32"},
    }
    job = c.fine_tuning.jobs.create(
        model="tiny-llama",
        training_file=files[0],
        validation_file=files[1],
        suffix="lora",
        seed=3,
        method=method,  # type: ignore[arg-type]
        extra_body={**ours, "checkpoint_every": 5},
    )
    assert job.method.type == "lora"
    done = wait_for(
        lambda: (j := c.fine_tuning.jobs.retrieve(job.id)).status in ("succeeded", "failed") and j,
        300,
        "the LoRA job to end",
    )
    assert done.status == "succeeded", done.error
    # each rank holds at least the dry run's LoRA model data (whole chunks, maybe gathered
    # ones too) and well under what full fine-tuning would need
    last = store_of(serve).events.metric_points(job.id)[-1].values
    held = sum(last[f"model_data_bytes_{t}"] for t in ("device", "host", "disk"))
    h = {"Authorization": f"Bearer {TOKEN}"}
    planned = {}
    for name, extra in (("lora", {"method": method}), ("full", {})):
        body = {"model": "tiny-llama", "training_file": files[0], **ours, **extra}
        r = httpx.post(f"{serve.url}/v1/fine_tuning/jobs/validate", json=body, headers=h)
        assert r.status_code == 200, r.text
        planned[name] = r.json()["estimate"]["per_rank"]["model_data_bytes"]
    assert planned["lora"] <= held < planned["full"]
    first = next(e.data for e in events(c, job.id) if e.type == "metrics")
    final_ck = c.fine_tuning.jobs.checkpoints.list(job.id).data[0]
    assert final_ck.metrics.full_valid_loss < first["full_valid_loss"]  # the adapters learned
    # registered as the adapter on its base
    name = f"ft:tiny-llama:lora:{job.id}"
    assert done.fine_tuned_model == name
    m = c.models.retrieve(name)
    assert (m.model_extra["adapter"], m.model_extra["adapter_base"]) == (True, "tiny-llama")
    cks = list(c.fine_tuning.jobs.checkpoints.list(job.id))
    assert [ck.step_number for ck in cks] == [12, 10, 5]
    assert [ck.model_extra["variants"] for ck in cks] == [
        ["adapter", "merged"],
        ["adapter"],
        ["adapter"],
    ]
    url = f"/v1/fine_tuning/jobs/{job.id}/checkpoints/{{}}/content"
    # every checkpoint's adapter loads in peft onto the base, and they differ by step
    base_dir = serve.data_dir / "models" / "tiny-llama"
    x = torch.tensor([[5, 17, 42, 9, 100, 3]])

    def adapted(d):
        base = load_causal_lm(base_dir, dtype=torch.float32)
        with torch.no_grad():
            return PeftModel.from_pretrained(base, d).eval()(input_ids=x).logits

    with torch.no_grad():
        plain = load_causal_lm(base_dir, dtype=torch.float32)(x).logits
    logits = {}
    for ck in cks:
        d = tmp_path / f"adapter-{ck.step_number}"
        assert _download(serve, url.format(ck.id) + "?variant=adapter", d) == 200
        assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in d.iterdir()}
        logits[ck.step_number] = adapted(d)
        assert not torch.allclose(logits[ck.step_number], plain, atol=1e-4)  # it trained
    assert not torch.allclose(logits[12], logits[5], atol=1e-4)
    # the final checkpoint's adapter is the export's; merged it is the registered model
    export = serve.data_dir / "models" / ".ft" / job.id
    torch.testing.assert_close(adapted(export / "adapter"), logits[12])
    merged = tmp_path / "merged"
    assert _download(serve, url.format(cks[0].id) + "?variant=merged", merged) == 200
    assert not (merged / "adapter_config.json").exists()
    with torch.no_grad():
        m_logits = load_causal_lm(merged, dtype=torch.float32)(x).logits
    torch.testing.assert_close(m_logits, logits[12], atol=1e-4, rtol=1e-4)
    # merged only for the final checkpoint; nothing for another tenant
    assert _download(serve, url.format(cks[1].id) + "?variant=merged", tmp_path / "n") == 404
    assert _download(serve, url.format(cks[0].id), tmp_path / "r", RIVAL_TOKEN) == 404


class _Node:
    """A second Ray node on this machine: a raylet joined to the module's head with
    `ray start --address`, its own ports, 2 CPUs and resource `name`, in its own session so
    that it and its workers die together, as a lost machine would. (`name` in lower case
    letters: the dashboard camel-cases resource names.)"""

    def __init__(self, serve, name: str) -> None:
        from service import ray_auth
        from service.control.local_ray import HEAD_ENV, free_ports

        head = json.loads((serve.data_dir / "ray" / "head.json").read_text())
        ports = [
            "node-manager-port", "object-manager-port", "metrics-export-port",
            "dashboard-agent-listen-port", "dashboard-agent-grpc-port", "runtime-env-agent-port",
        ]  # fmt: skip
        cmd = [
            str(Path(sys.executable).with_name("ray")), "start", "--block",
            f"--address={head['gcs_address']}", "--node-ip-address=127.0.0.1", "--num-cpus=2",
            f"--resources={json.dumps({name: 1})}", f"--object-store-memory={256 << 20}",
            "--min-worker-port=20000", "--max-worker-port=20999", "--disable-usage-stats",
            *(f"--{p}={n}" for p, n in zip(ports, free_ports(len(ports)), strict=True)),
        ]  # fmt: skip
        self.name, self.ray_url = name, head["dashboard_url"]
        # the head wants its token from a node that joins it, as from any client
        env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_TOKEN"}
        env.update(HEAD_ENV, **serve.ray_env())
        self.auth = ray_auth.headers(serve.ray_env())
        with (serve.data_dir / f"{name}.log").open("ab") as log:
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        self.log = serve.data_dir / f"{name}.log"
        try:  # a loaded 2-core machine has taken more than 120 s to start a raylet
            wait_for(lambda: self.alive(), 300, f"node {name} to join the cluster")
        except AssertionError as e:
            raise AssertionError(f"{e}; its log ends:\n{self.log.read_text()[-3000:]}") from None

    def alive(self) -> bool:
        nodes = httpx.get(self.ray_url + "/nodes?view=summary", headers=self.auth, timeout=10)
        nodes = nodes.json()
        return any(
            n.get("raylet", {}).get("state") == "ALIVE"
            and self.name in n.get("raylet", {}).get("resourcesTotal", {})
            for n in nodes["data"]["summary"]
        )

    def kill(self) -> None:
        """SIGKILL the node's raylet, its agents and its workers at once."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)


def test_a_lost_node_costs_its_worker_and_the_job_resumes_from_its_checkpoint_once_one_is_back(
    serve, files
):
    c = serve.client()
    first = _Node(serve, "pstarnodea")
    second = None
    try:
        # one worker on the head, one on the joined node: STRICT_SPREAD cannot pack them
        job = create(
            serve, files, steps=80,
            resources={"num_workers": 2, "placement_strategy": "STRICT_SPREAD"},
        )  # fmt: skip
        assert job.model_extra["resources"]["placement_strategy"] == "STRICT_SPREAD"
        wait_for(lambda: checkpoint_at(serve, job.id, 20), 300, "a checkpoint past step 20")
        first.kill()  # the machine is gone: its raylet and the worker on it
        # with one node left the worker group cannot be placed again; the job waits
        wait_for(lambda: not first.alive(), 120, "Ray to see the node gone")
        time.sleep(5)
        stalled = metric_steps(serve, job.id)[-1]
        assert stalled < 80
        assert c.fine_tuning.jobs.retrieve(job.id).status == "running"
        second = _Node(serve, "pstarnodeb")  # capacity is back
        done = wait_for(
            lambda: (
                (j := c.fine_tuning.jobs.retrieve(job.id)).status in ("succeeded", "failed") and j
            ),
            420,
            "the job to end",
        )
        assert done.status == "succeeded", done.error
        assert done.model_extra["attempt"] == 1  # Ray Train restarted its worker group
        msgs = [e.message for e in events(c, job.id) if e.type == "message"]
        resumed = [m for m in msgs if m.startswith("Attempt 1 resumed from the checkpoint at step")]
        assert resumed, msgs
        at = int(resumed[-1].rsplit(" ", 1)[1])
        # from a checkpoint it wrote (a worker on the lost node may train a few steps on
        # before it sees its raylet gone), not from scratch
        assert 20 <= at < 80
        assert at % 10 == 0  # checkpoint_every: 10 (the store keeps only the newest 3)
        assert metric_steps(serve, job.id) == list(range(0, 81))
        # the loss goes on where it stopped: a step trained before the loss and again after
        # it (past the checkpoint) has the same loss both times
        losses: dict[int, list[float]] = {}
        for e in events(c, job.id):
            if e.type == "metrics" and "train_loss" in e.data:
                losses.setdefault(e.data["step"], []).append(e.data["train_loss"])
        again = {k: v for k, v in losses.items() if len(v) > 1}
        assert set(again) <= set(range(at + 1, stalled + 1)), again
        for step, seen in again.items():
            assert seen[0] == pytest.approx(seen[-1], rel=1e-5), (step, seen)
    finally:
        first.kill()
        if second is not None:
            second.kill()


def test_a_session_outlives_a_killed_ray_head_through_its_saved_state(serve):
    """A real head killed under a live training session (SIGKILL to its processes): the
    server starts another head, the model's next request fails at once saying its engine
    is gone and to start again from a saved state, and a training client made from that
    state on the new head computes what the lost one would have, bit for bit."""
    import tinker

    seq = [5, 9, 14, 3, 22, 7, 11]
    datum = tinker.types.Datum(
        model_input=tinker.types.ModelInput.from_ints(seq[:-1]),
        loss_fn_inputs={"target_tokens": seq[1:], "weights": [1.0] * (len(seq) - 1)},
    )
    adam = tinker.types.AdamParams(learning_rate=1e-2)
    with tinker.ServiceClient(base_url=serve.url, api_key=TINKER_TOKEN) as sc:
        tc = sc.create_lora_training_client(base_model="tiny-llama", rank=4, seed=0).result()
        for _ in range(2):
            tc.forward_backward([datum], "cross_entropy").result()
            tc.optim_step(adam).result()
        saved = tc.save_state("before-the-kill").result().path
        want = tc.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"]
        head = serve.head_pid()
        os.killpg(head, signal.SIGKILL)
        wait_for(lambda: serve.head_pid() != head, 120, "the server to start another head")
        t0 = time.monotonic()
        with pytest.raises(tinker.RequestFailedError, match="is gone") as lost:
            tc.forward_backward([datum], "cross_entropy").result()
        assert "from a saved state" in str(lost.value)
        # at once: the server knows its head died (not after Ray's client gave up, 30 s)
        assert time.monotonic() - t0 < 10
        again = sc.create_training_client_from_state_with_optimizer(saved).result()
        got = again.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"]
        assert got == want
        again.optim_step(adam).result()  # and it trains on


def test_a_graceful_restart_stops_ray_and_the_job_resumes_in_a_new_attempt(serve, files):
    c = serve.client()
    # 150 steps: the job trains on while the API and then the head stop (60 steps were
    # all trained by then on this machine, the last checkpoint at step 60)
    job = create(serve, files, steps=150)
    wait_for(lambda: checkpoint_at(serve, job.id, 10), 240, "the first checkpoint")
    head = serve.head_pid()
    serve.terminate()  # SIGTERM: the API stops, then the local head and its jobs
    from service.control.local_ray import pid_alive

    assert not pid_alive(head)
    serve.start()
    assert serve.head_pid() != head
    done = wait_for(
        lambda: (j := c.fine_tuning.jobs.retrieve(job.id)).status in ("succeeded", "failed") and j,
        300,
        "the job to end",
    )
    assert done.status == "succeeded", done.error
    assert done.model_extra["attempt"] == 2
    msgs = [e.message for e in events(c, job.id) if e.type == "message"]
    resumed = [m for m in msgs if m.startswith("Attempt 2 resumed from the checkpoint at step")]
    assert resumed, msgs
    assert 10 <= int(resumed[0].rsplit(" ", 1)[1]) < 150
    assert metric_steps(serve, job.id) == list(range(0, 151))
