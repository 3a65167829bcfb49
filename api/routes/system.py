"""`/healthz` (the process answers), `/readyz` (the store and Ray answer), `/metrics`."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response

from api.errors import responses
from api.routes import Tenant, ctx
from api.schemas import Health

router = APIRouter(tags=["system"])


@router.get("/healthz", response_model=Health)
def healthz() -> Health:
    """The process is up (no token needed)."""
    return Health(status="ok")


@router.get("/readyz", response_model=Health, responses={503: {"model": Health}})
async def readyz(request: Request):
    """The store and Ray are reachable (no token needed); 503 says which is not."""
    c = ctx(request)
    checks: dict[str, str] = {}
    for name, probe in (("store", c.store.ping), ("ray", c.launcher.ping)):
        try:
            await run_in_threadpool(probe)
            checks[name] = "ok"
        except Exception as e:
            checks[name] = f"unavailable: {getattr(e, 'message', None) or e}"
    ok = all(v == "ok" for v in checks.values())
    body = Health(
        status="ok" if ok else "unavailable",
        checks=checks,
        ray_dashboard_url=getattr(c.launcher, "dashboard_url", None),
    )
    return JSONResponse(body.model_dump(), status_code=200 if ok else 503)


@router.get(
    "/metrics",
    response_class=Response,
    responses={200: {"content": {"text/plain": {}}}, **responses(401)},
)
def metrics(request: Request, _tenant: Tenant) -> Response:
    """The control plane's metrics in Prometheus' text format."""
    return Response(ctx(request).metrics.render(), media_type="text/plain; version=0.0.4")
