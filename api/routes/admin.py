"""`/v1/admin/keys`: API keys, managed with an admin key (`pstar keys create --admin` makes
the first). A key's secret is in the answer that creates it, and nowhere after: the store
keeps its SHA-256 (`service.store.keys`)."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from pydantic import BaseModel, Field

from api.auth import ADMIN
from api.errors import responses
from api.routes import V1_DEPENDENCIES, Ctx, respond
from service.errors import Forbidden, NotFound
from service.settings import TENANT_RE
from service.spec.resources import Body
from service.store import ApiKey


def admin(request: Request) -> None:
    """Only an admin key reaches these routes (the gate found the key and its role)."""
    if getattr(request.state, "role", None) != ADMIN:
        raise Forbidden(
            "this route needs an admin key (pstar keys create --admin)", code="permission_denied"
        )


router = APIRouter(
    prefix="/admin/keys",
    tags=["admin"],
    responses=responses(401, 403),
    dependencies=[*V1_DEPENDENCIES, Depends(admin)],
)


class KeyCreate(Body):
    tenant: Annotated[str, Field(pattern=TENANT_RE.pattern)] = Field(
        description="the tenant the key acts as (letters, digits, . _ -; at most 64)"
    )
    name: Annotated[str, Field(max_length=128)] = Field(default="", description="a label")


class KeyObject(BaseModel):
    object: Literal["api_key"] = "api_key"
    id: str
    tenant: str
    role: str
    name: str
    hint: str = Field(description="the secret's last 4 characters")
    created_at: int
    revoked_at: int | None = None
    key: str | None = Field(
        default=None, description="the secret: in the answer that creates the key, only"
    )

    @classmethod
    def of(cls, k: ApiKey, secret: str | None = None) -> KeyObject:
        return cls(
            id=k.id,
            tenant=k.tenant,
            role=k.role,
            name=k.name,
            hint=k.hint,
            created_at=k.created_at,
            revoked_at=k.revoked_at,
            key=secret,
        )


class KeyList(BaseModel):
    object: Literal["list"] = "list"
    data: list[KeyObject]


@router.post("", response_model=KeyObject)
def keys_create(body: KeyCreate, c: Ctx) -> Response:
    """A new key for a tenant; its secret (`key`) is shown in this answer only."""
    key, secret = c.store.keys.create(body.tenant, "tenant", body.name)
    return respond(KeyObject.of(key, secret))


@router.get("", response_model=KeyList)
def keys_list(c: Ctx, tenant: str | None = None) -> Response:
    """Every key (or one tenant's), revoked ones included, without their secrets."""
    return respond(KeyList(data=[KeyObject.of(k) for k in c.store.keys.list(tenant)]))


@router.delete("/{key_id}", response_model=KeyObject, responses=responses(404))
def keys_revoke(key_id: str, c: Ctx) -> Response:
    """Revoke a key: from now on it is a 401."""
    key = c.store.keys.revoke(key_id)
    if key is None:
        raise NotFound("key", key_id, param="key_id")
    c.keys.forget()  # at once, not when its cache entry ends
    return respond(KeyObject.of(key))
