"""`/v1/files`: upload (streamed, validated per line), list, retrieve, content, delete."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Header, Query, Request
from fastapi.responses import FileResponse, Response

from api.errors import responses
from api.routes import V1_DEPENDENCIES, Ctx, OwnFile, Tenant, respond
from api.schemas import FileDeleted, FileList, FileObject, page_ends
from service.control.files import delete_file, file_path, page_files, receive_upload

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
    c: Ctx,
    tenant: Tenant,
    content_type: Annotated[str | None, Header(include_in_schema=False)] = None,
    content_length: Annotated[str | None, Header(include_in_schema=False)] = None,
) -> FileObject:
    """Upload a JSONL (chat, prompt/completion, text) or plain text file; a file with bad
    lines is refused (400 listing them by number) and not stored."""
    f = await receive_upload(
        c.settings, c.store, tenant, content_type, content_length, request.stream()
    )
    return FileObject.of(f)


@router.get("", response_model=FileList, responses=responses(400, 404))
def files_list(
    c: Ctx,
    tenant: Tenant,
    purpose: str | None = None,
    after: Annotated[str | None, Query(max_length=64)] = None,
    limit: Annotated[int, Query(ge=1, le=10000)] = 10000,
    order: Literal["asc", "desc"] = "desc",
) -> Response:
    rows, more = page_files(c.store, tenant, after, limit, purpose, order)
    data = [FileObject.of(f) for f in rows]
    return respond(FileList(data=data, has_more=more, **page_ends(data)))


@router.get("/{file_id}", response_model=FileObject, responses=responses(404))
def files_get(f: OwnFile) -> Response:
    return respond(FileObject.of(f))


@router.get(
    "/{file_id}/content",
    response_class=FileResponse,
    responses={200: {"content": {"application/octet-stream": {}}}, **responses(404)},
)
def files_content(f: OwnFile, c: Ctx) -> FileResponse:
    return FileResponse(file_path(c.settings, f), media_type="application/octet-stream")


@router.delete("/{file_id}", response_model=FileDeleted, responses=responses(404, 409))
def files_delete(f: OwnFile, c: Ctx, tenant: Tenant) -> Response:
    delete_file(c.settings, c.store, tenant, f.id)
    return respond(FileDeleted(id=f.id, deleted=True))
