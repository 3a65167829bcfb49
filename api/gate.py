"""The gate every request passes before its body is read: the key, then the size.

FastAPI reads and parses a JSON body before a route's dependencies run, so a key checked in
a dependency is checked after the body is in memory: an anonymous 200 MB POST would cost
the server its 200 MB (and more, parsed) before its 401. Here, as a plain ASGI middleware:

- a request to a keyed path (`/v1/...`, `/metrics`) without a valid key gets its 401 with
  nothing of its body read; the tenant found is handed to the routes (`auth.require_tenant`
  reads it, so a key is compared once per request). A key is a token of
  `PSTAR_API_TOKENS` or one of the store's keys (`auth.KeyCache`); which routes a key's
  role reaches, the routes' dependencies say (`auth.require_tenant`, `routes.admin`), after
  the route is matched (an unknown method is a 405 for every key);
- a body over `PSTAR_MAX_REQUEST_BYTES` gets a 413: at once when its `Content-Length` says
  so, and as soon as that many bytes have arrived when it does not (a chunked body). An
  upload (`POST /v1/files`) is streamed to disk under its own limit
  (`PSTAR_MAX_UPLOAD_BYTES`, `service.control.files`), so only its key is checked here.
"""

from __future__ import annotations

from typing import Any

from fastapi import HTTPException
from starlette.datastructures import Headers

from api.auth import TENANT, KeyCache, authenticate, bearer_secret, unauthorized
from api.errors import envelope
from service.settings import Settings

KEYED = ("/v1/", "/metrics", "/api/v1/")  # the last: Tinker's routes (its SDK's X-API-Key)
UPLOAD = ("POST", "/v1/files")


class BodyTooLarge(HTTPException):
    """Raised from the body's `receive` when a chunked body passes the limit: FastAPI lets an
    `HTTPException` met while reading a body through as it is (any other becomes a 400)."""

    code = "request_too_large"

    def __init__(self, limit: int) -> None:
        # the rest of the body stays unread: this connection cannot carry another request
        super().__init__(413, too_large(limit), headers={"Connection": "close"})


def too_large(limit: int) -> str:
    return (
        f"the request body is larger than this server's limit of {limit:,} bytes "
        "(PSTAR_MAX_REQUEST_BYTES); send less per request (files go to POST /v1/files)"
    )


class Gate:
    def __init__(self, app: Any, settings: Settings, keys: KeyCache | None = None) -> None:
        self.app, self.settings, self.keys = app, settings, keys
        self.limit = settings.limits.max_request_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        headers = Headers(scope=scope)
        if path.startswith(KEYED):
            secret = bearer_secret(headers.get("authorization"))
            if secret is None and path.startswith("/api/v1/"):
                secret = headers.get("x-api-key") or None
            tenant, role = authenticate(self.settings, path, secret), TENANT
            if tenant is None and secret is not None and self.keys is not None:
                tenant, role = await self.keys.lookup(secret) or (None, TENANT)
            if tenant is None:
                await _reply(scope, receive, send, unauthorized(), 401, "invalid_api_key")
                return
            scope.setdefault("state", {}).update(tenant=tenant, role=role)
        if (scope["method"], path) == UPLOAD:
            await self.app(scope, receive, send)
            return
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            # a Content-Length that is not a number is h11's 400 before we see it; a
            # number past the limit is refused before one byte of the body is read
            await _reply(scope, receive, send, too_large(self.limit), 413, BodyTooLarge.code)
            return
        await self.app(scope, _capped(receive, self.limit), send)


def _capped(receive: Any, limit: int) -> Any:
    seen = 0

    async def counting() -> dict:
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                raise BodyTooLarge(limit)
        return message

    return counting


async def _reply(scope: dict, receive: Any, send: Any, message: str, status: int, code: str):
    # the body is left unread, so the connection cannot carry another request
    headers = {"Connection": "close"}
    if status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    await envelope(status, message, code=code, headers=headers)(scope, receive, send)
