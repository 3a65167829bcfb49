"""A `pstar serve` process for end-to-end tests (the service tests, the dashboard's
browser tests): started with its own local Ray head, stopped by PID."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

TOKEN = "tok-e2e-acme-0123456789"
RIVAL_TOKEN = "tok-e2e-rival-0123456789"


class Serve:
    """A `pstar serve` process: started, killed and stopped by PID."""

    def __init__(self, data_dir: Path, env: dict[str, str] | None = None) -> None:
        self.data_dir = data_dir
        self.env = env or {}
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.log = data_dir / "serve.log"

    def start(self) -> None:
        env = {
            **os.environ,
            "PSTAR_DATA_DIR": str(self.data_dir),
            "PSTAR_API_TOKENS": f"acme:{TOKEN},rival:{RIVAL_TOKEN}",
            **self.env,
        }
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "pstar",
                    "serve",
                    "--port",
                    str(self.port),
                    "--ray-cpus",
                    "4",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )
        deadline = time.time() + 180
        while time.time() < deadline:
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/readyz", timeout=2).status_code == 200:
                    return
            time.sleep(0.5)
        raise AssertionError("pstar serve was not ready in 180 s:\n" + self.log.read_text()[-3000:])

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def terminate(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)

    def client(self, token: str = TOKEN):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=token, max_retries=2)

    def head_pid(self) -> int:
        return json.loads((self.data_dir / "ray" / "head.json").read_text())["pid"]


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


def start_serve(data_dir: Path) -> Serve:
    """`pstar serve` on a data dir holding the tiny Llama the jobs fine-tune."""
    from tests.tiny import make_tiny_llama

    make_tiny_llama(data_dir / "models" / "tiny-llama", hidden=128, layers=4)
    s = Serve(data_dir)
    s.start()
    return s


def stop_serve(s: Serve) -> None:
    from service.local_ray import LocalRayHead

    s.terminate()
    LocalRayHead(s.data_dir / "ray").stop()  # in case a test left it behind


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
