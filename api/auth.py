"""Bearer tokens: `Authorization: Bearer TOKEN`, each token belonging to one tenant.

Every token is compared in constant time, and all of them are compared every time, so
neither timing nor order tells a caller anything about the configured tokens.
"""

from __future__ import annotations

import hmac

from fastapi import Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from service.errors import Unauthorized

bearer = HTTPBearer(auto_error=False, description="a token from PSTAR_API_TOKENS")
# the tenant of PSTAR_METRICS_TOKEN: it may read /metrics for every tenant, and nothing else
OPERATOR = "~operator"


def tenant_of(tokens: dict[str, str], presented: str) -> str | None:
    found = None
    given = presented.encode()
    for token, tenant in tokens.items():
        if hmac.compare_digest(token.encode(), given):
            found = tenant
    return found


async def require_tenant(request: Request) -> str:
    creds: HTTPAuthorizationCredentials | None = await bearer(request)
    settings = request.app.state.ctx.settings
    tenant = tenant_of(settings.tokens, creds.credentials) if creds else None
    if (
        tenant is None
        and creds
        and settings.metrics_token
        and request.url.path == "/metrics"
        and hmac.compare_digest(settings.metrics_token.encode(), creds.credentials.encode())
    ):
        tenant = OPERATOR
    if tenant is None:
        raise Unauthorized(
            "Missing or invalid API token: send 'Authorization: Bearer <token>' with a token "
            "from PSTAR_API_TOKENS",
            code="invalid_api_key",
        )
    request.state.tenant = tenant
    return tenant
