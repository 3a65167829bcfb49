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
