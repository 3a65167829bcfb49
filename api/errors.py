"""OpenAI's error envelope for every failure: `{"error": {message, type, param, code}}`.

Service errors map to 400/404/409/413/503; request validation to 400 naming the field;
an unknown route or method to 404/405; anything else is our bug: 500, logged.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from api.schemas import ErrorEnvelope
from service.errors import (
    Conflict,
    InvalidRequest,
    NotFound,
    ServiceError,
    TooLarge,
    Unauthorized,
    Unavailable,
)

log = logging.getLogger(__name__)

STATUS = {
    Unauthorized: 401,
    InvalidRequest: 400,
    NotFound: 404,
    Conflict: 409,
    TooLarge: 413,
    Unavailable: 503,
}
DESCRIPTIONS = {
    400: "Invalid request: the message names the field and what is allowed",
    401: "Missing or wrong bearer token",
    404: "No such object for this tenant",
    409: "The object's state does not allow this",
    413: "Upload larger than the server's limit",
    503: "A part the request needs (Ray, the store) cannot be reached now",
}


def responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI entries for the error statuses a route can return."""
    return {c: {"model": ErrorEnvelope, "description": DESCRIPTIONS[c]} for c in codes}


def envelope(
    status: int,
    message: str,
    type: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    body = {"error": {"message": message, "type": type, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def _service_error(_req: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ServiceError)
    status = next((s for cls, s in STATUS.items() if isinstance(exc, cls)), 400)
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return envelope(status, exc.message, exc.kind, exc.param, exc.code, headers)


def _validation_error(_req: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    if first.get("type") == "json_invalid":
        return envelope(400, "the body is not valid JSON", param="body", code="invalid_json")
    loc = [str(x) for x in first.get("loc", ()) if not str(x).startswith("function-after")]
    where = loc[0] if loc else "body"
    param = ".".join(loc[1:]) or where
    msg = str(first.get("msg", "invalid")).removeprefix("Value error, ")
    if first.get("type") == "missing":
        msg = "is required"
    elif first.get("type") == "extra_forbidden":
        msg = "unknown field; see the API reference for the fields allowed here"
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return envelope(400, f"{param}: {msg}{more}", param=param, code="invalid_value")


def _http_error(_req: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 404:
        return envelope(404, "No such route; see /docs for the API", code="unknown_url")
    if exc.status_code == 405:
        return envelope(405, "Method not allowed on this route", code="method_not_allowed")
    return envelope(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))


def _internal_error(req: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error in %s %s", req.method, req.url.path)
    return envelope(500, "internal server error (a bug: please report it)", "server_error")


def install(app: FastAPI) -> None:
    app.add_exception_handler(ServiceError, _service_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)
