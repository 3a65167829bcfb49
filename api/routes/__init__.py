"""One router per resource: files, models, fine-tuning jobs, and the system routes."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from api.auth import require_tenant

Tenant = Annotated[str, Depends(require_tenant)]


def ctx(request: Request):
    return request.app.state.ctx
