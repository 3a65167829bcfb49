"""`pstar serve`: the control plane process (store, Ray, the API, the reconciler).

With no `RAY_ADDRESS` it starts (or re-attaches to) a local Ray head and stops it on a
clean exit unless asked to keep it; with no `PSTAR_API_TOKENS` it makes one token for
tenant `default` and keeps it in `<data dir>/api_token` (mode 0600), where the CLI finds it.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

from service.settings import Settings, new_token

log = logging.getLogger(__name__)
GRACEFUL_SHUTDOWN_S = 10  # after SIGTERM: requests in flight get this long


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
    from service.launcher import RayLauncher
    from service.local_ray import HEAD_ENV, LocalRayHead
    from service.preflight import check_cluster, check_store
    from service.store import Store

    check_store(settings)
    settings.ensure_dirs()
    settings = ensure_token(settings)
    store = Store(settings.db_url)
    store.migrate()
    head = None
    if settings.ray_address:
        launcher = RayLauncher(settings.ray_address)
        check_cluster(settings, launcher)
    else:
        head = LocalRayHead(
            settings.data_dir / "ray", num_cpus=ray_cpus, dashboard_port=dashboard_port
        )
        info = head.ensure()
        os.environ.setdefault("RAY_AUTH_MODE", HEAD_ENV["RAY_AUTH_MODE"])
        launcher = RayLauncher(info["dashboard_url"])
    return settings, store, launcher, head


def serve(
    settings: Settings,
    host: str = "127.0.0.1",
    port: int = 8000,
    ray_cpus: int | None = None,
    dashboard_port: int | None = None,
    keep_ray: bool = False,
    reconcile_interval_s: float = 1.0,
    on_ready: Any = None,
    *,
    app_factory: Any,
) -> None:
    """Run the control plane until stopped. `app_factory` is `api.app.create_app`, handed
    in by the CLI's serve command: nothing below `api/` imports it."""
    import uvicorn

    settings, store, launcher, head = build(settings, ray_cpus, dashboard_port)
    supervisor = RaySupervisor(head, launcher) if head is not None else None

    def shutdown() -> None:
        if head is not None and not keep_ray:
            # the head takes its Ray jobs' logs with it: keep those of unfinished attempts
            from service.logs import save_attempt_log

            for att in store.open_attempts():
                save_attempt_log(settings, launcher, att)
        store.close()
        if head is not None and not keep_ray:
            log.info("stopping the local Ray head (pid %s)", head.info.get("pid"))
            head.stop()
            log.info("the local Ray head has stopped")

    app = app_factory(
        settings,
        store,
        launcher,
        reconcile=True,
        reconcile_interval_s=reconcile_interval_s,
        ray_supervisor=supervisor,
        on_shutdown=shutdown,
    )
    if on_ready:
        on_ready(settings, launcher, head)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        # open event streams end at shutdown; this bounds whatever else still runs
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )
    stopping_server(config, app).run()


def stopping_server(config: Any, app: Any) -> Any:
    """A uvicorn server that tells the app's open streams to end as soon as a signal asks
    it to stop (uvicorn waits for open connections before the app's own shutdown runs)."""
    import uvicorn

    class _Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            app.state.ctx.streams.closing = True
            super().handle_exit(sig, frame)

    return _Server(config)
