"""Bearer tokens: `Authorization: Bearer TOKEN`, each token belonging to one tenant.

Every token is compared in constant time, and all of them are compared every time, so
neither timing nor order tells a caller anything about the configured tokens. The check
runs once per request, in `api.gate.Gate` before the body is read; routes take the tenant
it found (`require_tenant`).
"""

from __future__ import annotations

import hmac
import re
import time
from collections import OrderedDict
from typing import Any

from fastapi import Request
from fastapi.concurrency import run_in_threadpool

from service.errors import Forbidden, Unauthorized
from service.settings import Settings
from service.store.keys import GRADER, key_hash

# the tenant of PSTAR_METRICS_TOKEN: it may read /metrics for every tenant, and nothing else
OPERATOR = "~operator"
TENANT, ADMIN = "tenant", "admin"  # the roles of a key (store.keys)
# all a GRADER key may ask: its model graders' questions, its cosine metric's embeddings,
# and its job's answers from the model server (the route checks the job is the key's)
GRADER_REACHES = {("POST", "/v1/chat/completions"), ("POST", "/v1/embeddings")}
ROLLOUTS = re.compile(r"/v1/internal/jobs/[^/]+/rollouts")


def tenant_of(tokens: dict[str, str], presented: str) -> str | None:
    """The tenant of the presented token: each configured one is compared, a `sha256:`
    one with the presented token's SHA-256 (the operator keeps only the hash)."""
    found = None
    given = presented.encode()
    hashed = ("sha256:" + key_hash(presented)).encode()
    for token, tenant in tokens.items():
        if hmac.compare_digest(token.encode(), hashed if token.startswith("sha256:") else given):
            found = tenant
    return found


def authenticate(settings: Settings, path: str, presented: str | None) -> str | None:
    """The tenant whose token (PSTAR_API_TOKENS, or the metrics token) is `presented` (a
    bearer secret), or None; the keys in the store are the gate's to look up."""
    if presented is None:
        return None
    tenant = tenant_of(settings.tokens, presented)
    if (
        tenant is None
        and settings.metrics_token
        and path == "/metrics"
        and hmac.compare_digest(settings.metrics_token.encode(), presented.encode())
    ):
        tenant = OPERATOR
    return tenant


def bearer_secret(authorization: str | None) -> str | None:
    scheme, _, presented = (authorization or "").partition(" ")
    presented = presented.strip()
    return presented if scheme.lower() == "bearer" and presented else None


class KeyCache:
    """The store's keys (`store.keys`) as the gate asks for them: (tenant, role) of a live
    key, kept `ttl_s` seconds, and unknown secrets as unknown for as long, so that a flood
    of wrong keys costs one query each per `ttl_s`, not one per request. A key revoked
    through this API is forgotten at once; one revoked by `pstar keys revoke` in another
    process stops working within `ttl_s`. Entries are the secrets' hashes, not secrets."""

    def __init__(self, store: Any, ttl_s: float = 5.0, size: int = 10_000) -> None:
        self.store, self.ttl_s, self.size = store, ttl_s, size
        self._entries: OrderedDict[str, tuple[float, tuple[str, str] | None]] = OrderedDict()

    async def lookup(self, secret: str) -> tuple[str, str] | None:
        h = key_hash(secret)
        now = time.monotonic()
        hit = self._entries.get(h)
        if hit is not None and now - hit[0] < self.ttl_s:
            return hit[1]
        key = await run_in_threadpool(self.store.keys.find, secret)
        found = (key.tenant, key.role) if key is not None else None
        self._entries[h] = (now, found)
        self._entries.move_to_end(h)
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)
        return found

    def forget(self) -> None:
        self._entries.clear()


def unauthorized() -> str:
    return (
        "Missing or invalid API token: send 'Authorization: Bearer <token>' with a token "
        "from PSTAR_API_TOKENS"
    )


async def require_key(request: Request) -> str:
    """The caller's tenant, whatever its key's role (the gate found it for a keyed path)."""
    tenant = getattr(request.state, "tenant", None)
    if tenant is None:  # a path the gate does not key (/readyz with a token)
        secret = bearer_secret(request.headers.get("authorization"))
        tenant = authenticate(request.app.state.ctx.settings, request.url.path, secret)
    if tenant is None:
        raise Unauthorized(unauthorized(), code="invalid_api_key")
    request.state.tenant = tenant
    return tenant


async def require_tenant(request: Request) -> str:
    """The caller's tenant, for a route of a tenant's (an admin key manages keys only)."""
    tenant = await require_key(request)
    role = getattr(request.state, "role", TENANT)
    if role == ADMIN:
        raise Forbidden(
            "an admin key manages keys (/v1/admin/keys) and nothing else; use a tenant's key",
            code="permission_denied",
        )
    if role == GRADER and not _grader_reaches(request.method, request.url.path):
        raise Forbidden(
            "a reinforcement job's grader key asks POST /v1/chat/completions and "
            "/v1/embeddings, and its job's rollouts, and nothing else; use a tenant's key",
            code="permission_denied",
        )
    return tenant


def _grader_reaches(method: str, path: str) -> bool:
    return (method, path) in GRADER_REACHES or (method == "POST" and bool(ROLLOUTS.fullmatch(path)))
