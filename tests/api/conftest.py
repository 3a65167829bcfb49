"""An API server for the tests: the real app on uvicorn in a thread, on loopback, with
a dry launcher (jobs are submitted but nothing runs) and two tenants, on SQLite and on
PostgreSQL. Tests call it the way users do: the `openai` SDK and plain HTTP."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.conftest import fresh_database

TOKENS = {"acme": "tok-acme-0123456789", "rival": "tok-rival-0123456789"}
# the `tinker` SDK takes only keys that start with "tml-"
TINKER_TOKENS = {"acme": "tml-acme-0123456789", "rival": "tml-rival-0123456789"}
EMBEDDER = "tiny-embedder"  # the embedding model of the shared `api` fixture


@dataclass
class ApiServer:
    url: str
    settings: object
    store: object
    launcher: object
    backend: str
    models: object = None  # the in-process model backend, when the API has one
    ctx: object = None  # the app's services (`app.state.ctx`)
    tinker_clients: list = field(default_factory=list)  # closed before the server stops

    def tinker(self, tenant: str = "acme", **options):
        """A `tinker.ServiceClient` for the tenant. It is closed (its session finished, its
        heartbeat stopped) before the server stops: a heartbeat left running warns into
        every later test's log."""
        import tinker

        sc = tinker.ServiceClient(base_url=self.url, api_key=TINKER_TOKENS[tenant], **options)
        self.tinker_clients.append(sc)
        return sc

    @property
    def base(self) -> str:
        return f"{self.url}/v1"

    def client(self, tenant: str = "acme"):
        from openai import OpenAI

        return OpenAI(base_url=self.base, api_key=TOKENS[tenant], max_retries=0)

    def headers(self, tenant: str = "acme") -> dict[str, str]:
        return {"Authorization": f"Bearer {TOKENS[tenant]}"}


@contextlib.contextmanager
def api_in_process(tmp_path_factory, name: str, **settings: object) -> Iterator[ApiServer]:
    """An API on SQLite whose models answer from this process (no Ray Serve); `settings`:
    Settings fields."""
    data_dir = tmp_path_factory.mktemp(name)
    server, stop = start_api(
        data_dir,
        f"sqlite:///{data_dir / 'store.db'}",
        "sqlite",
        models_in_process=True,
        **settings,
    )
    try:
        yield server
    finally:
        stop()


def start_api(
    data_dir: Path,
    db_url: str,
    backend: str,
    max_upload: int = 1 << 20,
    models_in_process: bool = False,
    **settings: object,
):
    import uvicorn

    from api.app import create_app
    from service.control.launcher import DryLauncher
    from service.settings import Settings
    from service.store import Store
    from tests.tiny import make_tiny_llama

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    settings = Settings(
        data_dir=data_dir,
        db_url=db_url,
        api_url=f"http://127.0.0.1:{port}",  # where a job's score_model graders ask
        tokens={tok: tenant for t in (TOKENS, TINKER_TOKENS) for tenant, tok in t.items()},
        max_upload_bytes=max_upload,
        **settings,
    )
    settings.ensure_dirs()
    make_tiny_llama(settings.models_dir / "tiny-llama")
    store = Store(db_url)
    store.migrate()
    launcher = DryLauncher()
    model_backend = None
    if models_in_process:
        from api.generate import LocalBackend

        model_backend = LocalBackend(data_dir, max_batch=8)
    app = create_app(
        settings,
        store,
        launcher,
        reconcile=True,
        reconcile_interval_s=0.1,
        backend=model_backend,
    )
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started:
        if time.time() > deadline:
            raise RuntimeError("the API server did not start")
        time.sleep(0.02)
    api = ApiServer(
        f"http://127.0.0.1:{port}", settings, store, launcher, backend, model_backend, app.state.ctx
    )

    def stop() -> None:
        try:
            for sc in api.tinker_clients:
                sc.close("success").result(timeout=60)
        finally:
            server.should_exit = True
            thread.join(timeout=30)
            store.close()

    return api, stop


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def api(request, tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("api")
    if request.param == "sqlite":
        url = f"sqlite:///{data_dir / 'store.db'}"
    else:
        url = fresh_database(request.getfixturevalue("pg_server"))
    server, stop = start_api(
        data_dir,
        url,
        request.param,
        max_upload=64 * 1024,
        models_in_process=True,
        embedding_model=request.getfixturevalue("embedder_dir"),
    )
    yield server
    stop()


@pytest.fixture(scope="session")
def embedder_dir(tmp_path_factory) -> Path:
    """A tiny embedding model (`EMBEDDER`), made once for the session's APIs."""
    from tests.tiny import make_tiny_embedder

    return make_tiny_embedder(tmp_path_factory.mktemp("embedder") / EMBEDDER)


def run_job(api, job_id: str, pause_at: int | None = None) -> dict:
    """The job run to its end as its driver and its one worker run it, in this process (or
    paused at step `pause_at`, as its owner's pause would); its metric series."""
    from service.control.driver import prepare_run
    from service.worker.finetune import build_job_engine
    from service.worker.loop import run_loop
    from service.worker.reporting import Reporter
    from service.worker.train_local import DirCheckpoints
    from tests.service.test_store import driver_attempt

    attempt = driver_attempt(api.store, job_id)
    run = prepare_run(api.settings, api.store, api.store.jobs.get(job_id), attempt)
    engine = build_job_engine(run)
    rep = Reporter({"job_id": job_id, "attempt": attempt, "run": run}, 0, api.store)
    if pause_at is not None:
        rep.pause_requested = lambda: engine.global_step >= pause_at  # type: ignore[method-assign]
    out = run_loop(run, engine, 0, 1, rep, DirCheckpoints(api.settings.data_dir / job_id, run.lora))
    if (out or {}).get("paused_at_step"):  # as the driver ends a paused attempt
        api.store.attempts.end_paused(job_id, attempt)
    import httpx

    got = httpx.get(f"{api.base}/fine_tuning/jobs/{job_id}/metrics", headers=api.headers())
    return got.json()["series"]
