"""OpenAI's error envelope for every failure: `{"error": {message, type, param, code}}`.

Service errors map to 400/404/409/413/429/503; request validation to 400 naming the field;
an unknown route or method to 404/405; anything else is our bug: 500, logged. The OpenAPI
document says the same: FastAPI's default 422 (with its `detail` list) is replaced by the
400 envelope the handlers below actually send.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from api.schemas import ErrorEnvelope
from service.errors import (
    Conflict,
    Forbidden,
    Gone,
    InvalidRequest,
    NotFound,
    QuotaExceeded,
    ServiceError,
    TooLarge,
    Unauthorized,
    Unavailable,
    describe_invalid,
)
from service.store import is_outage

log = logging.getLogger(__name__)

STATUS = {
    Unauthorized: 401,
    InvalidRequest: 400,
    Forbidden: 403,
    NotFound: 404,
    Conflict: 409,
    Gone: 410,
    TooLarge: 413,
    QuotaExceeded: 429,
    Unavailable: 503,
}
HTTP_METHODS = ("get", "put", "post", "delete", "options", "head", "patch", "trace")
DESCRIPTIONS = {
    400: "Invalid request: the message names the field and what is allowed",
    401: "Missing or wrong bearer token",
    403: "The tenant may not do this to the object",
    404: "No such object for this tenant",
    409: "The object's state does not allow this",
    410: "The object has ended (a finished or idle training session)",
    413: "Request body or upload larger than the server's limit",
    429: "The tenant is at one of its limits (named in the message, with the current use)",
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
    body = {"error": {"message": _utf8(message), "type": type, "param": _utf8(param), "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def _utf8(text: str | None) -> str | None:
    # a message may quote what the client sent; a lone surrogate in it ("\ud800" in a JSON
    # body) has no UTF-8 form and would turn the 400 into a failure to render it, a 500
    if text is None:
        return None
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _service_error(_req: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ServiceError)
    status = next((s for cls, s in STATUS.items() if isinstance(exc, cls)), 400)
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return envelope(status, exc.message, exc.kind, exc.param, exc.code, headers)


def _validation_error(_req: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    if errors and errors[0].get("type") == "json_invalid":
        return envelope(400, "the body is not valid JSON", param="body", code="invalid_json")
    loc, msg, others = describe_invalid(errors)
    # loc[0] says where (body, query, path, header); the rest names the field in it
    param = ".".join(loc[1:]) or (loc[0] if loc else "body")
    more = f" (and {others} more)" if others else ""
    return envelope(400, f"{param}: {msg}{more}", param=param, code="invalid_value")


def _http_error(req: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    headers = getattr(exc, "headers", None)
    if exc.status_code == 404:
        return envelope(404, "No such route; see /docs for the API", code="unknown_url")
    if exc.status_code == 405:
        allowed = _allowed_methods(req, (headers or {}).get("Allow", ""))
        return envelope(
            405,
            f"Method not allowed on this route (allowed: {allowed})",
            code="method_not_allowed",
            headers={"Allow": allowed},  # HTTP requires it on a 405
        )
    return envelope(
        exc.status_code, str(exc.detail), code=getattr(exc, "code", None), headers=headers
    )


def _allowed_methods(req: Request, fallback: str) -> str:
    # Starlette's own `Allow` names the methods of the first route on the path only, and
    # /v1/files has two (GET and POST): take them from the document instead, matching as
    # OpenAPI does (a literal path, /v1/fine_tuning/jobs/validate, before the templated
    # ones that would also match it, /v1/fine_tuning/jobs/{fine_tuning_job_id})
    paths = req.app.openapi().get("paths", {})
    path = req.url.path
    matching = (
        [paths[path]]
        if path in paths
        else [
            ops
            for template, ops in paths.items()
            if re.fullmatch(re.sub(r"\{[^}/]+\}", "[^/]+", template), path)
        ]
    )
    methods = {m.upper() for ops in matching for m in ops if m in HTTP_METHODS}
    return ", ".join(sorted(methods)) or fallback


def _internal_error(req: Request, exc: Exception) -> JSONResponse:
    if is_outage(exc):  # the store is down or restarting: the client should retry
        log.warning("the store is unavailable for %s %s: %s", req.method, req.url.path, exc)
        return envelope(
            503,
            "the service's store cannot be reached right now; retry in a few seconds",
            Unavailable.kind,
            code="store_unavailable",
            headers={"Retry-After": "5"},
        )
    log.exception("unhandled error in %s %s", req.method, req.url.path)
    return envelope(500, "internal server error (a bug: please report it)", "server_error")


def _document_errors(app: FastAPI) -> None:
    """Make `app.openapi()` say what the handlers above send: the envelope, as JSON, for
    400 where FastAPI declares its 422, and for every error of a route whose success is
    not JSON (FastAPI files those under the route's own media type, text/plain say)."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        schema = generate()  # FastAPI's own, cached on the app; fixing it twice is harmless
        ref = {"$ref": "#/components/schemas/ErrorEnvelope"}
        for item in schema.get("paths", {}).values():
            for op in item.values():
                codes = op.get("responses", {})
                if codes.pop("422", None) is not None:
                    codes.setdefault("400", {"description": DESCRIPTIONS[400]})
                for code, entry in codes.items():
                    bodies = entry.get("content", {}).values()
                    if code == "400" or any(b.get("schema") == ref for b in bodies):
                        entry["content"] = {"application/json": {"schema": ref}}
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        if "ErrorEnvelope" not in components:  # no route declared an error model itself
            own = ErrorEnvelope.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(own.pop("$defs", {}), ErrorEnvelope=own)
        for unused in ("HTTPValidationError", "ValidationError"):
            components.pop(unused, None)
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def install(app: FastAPI) -> None:
    app.add_exception_handler(ServiceError, _service_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)
    _document_errors(app)
