"""`/v1/models`: base models (HF directories), zoo models, this tenant's fine-tuned ones."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from api.errors import responses
from api.routes import V1_DEPENDENCIES, Tenant, ctx, respond
from api.schemas import ModelList, ModelObject
from service.errors import NotFound
from service.registry import list_models, resolve_model

router = APIRouter(
    prefix="/models", tags=["models"], responses=responses(401), dependencies=V1_DEPENDENCIES
)


@router.get("", response_model=ModelList)
def models_list(request: Request, tenant: Tenant) -> Response:
    c = ctx(request)
    return respond(
        ModelList(data=[ModelObject.of(m) for m in list_models(c.settings, c.store, tenant)])
    )


@router.get("/{model}", response_model=ModelObject, responses=responses(404))
def models_get(model: str, request: Request, tenant: Tenant) -> Response:
    c = ctx(request)
    found = resolve_model(c.settings, c.store, tenant, model)
    if found is None:
        raise NotFound("model", model, param="model")
    return respond(ModelObject.of(found))
