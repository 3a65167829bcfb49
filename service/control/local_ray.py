"""The embedded default's Ray: a head on this machine that `pstar serve` starts when no
`RAY_ADDRESS` is given, with the dashboard (Jobs page, job submission API) on loopback.

The head runs `ray start --head --block` in its own session, so it outlives a control
plane killed with SIGKILL: the jobs keep running, and the next `pstar serve` finds the
head again from `head.json` in the data dir and re-attaches. A clean shutdown stops it by
PID (SIGTERM to the blocking `ray start`, which takes its processes down with it).

The head wants a token (Ray's token authentication) that only this data dir's owner can
read (`service.ray_auth`), and advertises loopback: its dashboard and job API answer no
one without the token, and what it starts (drivers, workers) inherits the token's path.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from service import ray_auth

log = logging.getLogger(__name__)

HEAD_ENV = {
    # Ray Train's controller polls workers this often; its default 2 s delays every
    # checkpoint report and the detection of a lost worker
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5",
    # an actor (a process that imports Ray) per worker-group start, watching for node
    # drains: this head's one node is never drained (see service.worker.trainer)
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
    # the head asks each node's raylet how it is every second, not every 3 s: a node that
    # joined this head and died is declared dead after 5 failed checks, ~5 s instead of
    # ~14 s (measured), and its jobs' workers are restarted that much sooner
    "RAY_health_check_period_ms": "1000",
}


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """`n` different ports free now. Their sockets stay bound until all are chosen: one at
    a time, the kernel may hand the same port out twice (a Ray head once got one port
    for two of its components and would not start)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie child counts as gone
    with contextlib.suppress(OSError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        if stat.rsplit(")", 1)[-1].split()[0] == "Z":
            return False
    return True


class LocalRayHead:
    def __init__(
        self,
        state_dir: Path,
        num_cpus: int | None = None,
        dashboard_port: int | None = None,
        object_store_bytes: int = 512 << 20,
    ) -> None:
        self.state_dir = state_dir
        self.state_file = state_dir / "head.json"
        self.num_cpus = num_cpus
        self.dashboard_port = dashboard_port
        self.object_store_bytes = object_store_bytes
        self.info: dict[str, Any] = {}
        self.started_here = False
        self.token_file = state_dir / ray_auth.TOKEN_FILE
        self.env = ray_auth.local_env(self.token_file)  # what a client of this head needs

    @property
    def dashboard_url(self) -> str:
        return self.info["dashboard_url"]

    def _read(self) -> dict[str, Any] | None:
        try:
            return json.loads(self.state_file.read_text())
        except (OSError, ValueError):
            return None

    def running(self) -> bool:
        info = self._read()
        return bool(info and pid_alive(info["pid"]) and self._answers(info["dashboard_url"]))

    def ensure(self, timeout_s: float = 120) -> dict[str, Any]:
        """The head this data dir's service uses: the one still running, or a new one."""
        info = self._read()
        if info and pid_alive(info["pid"]):
            deadline = time.time() + 30
            while time.time() < deadline:
                if self._answers(info["dashboard_url"]):
                    log.info("re-attached to the local Ray head (pid %d)", info["pid"])
                    self.info = info
                    return info
                time.sleep(0.5)
            log.warning(
                "the local Ray head (pid %d) does not answer; starting a new one", info["pid"]
            )
            self._kill(info)
        return self._start(timeout_s)

    def _start(self, timeout_s: float) -> dict[str, Any]:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        tag = hashlib.sha256(str(self.state_dir.resolve()).encode()).hexdigest()[:8]
        temp_dir = Path(f"/tmp/pstar-ray-{tag}")  # short: Ray's socket paths have a limit
        names = [
            "port", "dashboard-port", "ray-client-server-port", "dashboard-agent-listen-port",
            "dashboard-agent-grpc-port", "runtime-env-agent-port", "metrics-export-port",
            "node-manager-port", "object-manager-port",
        ]  # fmt: skip
        # one spare, so that a given dashboard port is never also another component's
        chosen = [p for p in free_ports(len(names) + 1) if p != self.dashboard_port]
        ports = dict(zip(names, chosen, strict=False))
        if self.dashboard_port:
            ports["dashboard-port"] = self.dashboard_port
        ray = str(Path(sys.executable).with_name("ray"))
        cmd = [ray, "start", "--head", "--block", "--disable-usage-stats"]
        cmd += [f"--{k}={v}" for k, v in ports.items()]
        cmd += [
            "--node-ip-address=127.0.0.1",
            "--dashboard-host=127.0.0.1",
            "--include-dashboard=true",
            f"--temp-dir={temp_dir}",
            f"--object-store-memory={self.object_store_bytes}",
        ]
        if self.num_cpus is not None:
            cmd.append(f"--num-cpus={self.num_cpus}")
        ray_auth.local_token(self.state_dir)  # made once, kept across restarts of the head
        logf = (self.state_dir / "head.log").open("ab")
        env = {**os.environ, **HEAD_ENV}
        ray_auth.use(self.env, into=env)
        proc = subprocess.Popen(
            cmd,
            stdout=logf,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # survives a SIGKILL of the control plane
        )
        logf.close()
        url = f"http://127.0.0.1:{ports['dashboard-port']}"
        info = {
            "pid": proc.pid,
            "dashboard_url": url,
            "gcs_address": f"127.0.0.1:{ports['port']}",
            # Ray's client server: training sessions' engines are reached through it, so
            # the API process is not itself a Ray driver (docs/sessions.md)
            "client_address": f"ray://127.0.0.1:{ports['ray-client-server-port']}",
            "metrics_export_port": ports["metrics-export-port"],
            "temp_dir": str(temp_dir),
            "started_at": time.time(),
        }
        self.state_file.write_text(json.dumps(info))
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"the local Ray head exited with code {proc.returncode}; see "
                    f"{self.state_dir / 'head.log'}"
                )
            if self._answers(url):
                self.info, self.started_here = info, True
                log.info("started a local Ray head (pid %d), dashboard %s", proc.pid, url)
                return info
            time.sleep(0.5)
        self._kill(info)
        raise RuntimeError(f"the local Ray head did not answer within {timeout_s:.0f} s")

    # `ray start --block` takes its processes down on SIGTERM but does not itself exit in
    # 10 s (measured): after a short grace the session's process group gets a SIGKILL. The
    # jobs' logs are saved before (control_plane.shutdown_hook), so nothing is lost by it.
    def stop(self, timeout_s: float = 3) -> None:
        info = self._read() or self.info
        if info:
            self._kill(info, timeout_s)
        self.state_file.unlink(missing_ok=True)

    @staticmethod
    def _kill(info: dict[str, Any], timeout_s: float = 3) -> None:
        pid = info["pid"]
        if not pid_alive(pid):
            return
        os.kill(pid, signal.SIGTERM)  # `ray start --block` stops its processes on SIGTERM
        deadline = time.time() + timeout_s
        while time.time() < deadline and pid_alive(pid):
            time.sleep(0.2)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
        # what is left of the session (GCS, raylet, workers of running jobs) goes at once,
        # and stop() returns once the head is gone (a SIGKILL is delivered asynchronously)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
        deadline = time.time() + 10
        while time.time() < deadline and pid_alive(pid):
            time.sleep(0.05)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)

    def _answers(self, url: str) -> bool:
        req = urllib.request.Request(f"{url}/api/version", headers=ray_auth.headers(self.env))
        try:
            with urllib.request.urlopen(req, timeout=2) as r:
                return r.status == 200
        except OSError:
            return False
