"""Bearer tokens: `Authorization: Bearer TOKEN`, each token belonging to one tenant.

Every token is compared in constant time, and all of them are compared every time, so
neither timing nor order tells a caller anything about the configured tokens. The check
runs once per request, in `api.gate.Gate` before the body is read; routes take the tenant
it found (`require_tenant`).
"""

from __future__ import annotations

import hmac

from fastapi import Request

from service.errors import Unauthorized
from service.settings import Settings

# the tenant of PSTAR_METRICS_TOKEN: it may read /metrics for every tenant, and nothing else
OPERATOR = "~operator"


def tenant_of(tokens: dict[str, str], presented: str) -> str | None:
    found = None
    given = presented.encode()
    for token, tenant in tokens.items():
        if hmac.compare_digest(token.encode(), given):
            found = tenant
    return found


def authenticate(settings: Settings, path: str, authorization: str | None) -> str | None:
    """The tenant whose key an `Authorization` header carries, or None."""
    scheme, _, presented = (authorization or "").partition(" ")
    presented = presented.strip()
    if scheme.lower() != "bearer" or not presented:
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


def unauthorized() -> str:
    return (
        "Missing or invalid API token: send 'Authorization: Bearer <token>' with a token "
        "from PSTAR_API_TOKENS"
    )


async def require_tenant(request: Request) -> str:
    tenant = getattr(request.state, "tenant", None)  # the gate's, for a keyed path
    if tenant is None:  # a path the gate does not key (/readyz with a token)
        tenant = authenticate(
            request.app.state.ctx.settings, request.url.path, request.headers.get("authorization")
        )
    if tenant is None:
        raise Unauthorized(unauthorized(), code="invalid_api_key")
    request.state.tenant = tenant
    return tenant
