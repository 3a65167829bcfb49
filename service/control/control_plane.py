"""The control plane's parts, put together: the store, the Ray launcher and (with no
`RAY_ADDRESS`) a local Ray head kept up by a supervisor, and the API token.

With no `RAY_ADDRESS` it starts (or re-attaches to) a local Ray head, stopped on a clean
exit unless asked to keep it; with no `PSTAR_API_TOKENS` it makes one token for tenant
`default` and keeps it in `<data dir>/api_token` (mode 0600), where the CLI finds it. The
HTTP server that serves the API over these parts is `pstar.server` (nothing here knows
HTTP).
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

from service import ray_auth
from service.settings import Settings, SettingsError, new_token, redacted

log = logging.getLogger(__name__)


def token_file(settings: Settings) -> Path:
    return settings.data_dir / "api_token"


def ensure_token(settings: Settings) -> Settings:
    """Settings with at least one token: the configured ones, or the data dir's own."""
    if settings.tokens:
        return settings
    path = token_file(settings)
    if path.is_file():
        token = path.read_text().strip()
    else:
        token = new_token()
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
    return replace(settings, tokens={token: "default"})


class RaySupervisor:
    """Keeps the embedded local head up: restarts it if it died, and points the launcher
    at it (its ports may change). Jobs whose head died get new attempts (reconciler)."""

    def __init__(self, head: Any, launcher: Any) -> None:
        self.head, self.launcher = head, launcher

    def __call__(self) -> None:
        if self.head.running():
            return
        log.warning("the local Ray head is gone; starting a new one")
        info = self.head.ensure()
        self.launcher.retarget(info["dashboard_url"])


def build(settings: Settings, ray_cpus: int | None = None, dashboard_port: int | None = None):
    """(settings, store, launcher, local head or None) for a control plane."""
    from service.control.launcher import RayLauncher
    from service.control.local_ray import LocalRayHead
    from service.control.preflight import check_cluster, check_store
    from service.store import Store, is_outage

    check_store(settings)
    settings.ensure_dirs()
    settings = ensure_token(settings)
    store = Store(settings.db_url)
    try:
        store.migrate()
    except Exception as e:
        if not is_outage(e):
            raise
        reason = str(getattr(e, "orig", None) or e).splitlines()[0]
        raise SettingsError(
            f"the store at {redacted(settings.db_url)} cannot be reached ({reason}): start "
            "it, or fix PSTAR_DB_URL / PSTAR_DB_URL_FILE"
        ) from None
    head = None
    if settings.ray_address:
        launcher = RayLauncher(settings.ray_address)
        check_cluster(settings, launcher)
        if settings.session_engines == "ray" and not settings.session_ray_address:
            address = client_address(settings.ray_address)
            if answers(address):
                settings = replace(settings, session_ray_address=address)
            else:  # a job server reached some other way (a port-forward of 8265 alone)
                log.warning(
                    "Ray's client port at %s does not answer: training sessions' engines "
                    "run in this process; set PSTAR_SESSION_RAY_ADDRESS to the cluster's "
                    "ray:// address to run them in Ray actors",
                    address,
                )
                settings = replace(settings, session_engines="local")
    else:
        head = LocalRayHead(
            settings.data_dir / "ray", num_cpus=ray_cpus, dashboard_port=dashboard_port
        )
        info = head.ensure()
        # Ray's clients in this process (the job API's) find the head's token from here
        ray_auth.use(head.env)
        launcher = RayLauncher(info["dashboard_url"])
        if settings.session_engines == "ray" and not settings.session_ray_address:
            address = info.get("client_address") or info["gcs_address"]  # an older head's
            settings = replace(settings, session_ray_address=address)
    return settings, store, launcher, head


def client_address(ray_address: str) -> str:
    """The Ray client address of the cluster whose job server is at `ray_address`: its
    head's client server, on Ray's (and KubeRay's head service's) port 10001."""
    from urllib.parse import urlsplit

    host = urlsplit(ray_address if "://" in ray_address else f"http://{ray_address}").hostname
    return f"ray://[{host}]:10001" if host and ":" in host else f"ray://{host}:10001"


def answers(address: str, timeout_s: float = 3.0) -> bool:
    """Whether something listens at a ray:// address's host and port."""
    import socket
    from urllib.parse import urlsplit

    parts = urlsplit(address)
    try:
        with socket.create_connection((parts.hostname or "", parts.port or 10001), timeout_s):
            return True
    except OSError:
        return False


def shutdown_hook(settings: Settings, store: Any, launcher: Any, head: Any, keep_ray: bool):
    """What a control plane does on a clean exit: keep the logs of unfinished attempts (a
    local head takes its Ray jobs' logs with it), close the store, stop the local head."""

    def shutdown() -> None:
        if head is not None and not keep_ray:
            from service.control.logs import save_attempt_log

            for att in store.attempts.open():
                save_attempt_log(settings, launcher, att)
        store.close()
        if head is not None and not keep_ray:
            log.info("stopping the local Ray head (pid %s)", head.info.get("pid"))
            head.stop()
            log.info("the local Ray head has stopped")

    return shutdown
