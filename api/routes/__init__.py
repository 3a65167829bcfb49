"""One router per resource: files, models, fine-tuning jobs, and the system routes."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from fastapi.responses import Response
from pydantic import BaseModel

from api.auth import require_tenant
from service.errors import InvalidRequest
from service.job_request import text_problem

Tenant = Annotated[str, Depends(require_tenant)]


def ctx(request: Request):
    return request.app.state.ctx


def respond(model: BaseModel) -> Response:
    """`model` as the JSON response. A sync route that returns a model has FastAPI check
    it against the route's `response_model` on a second trip through the thread pool; ours
    are built from the store by the schema's own constructors, already checked, and
    returning the response saves that trip (~0.1 ms of CPU a request). The route keeps
    its `response_model` for the OpenAPI schema."""
    return Response(model.model_dump_json(), media_type="application/json")


async def plain_text_url(request: Request, _tenant: Tenant) -> None:
    """Refuse a path or query parameter that is not plain text, one with a NUL character
    (checked after the token). No id, cursor or filter holds one, and PostgreSQL's text
    cannot: unchecked, it would reach the store and fail there, a 500 on PostgreSQL (and a
    plain miss on SQLite)."""
    params = [*request.path_params.items(), *request.query_params.multi_items()]
    for name, value in params:
        if why := text_problem(name) or text_problem(str(value)):
            param = name.replace("\x00", "")
            raise InvalidRequest(f"{param}: {why}", param=param, code="invalid_value")


# a server-sent event stream: no caching, and no buffering by a proxy in front of us
STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

# every /v1 router checks these before its routes run
V1_DEPENDENCIES = [Depends(plain_text_url)]
