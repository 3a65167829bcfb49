"""`pstar serve`: the control plane process, the API served by uvicorn over the parts
`service.control.control_plane` puts together (store, Ray, the reconciler inside the app)."""

from __future__ import annotations

import contextlib
import socket
from typing import Any

from api.app import create_app
from service.control.control_plane import RaySupervisor, build, shutdown_hook
from service.settings import Settings

GRACEFUL_SHUTDOWN_S = 10  # after SIGTERM: requests in flight get this long


class ListenError(RuntimeError):
    """The API's address cannot be listened on (another process has the port)."""


def listen(host: str, port: int) -> socket.socket:
    """The API's socket, bound before anything else starts: the local Ray head opens dozens
    of ports as it starts, and one of them could otherwise be this one; a port already in
    use fails here, before Ray is started for nothing."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        # listening, not only bound: a socket that is merely bound does not keep a later
        # SO_REUSEADDR bind (gRPC's, in Ray) off the port
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise ListenError(
            f"cannot listen on {host}:{port}: {e.strerror}; another process may be serving "
            "there: stop it, or choose another port with --port"
        ) from e
    return sock


def serve(
    settings: Settings,
    host: str = "127.0.0.1",
    port: int = 8000,
    ray_cpus: int | None = None,
    dashboard_port: int | None = None,
    keep_ray: bool = False,
    reconcile_interval_s: float = 1.0,
    on_ready: Any = None,
) -> None:
    """Run the control plane until stopped."""
    import uvicorn

    with contextlib.closing(listen(host, port)) as sock:
        settings, store, launcher, head = build(settings, ray_cpus, dashboard_port)
        app = create_app(
            settings,
            store,
            launcher,
            reconcile=True,
            reconcile_interval_s=reconcile_interval_s,
            ray_supervisor=RaySupervisor(head, launcher) if head is not None else None,
            on_shutdown=shutdown_hook(settings, store, launcher, head, keep_ray),
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
        stopping_server(config, app).run(sockets=[sock])


def stopping_server(config: Any, app: Any) -> Any:
    """A uvicorn server that tells the app's open streams to end as soon as a signal asks
    it to stop (uvicorn waits for open connections before the app's own shutdown runs)."""
    import uvicorn

    class _Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            app.state.ctx.streams.closing = app.state.ctx.generations.closing = True
            super().handle_exit(sig, frame)

    return _Server(config)
