"""`/v1/files`: upload (streamed, validated per line), list, retrieve, content, delete."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Header, Query, Request
from fastapi.responses import FileResponse, Response

from api.errors import responses
from api.routes import V1_DEPENDENCIES, Tenant, ctx, respond
from api.schemas import FileDeleted, FileList, FileObject, page_ends
from service.errors import Conflict, NotFound
from service.files import delete_file, file_path, receive_upload

router = APIRouter(
    prefix="/files", tags=["files"], responses=responses(401), dependencies=V1_DEPENDENCIES
)

UPLOAD_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["file", "purpose"],
                    "properties": {
                        "file": {"type": "string", "format": "binary"},
                        "purpose": {"type": "string", "enum": ["fine-tune"]},
                    },
                }
            }
        },
    }
}


@router.post(
    "",
    response_model=FileObject,
    responses=responses(400, 413),
    openapi_extra=UPLOAD_BODY,
)
async def files_create(
    request: Request,
    tenant: Tenant,
    content_type: Annotated[str | None, Header(include_in_schema=False)] = None,
    content_length: Annotated[str | None, Header(include_in_schema=False)] = None,
) -> FileObject:
    """Upload a JSONL (chat, prompt/completion, text) or plain text file; a file with bad
    lines is refused (400 listing them by number) and not stored."""
    c = ctx(request)
    f = await receive_upload(
        c.settings, c.store, tenant, content_type, content_length, request.stream()
    )
    return FileObject.of(f)


@router.get("", response_model=FileList, responses=responses(400, 404))
def files_list(
    request: Request,
    tenant: Tenant,
    purpose: str | None = None,
    after: Annotated[str | None, Query(max_length=64)] = None,
    limit: Annotated[int, Query(ge=1, le=10000)] = 10000,
    order: Literal["asc", "desc"] = "desc",
) -> Response:
    rows, more = ctx(request).store.files.page(tenant, after, limit, purpose, order)
    data = [FileObject.of(f) for f in rows]
    return respond(FileList(data=data, has_more=more, **page_ends(data)))


def _get(request: Request, tenant: str, file_id: str):
    f = ctx(request).store.files.get(tenant, file_id)
    if f is None:
        raise NotFound("file", file_id, param="file_id")
    return f


@router.get("/{file_id}", response_model=FileObject, responses=responses(404))
def files_get(file_id: str, request: Request, tenant: Tenant) -> Response:
    return respond(FileObject.of(_get(request, tenant, file_id)))


@router.get(
    "/{file_id}/content",
    response_class=FileResponse,
    responses={200: {"content": {"application/octet-stream": {}}}, **responses(404)},
)
def files_content(file_id: str, request: Request, tenant: Tenant) -> FileResponse:
    f = _get(request, tenant, file_id)
    return FileResponse(file_path(ctx(request).settings, f), media_type="application/octet-stream")


@router.delete("/{file_id}", response_model=FileDeleted, responses=responses(404, 409))
def files_delete(file_id: str, request: Request, tenant: Tenant) -> Response:
    c = ctx(request)
    _get(request, tenant, file_id)
    job = c.store.files.in_use(tenant, file_id)
    if job is not None:
        raise Conflict(
            f"file {file_id} is used by job {job}, which has not finished; cancel the job "
            "or wait for it to end",
            param="file_id",
            code="file_in_use",
        )
    if delete_file(c.settings, c.store, tenant, file_id) is None:
        raise NotFound("file", file_id, param="file_id")
    return respond(FileDeleted(id=file_id, deleted=True))
