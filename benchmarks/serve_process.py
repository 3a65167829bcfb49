"""`pstar serve` in a process of its own, on a port fixed across restarts: started (the
seconds until `/readyz` answered), SIGKILLed, stopped by PID with the local Ray head it
may have left behind. Used by `pstar bench faults` and the end-to-end tests."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


class ServeProcess:
    def __init__(self, data_dir: Path, tokens: str, env: dict[str, str] | None = None) -> None:
        """`tokens` as `PSTAR_API_TOKENS` says them (`tenant:token,...`)."""
        self.data_dir = data_dir
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {
            **os.environ,
            "PSTAR_DATA_DIR": str(data_dir),
            "PSTAR_API_TOKENS": tokens,
            # where its jobs' workers reach it: its own address, whatever this process's
            # environment says (a stale one there sent workers to an API long gone)
            "PSTAR_API_URL": self.url,
            **(env or {}),
        }
        self.proc: subprocess.Popen | None = None
        self.log = data_dir / "serve.log"

    def start(self, timeout: float = 180.0) -> float:
        """Start it; the seconds until `/readyz` answered 200."""
        import httpx

        t0 = time.monotonic()
        cmd = [sys.executable, "-m", "pstar", "serve", "--port", str(self.port)]
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                [*cmd, "--ray-cpus", "4"], stdout=log, stderr=subprocess.STDOUT, env=self.env
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"pstar serve exited:\n{self.log.read_text()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/readyz", timeout=2).status_code == 200:
                    return time.monotonic() - t0
            time.sleep(0.3)
        raise RuntimeError(
            f"pstar serve was not ready in {timeout:.0f} s:\n{self.log.read_text()[-3000:]}"
        )

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def terminate(self) -> None:
        """SIGTERM (a graceful stop), SIGKILL after 90 s."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)

    def stop(self) -> None:
        """Terminate it, and stop a local Ray head a killed serve left behind."""
        from service.control.local_ray import LocalRayHead

        self.terminate()
        LocalRayHead(self.data_dir / "ray").stop()


class ServedModel:
    """`pstar serve` on a fresh data dir holding one model (a symlink to `model_dir`), with
    an HTTP client of its API (`http`, under `/v1`): what `pstar bench rft` and `pstar
    bench tools` run their jobs through. A context manager: the server, its Ray head and
    the data dir are gone after it."""

    def __init__(self, model_dir: Path, name: str, token: str, prefix: str) -> None:
        import tempfile

        self.root = Path(tempfile.mkdtemp(prefix=prefix))
        data_dir = self.root / "data"
        (data_dir / "models").mkdir(parents=True)
        (data_dir / "models" / name).symlink_to(model_dir.resolve())
        self.serve = ServeProcess(data_dir, f"bench:{token}")
        self.token = token
        self.start_s = 0.0
        self.http: Any = None

    def __enter__(self) -> ServedModel:
        import httpx

        try:
            self.start_s = self.serve.start()
            headers = {"Authorization": f"Bearer {self.token}"}
            self.http = httpx.Client(base_url=self.serve.url + "/v1", headers=headers, timeout=600)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *_: Any) -> None:
        import shutil

        if self.http is not None:
            self.http.close()
        self.serve.stop()
        shutil.rmtree(self.root, ignore_errors=True)

    def upload(self, name: str, data: bytes) -> str:
        r = self.http.post("/files", files={"file": (name, data)}, data={"purpose": "fine-tune"})
        r.raise_for_status()
        return str(r.json()["id"])

    def run_job(self, body: dict[str, Any], timeout_s: float) -> tuple[dict[str, Any], float]:
        """Create the job and wait for its end: (the job, seconds from creation to end);
        `RuntimeError` when it is refused, fails or outlasts `timeout_s`."""
        r = self.http.post("/fine_tuning/jobs", json=body)
        if r.status_code != 200:
            raise RuntimeError(f"the job was refused: {r.text}")
        job_id = r.json()["id"]
        t0 = time.monotonic()
        while True:
            job = self.http.get(f"/fine_tuning/jobs/{job_id}").json()
            if job["status"] in ("succeeded", "failed", "cancelled"):
                break
            if time.monotonic() - t0 > timeout_s:
                raise RuntimeError(f"the job did not end in {timeout_s:.0f} s")
            time.sleep(2)
        if job["status"] != "succeeded":
            raise RuntimeError(f"the job {job['status']}: {job.get('error')}")
        return job, time.monotonic() - t0
