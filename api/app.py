"""`create_app(...)`: the FastAPI app of the control plane.

One router per resource (files, models, fine-tuning jobs, system); the store, the job
service and the launcher hang off `app.state.ctx`. With `reconcile=True` the app runs the
reconciler in a background thread for its lifetime.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI

from api import errors, ui
from api.auth import KeyCache
from api.context import Context, Streams
from api.gate import Gate
from service.control.jobs import JobService
from service.settings import Settings
from service.store import Store

log = logging.getLogger(__name__)


async def sweep_sessions(sessions: Any, every_s: float) -> None:
    """End idle and lost training sessions, freeing their engines, even while no one
    creates another (which also sweeps)."""
    while True:
        await asyncio.sleep(every_s)
        try:
            await asyncio.to_thread(sessions.end_idle)  # a Ray engine takes seconds to stop
        except Exception:  # the next round tries again; a 500 is not ours to give here
            log.exception("ending idle training sessions")


def session_hosts(settings: Settings, ray_address: str | None = None):
    """Where training sessions' engines run (PSTAR_SESSION_ENGINES; Ray's at
    `ray_address`, else the settings')."""
    from service.sessions.hosts import RayHosts, local_hosts

    if settings.session_engines == "ray":
        res = settings.default_resources
        options: dict = {"num_cpus": res.get("cpus_per_worker") or 1}
        if res.get("memory_per_worker"):  # what the fit check plans within, reserved
            options["memory"] = int(res["memory_per_worker"])
        return RayHosts(ray_address or settings.session_ray_address, options)
    return local_hosts


def create_app(
    settings: Settings,
    store: Store,
    launcher: Any,
    *,
    reconcile: bool = False,
    reconcile_interval_s: float = 1.0,
    ray_supervisor: Any = None,
    on_shutdown: Any = None,
    backend: Any = None,
) -> FastAPI:
    from api.generate import RayServeBackend
    from api.metrics import ApiMetrics
    from api.routes import (
        admin,
        completions,
        embeddings,
        files,
        graders,
        jobs,
        models,
        rollouts,
        system,
        tinker,
    )
    from service.control import storage
    from service.control.heavy import HeavyWork
    from service.control.reconciler import job_workers
    from service.serving.deployments import Serving
    from service.sessions.runtime import Sessions

    ctx = Context(settings, store, launcher, JobService(settings, store, launcher))
    ctx.metrics = ApiMetrics(store)
    ctx.streams = Streams(settings.limits.max_event_streams_per_tenant)
    ctx.generations = Streams(
        settings.limits.max_concurrent_generations_per_tenant,
        setting="max_concurrent_generations_per_tenant",
        what="generations in flight",
        hint="wait for one to finish",
        code="too_many_generations",
    )
    ctx.serving = Serving(
        settings,
        lambda: getattr(launcher, "dashboard_url", None),
        training_waiting=lambda: store.jobs.count_by_status().get("queued", 0),
    )
    ctx.backend = backend or RayServeBackend(ctx.serving)
    if settings.embedding_model is not None:
        from service.serving.embeddings import Embedder

        ctx.embedder = Embedder(settings.embedding_model)
        # one batch at a time (the embedder's own lock), a bounded queue before it (a 503
        # past it), and a tenant's share of it (a 429 past it), so neither a burst of
        # embeddings nor one tenant's job's grading holds the server's threads
        ctx.embedding_work = HeavyWork(
            workers=1,
            queue=16,
            timeout_s=120.0,
            per_tenant=8,
            what="embedding requests",
            smaller="fewer or shorter texts",
        )
    ctx.sessions = Sessions(
        settings,
        check_quota=lambda tenant: storage.check_quota(settings, store, tenant, ctx.jobs.usage),
        observe=ctx.metrics.session_op,
        hosts=session_hosts(settings),
        job_workers=lambda tenant: job_workers(store, tenant),
    )

    session_ray = {"at": settings.session_ray_address}  # where session engines' Ray is

    def ray_down() -> None:
        """The embedded head is gone: the supervisor starts another (new ports), and the
        session engines' Ray client follows it there if that head was where it went."""
        head = getattr(ray_supervisor, "head", None)
        before = head.info.get("client_address") if head is not None else None
        ours = settings.session_engines == "ray" and before and session_ray["at"] == before
        moving = bool(ours and head is not None and not head.running())
        if moving:
            # their requests fail at once from now on, not after Ray's client has waited
            # 30 s for the dead head; new models wait for the new one (seconds)
            lost = ctx.sessions.lose_engines("their Ray head died")
            if lost:
                log.warning("training models whose engines died with the Ray head: %s", lost)
            ctx.sessions.hosts_moving()
        new_hosts = None
        try:
            ray_supervisor()
        finally:
            after = head.info.get("client_address") if head is not None else None
            if ours and after and before != after:
                session_ray["at"] = after
                new_hosts = session_hosts(settings, after)
            if moving or new_hosts is not None:
                ctx.sessions.hosts_moved(new_hosts)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        if reconcile:
            from service.control.reconciler import Reconciler

            ctx.reconciler = Reconciler(
                settings,
                store,
                launcher,
                interval_s=reconcile_interval_s,
                on_ray_down=ray_down if ray_supervisor is not None else None,
                session_workers=ctx.sessions.workers_held,
            )
            ctx.reconciler.start()
        limits = settings.limits
        every_s = max(0.1, min(10.0, limits.session_lost_s / 4, limits.session_idle_s / 4))
        sweeper = asyncio.create_task(sweep_sessions(ctx.sessions, every_s))
        try:
            yield
        finally:
            sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sweeper
            ctx.streams.closing = ctx.generations.closing = True
            await ctx.backend.aclose()
            ctx.sessions.close()
            if ctx.embedding_work is not None:
                ctx.embedding_work.shutdown()
            if ctx.reconciler is not None:
                ctx.reconciler.stop()
            if on_shutdown is not None:
                # here, not after uvicorn returns: uvicorn re-raises the SIGTERM it caught
                # once the app has shut down, which ends the process
                on_shutdown()

    app = FastAPI(
        title="PatrickStar Service",
        version="0.1.0",
        description=(
            "Fine-tuning with the PatrickStar chunk engine on Ray. OpenAI-compatible under "
            "/v1 (files, models, fine_tuning.jobs, events, checkpoints, chat and text "
            "completions of every base and fine-tuned model), plus a dry-run "
            "validate, metric series, the memory tracer timeline and logs."
        ),
        lifespan=lifespan,
        docs_url="/docs" if settings.api_docs else None,
        redoc_url="/redoc" if settings.api_docs else None,
        openapi_url="/openapi.json" if settings.api_docs else None,
    )
    app.state.ctx = ctx
    errors.install(app)

    # the gate answers a request without a key, or with a body too large, before reading
    # the body; outside it, the metrics count those answers too
    ctx.keys = KeyCache(store)
    app.add_middleware(Gate, settings=settings, keys=ctx.keys)
    app.add_middleware(_Observe, metrics=ctx.metrics)

    # routes are matched in the order they are added: the most requested first
    app.include_router(jobs.router, prefix="/v1")
    app.include_router(files.router, prefix="/v1")
    app.include_router(models.router, prefix="/v1")
    app.include_router(completions.router, prefix="/v1")
    app.include_router(embeddings.router, prefix="/v1")
    app.include_router(rollouts.router, prefix="/v1")
    app.include_router(graders.router, prefix="/v1")
    app.include_router(admin.router, prefix="/v1")
    app.include_router(tinker.router)
    app.include_router(tinker.overview_router, prefix="/v1")
    app.include_router(system.router)
    ui.install(app)
    _declare_plain_text_parameters(app)
    return app


class _Observe:
    """Request counts and latency by route template, as a plain ASGI middleware (Starlette's
    `BaseHTTPMiddleware` costs a task and a stream copy per request). The latency runs to
    the response's start: a stream's length is not the server's speed."""

    def __init__(self, app: Any, metrics: Any) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        started = False

        async def sending(message: dict) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                self._observe(scope, message["status"], t0)
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except BaseException:
            if not started:  # the outermost handler answers 500
                self._observe(scope, 500, t0)
            raise

    def _observe(self, scope: dict, status: int, t0: float) -> None:
        # the route's template, not the URL: ids must not become label values
        template = getattr(scope.get("route"), "path", None) or "unmatched"
        if scope["path"].startswith("/v1/") and not template.startswith("/v1"):
            template = "/v1" + template  # routers included under /v1 report their own path
        self.metrics.observe(scope["method"], template, status, time.perf_counter() - t0)


def _declare_plain_text_parameters(app: FastAPI) -> None:
    """Say in the OpenAPI schema what `routes.plain_text_url` enforces: no path or query
    string holds U+0000 (a request with one gets a 400), so a client generated from the
    schema, or a fuzzer, knows it is not a valid value."""
    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = build()
            for item in schema.get("paths", {}).values():
                for op in item.values():
                    for param in op.get("parameters", []) if isinstance(op, dict) else []:
                        _no_nul(param.get("schema", {}))
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _no_nul(schema: dict) -> None:
    if schema.get("type") == "string" and "pattern" not in schema:
        schema["pattern"] = "^[^\\u0000]*$"
    for sub in schema.get("anyOf", []):
        _no_nul(sub)
