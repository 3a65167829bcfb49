"""Experiment trackers (`integrations`, issue 37): a job created through the unmodified
`openai` SDK with OpenAI's `wandb` integration and our `mlflow` one logs its config and
every metric point to both, through their official clients (W&B offline, MLflow's file
store: no key and no server here), the job object shows each run's URL, and a tracker
that cannot log never fails the job."""

from __future__ import annotations

import json

import openai
import pytest

from service.control.tracking import Tracking
from tests.api.conftest import api_in_process
from tests.tiny import chat_lines

WANDB = {"type": "wandb", "wandb": {"project": "words", "tags": ["tiny", "e2e"]}}
MLFLOW = {"type": "mlflow", "mlflow": {"experiment": "words", "tags": {"team": "nlp"}}}


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    with api_in_process(tmp_path_factory, "tracking") as server:
        yield server


@pytest.fixture(scope="module")
def train_file(api):
    data = ("\n".join(chat_lines(16)) + "\n").encode()
    return api.client().files.create(file=("t.jsonl", data), purpose="fine-tune").id


@pytest.fixture(autouse=True)
def no_wandb_key(monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("PSTAR_MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")


def create(api, train_file, integrations, steps: int = 6):
    return api.client().fine_tuning.jobs.create(
        model="tiny-llama",
        training_file=train_file,
        seed=4,
        integrations=integrations,
        extra_body={"hyperparameters": {"max_steps": steps, "batch_size": 4}},
    )


def run_tracked(api, job_id: str) -> Tracking | None:
    """The job as its driver runs it, in this process: trackers started, the one worker's
    loop, the trackers ended."""
    from service.control.driver import prepare_run
    from service.worker.finetune import build_job_engine
    from service.worker.loop import run_loop
    from service.worker.reporting import Reporter
    from service.worker.train_local import DirCheckpoints
    from tests.service.test_store import driver_attempt

    attempt = driver_attempt(api.store, job_id)
    tracking = Tracking.start(api.settings, api.store, api.store.jobs.get(job_id), attempt)
    run = prepare_run(api.settings, api.store, api.store.jobs.get(job_id), attempt)
    engine = build_job_engine(run)
    rep = Reporter({"job_id": job_id, "attempt": attempt, "run": run}, 0, api.store)
    run_loop(run, engine, 0, 1, rep, DirCheckpoints(api.settings.data_dir / job_id, False))
    if tracking is not None:
        tracking.end("finished")
    return tracking


def test_a_jobs_metrics_and_config_go_to_wandb_and_mlflow_and_the_job_shows_the_runs(
    api, train_file
):
    from mlflow.tracking import MlflowClient

    job = create(api, train_file, [WANDB, MLFLOW])
    run_tracked(api, job.id)
    got = api.client().fine_tuning.jobs.retrieve(job.id)
    wandb, mlflow = (i.to_dict()[i.type] for i in got.integrations)
    assert [i.type for i in got.integrations] == ["wandb", "mlflow"]
    assert wandb["project"] == "words"
    assert wandb["tags"] == ["tiny", "e2e"]
    assert (wandb["state"], mlflow["state"]) == ("finished", "finished")
    assert wandb["run_id"] == job.id  # the same run across attempts
    points = {p.step: p.values for p in api.store.events.metric_points(job.id)}
    assert sorted(points) == list(range(1, 7))
    # MLflow: every point at its step, the config as params, the run finished
    uri = f"sqlite:///{api.settings.job_dir(job.id) / 'mlflow.db'}"
    assert mlflow["url"].startswith("mlflow.db in the job's run directory")  # not a path
    assert mlflow["url"].endswith(f"run {mlflow['run_id']}")
    assert str(api.settings.data_dir) not in wandb["url"]  # no server path shown
    assert wandb["url"].startswith(f"{job.id}/wandb/")
    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(mlflow["run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.params["method"] == "supervised"
    assert run.data.params["hyperparameters.batch_size"] == "4"
    assert run.data.tags["team"] == "nlp"
    assert run.data.tags["pstar.tenant"] == "acme"
    assert client.get_experiment(run.info.experiment_id).name == "acme/words"
    history = client.get_metric_history(mlflow["run_id"], "train_loss")
    assert {m.step: m.value for m in history} == {s: v["train_loss"] for s, v in points.items()}
    # W&B, offline: the run's file (what `wandb sync` uploads) holds the config and a
    # history row per point
    (path,) = (api.settings.job_dir(job.id) / "wandb").rglob("run-*.wandb")
    records = wandb_records(path)
    config = {
        i.key: json.loads(i.value_json)
        for r in records
        if r.WhichOneof("record_type") == "run"
        for i in r.run.config.update
    }
    assert config["method"] == "supervised"
    assert config["hyperparameters"]["batch_size"] == 4
    history = {
        r.history.step.num: {
            i.key or ".".join(i.nested_key): json.loads(i.value_json) for i in r.history.item
        }
        for r in records
        if r.WhichOneof("record_type") == "history"
    }
    assert sorted(history) == list(range(1, 7))
    assert {s: h["train_loss"] for s, h in history.items()} == pytest.approx(
        {s: v["train_loss"] for s, v in points.items()}
    )


def wandb_records(path) -> list:
    """The protobuf records of a W&B run file: its 7-byte header, then LevelDB's log
    format (32 KiB blocks; each record a CRC, a length, a type: whole, first, middle, last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block, pos = path.read_bytes(), 32768, 7
    assert data[:4] == b":W&B"
    out, parts = [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header: padding
            pos += block - pos % block
            continue
        n, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        chunk, pos = data[pos + 7 : pos + 7 + n], pos + 7 + n
        if kind == 0:
            break
        parts = chunk if kind in (1, 2) else parts + chunk
        if kind in (1, 4):
            r = pb.Record()
            r.ParseFromString(parts)
            out.append(r)
    return out


def test_a_tracker_that_cannot_log_never_fails_the_job(api, train_file, monkeypatch):
    # the operator's MLflow server is down (nothing listens on port 9)
    monkeypatch.setenv("PSTAR_MLFLOW_TRACKING_URI", "http://127.0.0.1:9")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    job = create(api, train_file, [MLFLOW], steps=3)
    run_tracked(api, job.id)
    got = api.client().fine_tuning.jobs.retrieve(job.id)
    (mlflow,) = (i.to_dict()["mlflow"] for i in got.integrations)
    assert mlflow["state"] == "failed"
    assert "127.0.0.1:9" in mlflow["error"] or "Connection" in mlflow["error"]
    assert got.model_extra["progress"]["step"] == 3  # it trained on
    said = [e.message for e in api.client().fine_tuning.jobs.list_events(job.id, limit=50)]
    assert any(m.startswith("mlflow logging stopped") for m in said), said


@pytest.mark.parametrize(
    ("integrations", "says"),
    [
        ([WANDB, WANDB], "at most one integration of each type"),
        ([{"type": "comet", "comet": {}}], "integrations.0"),
        ([{"type": "wandb", "wandb": {}}], "integrations.0.wandb.wandb.project"),
        (
            [{"type": "mlflow", "mlflow": {"tracking_uri": "file:///etc"}}],
            "integrations.0.mlflow.mlflow.tracking_uri",
        ),
        (
            [{"type": "mlflow", "mlflow": {"tags": {"mlflow.user": "root"}}}],
            "mlflow.* and pstar.* are MLflow's and the service's",
        ),
    ],
)
def test_integrations_the_service_does_not_take_are_a_400(api, train_file, integrations, says):
    with pytest.raises(openai.BadRequestError) as e:
        create(api, train_file, integrations)
    assert says in e.value.body["message"] + (e.value.body.get("param") or "")
