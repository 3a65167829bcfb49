"""`/healthz` (the process answers), `/readyz` (the store and Ray answer), `/metrics`."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response

from api.auth import OPERATOR, require_tenant
from api.errors import responses
from api.routes import Tenant, ctx
from api.schemas import Health
from service.errors import Unauthorized

router = APIRouter(tags=["system"])


_OK = Health(status="ok").model_dump_json()


@router.get("/healthz", response_model=Health)
async def healthz() -> Response:
    """The process is up (no token needed); answered on the event loop, so a probe is
    answered while every request thread is busy."""
    return Response(_OK, media_type="application/json")


# an anonymous probe's answer may be this old: a flood of probes costs one query of the
# store and one call to Ray per period, not one each; a caller with a token always asks
READY_CACHE_S = 2.0


@router.get("/readyz", response_model=Health, responses={503: {"model": Health}})
async def readyz(request: Request):
    """The store and Ray are reachable; 503 says which is not. Without a token (a probe)
    only ok or unavailable per part, as found in the last 2 s; with one, also why, and the
    Ray dashboard's address, found now."""
    c = ctx(request)
    trusted = await _has_token(request)
    now = time.monotonic()
    if not trusted and c.readiness is not None and now - c.readiness[0] < READY_CACHE_S:
        checks = c.readiness[1]
    else:
        checks = {}
        for name, probe in (("store", c.store.ping), ("ray", c.launcher.ping)):
            try:
                await run_in_threadpool(probe)
                checks[name] = "ok"
            except Exception as e:
                why = getattr(e, "message", None) or e
                checks[name] = f"unavailable: {why}"
        c.readiness = (now, checks)
    ok = all(v == "ok" for v in checks.values())
    body = Health(
        status="ok" if ok else "unavailable",
        checks=checks if trusted else {k: v.split(":")[0] for k, v in checks.items()},
        ray_dashboard_url=getattr(c.launcher, "dashboard_url", None) if trusted else None,
    )
    return JSONResponse(body.model_dump(), status_code=200 if ok else 503)


async def _has_token(request: Request) -> bool:
    try:
        await require_tenant(request)
    except Unauthorized:
        return False
    return True


@router.get(
    "/metrics",
    response_class=Response,
    responses={200: {"content": {"text/plain": {}}}, **responses(401)},
)
def metrics(request: Request, tenant: Tenant) -> Response:
    """The control plane's metrics in Prometheus' text format: requests by route and the
    caller's jobs by status (every tenant's with the operator's PSTAR_METRICS_TOKEN)."""
    c = ctx(request)
    scope = None if tenant == OPERATOR else tenant
    return Response(c.metrics.render(scope), media_type="text/plain; version=0.0.4")
