"""`/v1/models`: base models (HF directories), zoo models, this tenant's fine-tuned ones."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response

from api.completion_schemas import ModelDeleted
from api.errors import responses
from api.routes import V1_DEPENDENCIES, Ctx, Tenant, respond
from api.schemas import ModelList, ModelObject
from service.errors import NotFound
from service.registry import list_models, resolve_model
from service.serving.deployments import delete_model, serving_of

router = APIRouter(
    prefix="/models", tags=["models"], responses=responses(401), dependencies=V1_DEPENDENCIES
)


@router.get("", response_model=ModelList)
def models_list(c: Ctx, tenant: Tenant) -> Response:
    refs = list_models(c.settings, c.store, tenant)
    where = serving_of(c.settings, c.store, c.serving, tenant, refs)
    return respond(ModelList(data=[ModelObject.of(m, where.get(m.id)) for m in refs]))


@router.get("/{model}", response_model=ModelObject, responses=responses(404))
def models_get(model: str, c: Ctx, tenant: Tenant) -> Response:
    found = resolve_model(c.settings, c.store, tenant, model)
    if found is None:
        raise NotFound("model", model, param="model")
    where = serving_of(c.settings, c.store, c.serving, tenant, [found])
    return respond(ModelObject.of(found, where.get(found.id)))


@router.delete("/{model}", response_model=ModelDeleted, responses=responses(400, 403, 404))
def models_delete(model: str, c: Ctx, tenant: Tenant) -> Response:
    """Delete one of the tenant's fine-tuned models (its files, its deployment, its adapter
    in any replica's memory). The job that made it keeps its record; a job still
    fine-tuning from it runs on (its files go when it ends). Base models are refused."""
    delete_model(c.settings, c.store, c.serving, tenant, model)
    return respond(ModelDeleted(id=model, deleted=True))
