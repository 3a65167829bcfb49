"""A `pstar serve` process for end-to-end tests (the service tests, the dashboard's
browser tests): started with its own local Ray head, stopped by PID."""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

import httpx

from benchmarks.serve_process import ServeProcess

TOKEN = "tok-e2e-acme-0123456789"
RIVAL_TOKEN = "tok-e2e-rival-0123456789"
TINKER_TOKEN = "tml-e2e-acme-0123456789"  # acme's too: the tinker SDK takes only tml- keys


class Serve(ServeProcess):
    """A `pstar serve` process with the two test tenants' tokens."""

    def __init__(self, data_dir: Path, env: dict[str, str] | None = None) -> None:
        from service.control.local_ray import free_port

        # Ray Serve's proxy on a port of its own (models start there on first request)
        env = {"PSTAR_SERVE_PORT": str(free_port()), **(env or {})}
        tokens = f"acme:{TOKEN},rival:{RIVAL_TOKEN},acme:{TINKER_TOKEN}"
        super().__init__(data_dir, tokens, env)

    def client(self, token: str = TOKEN):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=token, max_retries=2)

    def head_pid(self) -> int:
        return json.loads((self.data_dir / "ray" / "head.json").read_text())["pid"]

    def ray_env(self) -> dict[str, str]:
        """What a client of this server's Ray head needs: the head's token, by its file."""
        from service import ray_auth

        return ray_auth.local_env(self.data_dir / "ray" / "auth_token")

    def ray_jobs(self):
        """Ray's job API on this server's head, with its token."""
        from ray.job_submission import JobSubmissionClient

        from service import ray_auth

        head = json.loads((self.data_dir / "ray" / "head.json").read_text())
        return JobSubmissionClient(head["dashboard_url"], headers=ray_auth.headers(self.ray_env()))

    def ray_tasks(self, name: str) -> list[dict]:
        """Ray's record of the tasks named `name` (its state API on this server's head)."""
        from service import ray_auth

        head = json.loads((self.data_dir / "ray" / "head.json").read_text())
        r = httpx.get(
            f"{head['dashboard_url']}/api/v0/tasks",
            params={
                "filter_keys": "name",
                "filter_predicates": "=",
                "filter_values": name,
                "detail": "true",
            },
            headers=ray_auth.headers(self.ray_env()),
            timeout=60,
        )
        r.raise_for_status()
        return r.json()["data"]["result"]["result"]


def wait_for(pred, timeout: float, what: str, poll: float = 0.5):
    deadline = time.time() + timeout
    while time.time() < deadline:
        import openai

        with contextlib.suppress(httpx.HTTPError, openai.APIConnectionError):
            got = pred()
            if got:
                return got
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def ended(serve: Serve, job_id: str, timeout: float = 300):
    """The job once it has ended (succeeded, failed or cancelled). A job still going at the
    timeout fails the test with its status, its last events and the server's log, so a
    stall on another machine says where it stood."""
    c = serve.client()
    try:
        return wait_for(
            lambda: (
                (j := c.fine_tuning.jobs.retrieve(job_id)).status
                in ("succeeded", "failed", "cancelled")
                and j
            ),
            timeout,
            f"job {job_id} to end",
        )
    except AssertionError as e:
        job = c.fine_tuning.jobs.retrieve(job_id)
        events = [ev.message for ev in c.fine_tuning.jobs.list_events(job_id, limit=15).data]
        tail = serve.log.read_text(errors="replace")[-4000:] if serve.log.exists() else ""
        raise AssertionError(
            f"{e}: status {job.status}, last events (newest first) {events}\n"
            f"pstar serve's log ends:\n{tail}"
        ) from None


def start_serve(data_dir: Path, env: dict[str, str] | None = None) -> Serve:
    """`pstar serve` on a data dir holding the tiny Llama the jobs fine-tune."""
    from tests.tiny import make_tiny_llama

    make_tiny_llama(data_dir / "models" / "tiny-llama", hidden=128, layers=4)
    s = Serve(data_dir, env)
    s.start()
    return s


def stop_serve(s: Serve) -> None:
    s.stop()  # and the local Ray head, in case a test left it behind


def upload_chat_files(serve: Serve, train_rows: int = 64) -> tuple[str, str]:
    """(training file id, validation file id) of chat examples."""
    import io

    from tests.tiny import chat_lines

    c = serve.client()
    train = c.files.create(
        file=("train.jsonl", io.BytesIO("\n".join(chat_lines(train_rows)).encode())),
        purpose="fine-tune",
    )
    valid = c.files.create(
        file=("valid.jsonl", io.BytesIO("\n".join(chat_lines(16, 500)).encode())),
        purpose="fine-tune",
    )
    return train.id, valid.id


def create_job(serve: Serve, files: tuple[str, str], steps: int, suffix: str = "e2e", **extra):
    """A job on the tiny Llama: 2 workers, fp32, eval and a checkpoint every 10 steps."""
    return serve.client().fine_tuning.jobs.create(
        model="tiny-llama",
        training_file=files[0],
        validation_file=files[1],
        suffix=suffix,
        seed=3,
        extra_body={
            "hyperparameters": {
                "n_epochs": 50,
                "batch_size": 8,
                "learning_rate_multiplier": 30,
                "max_steps": steps,
                "eval_every": 10,
            },
            "resources": {"num_workers": 2},
            "engine": {"dtype": "fp32"},
            "checkpoint_every": 10,
            **extra,
        },
    )
