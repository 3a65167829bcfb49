"""`pstar files` and `pstar jobs` against a running API (dry launcher: nothing trains)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.api.conftest import TOKENS, start_api
from tests.tiny import chat_lines


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    api, stop = start_api(d, f"sqlite:///{d / 'store.db'}", "sqlite", models_in_process=True)
    yield api
    stop()


def pstar(
    server, *args: str, ok: bool = True, stdin: str | None = None
) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PSTAR_URL": server.url,
        "PSTAR_API_TOKEN": TOKENS["acme"],
        "COLUMNS": "200",
    }
    out = subprocess.run(
        [sys.executable, "-m", "pstar", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        input=stdin,
    )
    assert (out.returncode == 0) == ok, out.stdout + out.stderr
    return out


def test_submit_uploads_the_spec_files_and_the_job_shows_in_list_get_and_events(server, tmp_path):
    (tmp_path / "train.jsonl").write_text("\n".join(chat_lines(10)) + "\n")
    spec = tmp_path / "job.yaml"
    spec.write_text(
        "model: gpt-tiny\ntraining_file: train.jsonl\nsuffix: cli\n"
        "hyperparameters: {n_epochs: 1, batch_size: 2}\n"
    )
    out = pstar(server, "jobs", "submit", str(spec)).stdout
    assert "uploaded train.jsonl" in out
    job_id = next(w for w in out.split() if w.startswith("ftjob-")).rstrip(":")
    job = server.store.jobs.get(job_id)
    assert job.tenant == "acme"
    assert job.plan["hyperparameters"]["batch_size"] == 2
    assert job_id in pstar(server, "jobs", "list").stdout
    assert f'"id": "{job_id}"' in pstar(server, "jobs", "get", job_id).stdout
    assert "Created fine-tuning job" in pstar(server, "jobs", "events", job_id).stdout
    assert "cancelled" in pstar(server, "jobs", "cancel", job_id).stdout
    # following the logs of an ended job prints its end and returns
    assert "===== job cancelled =====" in pstar(server, "jobs", "logs", job_id, "--follow").stdout


def test_errors_are_reported_with_the_servers_message_and_a_nonzero_exit(server, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": []}\nnot json\n')
    out = pstar(server, "files", "upload", str(bad), ok=False)
    assert "line 1" in out.stdout
    assert "line 2" in out.stdout
    out = pstar(server, "jobs", "get", "ftjob-nope", ok=False)
    assert "No fine_tuning_job with id 'ftjob-nope'" in out.stdout
    env_less = pstar(server, "jobs", "list", "--url", "http://127.0.0.1:9", ok=False)
    assert "no service answers" in env_less.stdout


def test_files_upload_and_list_show_the_stored_file(server, tmp_path):
    good = tmp_path / "words.jsonl"
    good.write_text("\n".join(chat_lines(6)) + "\n")
    out = pstar(server, "files", "upload", str(good)).stdout
    file_id = next(w for w in out.split() if w.startswith("file-")).rstrip(":")
    stored = server.store.files.get("acme", file_id)
    assert (stored.filename, stored.examples, stored.bytes) == (
        "words.jsonl",
        6,
        good.stat().st_size,
    )
    listed = pstar(server, "files", "list").stdout
    assert file_id in listed
    assert "words.jsonl" in listed


def test_validate_prints_the_data_report_and_stores_nothing(server, tmp_path):
    (tmp_path / "train.jsonl").write_text("\n".join(chat_lines(10)) + "\n")
    spec = tmp_path / "job.yaml"
    spec.write_text("model: gpt-tiny\ntraining_file: train.jsonl\n")
    jobs_before = len(server.store.jobs.page("acme", None, 100)[0])
    out = pstar(server, "jobs", "validate", str(spec)).stdout
    report = json.loads(out[out.index("{") :])  # after the upload's own line
    assert report["data"]["training_file"]["examples"] == 10
    assert isinstance(report["fits"], bool)
    assert len(server.store.jobs.page("acme", None, 100)[0]) == jobs_before


def test_pause_and_resume_a_queued_job_from_the_command_line(server, tmp_path):
    (tmp_path / "train.jsonl").write_text("\n".join(chat_lines(10)) + "\n")
    spec = tmp_path / "job.yaml"
    spec.write_text("model: gpt-tiny\ntraining_file: train.jsonl\nsuffix: pause\n")
    out = pstar(server, "jobs", "submit", str(spec)).stdout
    job_id = next(w for w in out.split() if w.startswith("ftjob-")).rstrip(":")
    store = server.store
    wait(lambda: store.jobs.get(job_id).attempt == 1)  # waiting in (the dry) Ray
    assert "pausing at the next step boundary" in pstar(server, "jobs", "pause", job_id).stdout
    wait(lambda: store.jobs.get(job_id).status == "paused")  # its Ray job stopped
    assert f"{job_id}: queued" in pstar(server, "jobs", "resume", job_id).stdout
    wait(lambda: store.jobs.get(job_id).attempt == 2)  # a new attempt resumes it
    again = pstar(server, "jobs", "resume", job_id, ok=False)
    assert "is queued; only a paused job can be resumed" in again.stdout
    assert "cancelled" in pstar(server, "jobs", "cancel", job_id).stdout


def wait(pred, timeout: float = 120.0) -> None:
    """Until `pred()`; the reconciler ticks every 0.1 s, but a loaded machine (CI's took
    over 20 s once, and a pause past 60 s once, where it takes 2 s alone) can hold a tick
    back behind a store that is busy."""
    import time

    deadline = time.time() + timeout
    while not pred():
        assert time.time() < deadline, "timed out"
        time.sleep(0.05)


def test_chat_with_p_prints_the_models_answer(server):
    from benchmarks.models_made import greedy

    ask = "What does apple mean?"
    out = pstar(server, "chat", "tiny-llama", "-p", ask, "--temperature", "0", "--max-tokens", "8")
    want = greedy(server.settings.models_dir / "tiny-llama", [{"role": "user", "content": ask}], 8)
    assert out.stdout == want + "\n"


def test_chat_keeps_the_conversation_until_reset(server):
    from benchmarks.models_made import greedy

    script = "What does apple mean?\nAnd bread?\n/reset\nAnd bread?\n/exit\n"
    out = pstar(
        server, "chat", "tiny-llama", "--temperature", "0", "--max-tokens", "6", stdin=script
    )
    d = server.settings.models_dir / "tiny-llama"
    first = greedy(d, [{"role": "user", "content": "What does apple mean?"}], 6)
    with_history = greedy(
        d,
        [
            {"role": "user", "content": "What does apple mean?"},
            {"role": "assistant", "content": first},
            {"role": "user", "content": "And bread?"},
        ],
        6,
    )
    alone = greedy(d, [{"role": "user", "content": "And bread?"}], 6)
    # after the header, each "> " prompt and its answer; /reset answers nothing, and the
    # second "And bread?" is asked without the first exchange before it
    transcript = out.stdout.split("\n", 1)[1]
    assert transcript == f"> {first}\n> {with_history}\n> > {alone}\n> "


def test_chat_with_an_unknown_model_fails_with_the_servers_message(server):
    out = pstar(server, "chat", "no-such-model", "-p", "hi", ok=False)
    assert "No model with id 'no-such-model'" in out.stdout


def test_serve_with_an_unreachable_store_says_so_in_one_line_without_the_password(tmp_path):
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        **os.environ,
        "PSTAR_DATA_DIR": str(tmp_path),
        "PSTAR_DB_URL": f"postgresql+psycopg://pstar:pw-do-not-print@127.0.0.1:{port}/pstar",
    }
    out = subprocess.run(
        [sys.executable, "-m", "pstar", "serve", "--port", "0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    text = " ".join((out.stdout + out.stderr).split())  # as one line: the console wraps
    assert out.returncode == 2, text
    assert "pw-do-not-print" not in text
    assert f"the store at postgresql+psycopg://***@127.0.0.1:{port}/pstar cannot be reached" in text
    assert "Traceback" not in text


# a job object as `openai api fine_tuning.jobs.retrieve` prints it (OpenAI's documented
# shape: a DPO job with a W&B integration)
OPENAI_JOB = {
    "object": "fine_tuning.job",
    "id": "ftjob-abc123",
    "model": "gpt-4o-mini-2024-07-18",
    "created_at": 1721764800,
    "finished_at": 1721765400,
    "fine_tuned_model": "ft:gpt-4o-mini-2024-07-18:my-org:words:9zXy",
    "organization_id": "org-123",
    "result_files": ["file-res"],
    "status": "succeeded",
    "validation_file": "file-val",
    "training_file": "file-abc123",
    "hyperparameters": {"n_epochs": 2, "batch_size": 4, "learning_rate_multiplier": 1.8},
    "method": {
        "type": "dpo",
        "dpo": {
            "hyperparameters": {
                "beta": 0.2,
                "n_epochs": 2,
                "batch_size": 4,
                "learning_rate_multiplier": 1.8,
            }
        },
    },
    "trained_tokens": 5768,
    "integrations": [{"type": "wandb", "wandb": {"project": "my-project"}}],
    "seed": 42,
    "estimated_finish": None,
    "metadata": {"team": "words"},
}


def test_import_openai_recreates_the_job_here_and_names_what_it_left_out(server, tmp_path):
    from tests.service.test_methods_ray import preference_lines

    job = tmp_path / "job.json"
    job.write_text(json.dumps(OPENAI_JOB))
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("\n".join(preference_lines(8)) + "\n")
    args = ["import-openai", str(job), "--model", "tiny-llama", "--training-file", str(pairs)]
    dry = pstar(server, *args, "--dry-run").stdout
    assert "model: gpt-4o-mini-2024-07-18 -> tiny-llama" in dry
    body = json.loads(dry[dry.index("\n{") :])  # the request, after the notes
    assert body["integrations"] == [{"type": "wandb", "wandb": {"project": "my-project"}}]
    assert "validation_file: file-val left out" in dry
    out = pstar(server, *args).stdout
    new_id = next(w for w in out.split() if w.startswith("ftjob-") and w != "ftjob-abc123")
    created = server.store.jobs.get(new_id.rstrip(":"))
    assert created is not None
    assert (created.model, created.seed, created.suffix) == ("tiny-llama", 42, "words")
    assert created.metadata_ == {"team": "words"}
    plan = created.plan
    assert plan["method"]["type"] == "dpo"
    hp = plan["hyperparameters"]
    assert (hp["n_epochs"], hp["batch_size"], hp["learning_rate_multiplier"], hp["beta"]) == (
        2, 4, 1.8, 0.2,
    )  # fmt: skip
    assert f"from {OPENAI_JOB['id']}" in out
    # not a job: said so, nothing created
    (tmp_path / "bad.json").write_text('{"object": "list"}')
    bad = pstar(server, "import-openai", str(tmp_path / "bad.json"), "--model", "tiny-llama",
                "--training-file", str(pairs), ok=False)  # fmt: skip
    assert "not an OpenAI fine-tuning job" in bad.stdout + bad.stderr


def test_a_reinforcement_job_keeps_its_grader_and_drops_reasoning_effort():
    from pstar.openai_import import FIELDS, request_of

    grader = {"type": "string_check", "name": "g", "operation": "eq",
              "input": "{{sample.output_text}}", "reference": "{{item.answer}}"}  # fmt: skip
    job = {
        "model": "o4-mini-2025-04-16",
        "training_file": "file-1",
        "method": {
            "type": "reinforcement",
            "reinforcement": {
                "grader": grader,
                "hyperparameters": {"n_epochs": 1, "eval_samples": 2, "reasoning_effort": "low"},
            },
        },
    }
    got = request_of(job, "tiny-llama", "p.jsonl")
    assert got.body["method"] == {
        "type": "reinforcement",
        "reinforcement": {"grader": grader, "hyperparameters": {"n_epochs": 1, "eval_samples": 2}},
    }
    assert any("reasoning_effort left out" in n for n in got.notes)
    # the README's table lists every field an import knows, and no other
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split("## Coming from OpenAI", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"^\| `([a-z_]+)` \|", section, re.M))
    assert set(FIELDS) <= listed
