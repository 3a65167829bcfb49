"""`POST /v1/chat/completions` and `POST /v1/completions`: every model the tenant sees
(base models, its fine-tuned models, each checkpoint as `<model>:ckpt-step-N`) answers
as OpenAI's do, streamed or whole. Prompts and answers are never logged."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from api.completion_schemas import ChatCompletion, ChatRequest, CompletionRequest, Sampling
from api.context import Context
from api.errors import responses
from api.generate import chat_completion, collect, refusal, stream_chunks, text_completion
from api.routes import STREAM_HEADERS, V1_DEPENDENCIES, Tenant, ctx, respond
from service.errors import InvalidRequest
from service.serving.deployments import target_of
from service.settings import Limits

router = APIRouter(tags=["completions"], responses=responses(401), dependencies=V1_DEPENDENCIES)

# both routes answer JSON, or with `stream` the chunks as server-sent events
RESPONSES = {
    200: {"content": {"text/event-stream": {}}, "description": "with `stream`: the chunks"},
    **responses(400, 404, 429, 503),
}


@router.post("/chat/completions", response_model=ChatCompletion, responses=RESPONSES)
async def chat_completions(body: ChatRequest, request: Request, tenant: Tenant) -> Response:
    """The model's answer to a conversation, rendered by the model's own chat template."""
    return await _generate(request, tenant, body, chat=True)


@router.post("/completions", response_model=None, responses=RESPONSES)
async def completions(body: CompletionRequest, request: Request, tenant: Tenant) -> Response:
    """The model's continuation of a prompt (one string, or its token ids)."""
    return await _generate(request, tenant, body, chat=False)


async def _generate(request: Request, tenant: str, body: Sampling, chat: bool) -> Response:
    c = ctx(request)
    if refused := body.refused():
        raise InvalidRequest(refused[1], param=refused[0], code="unsupported_parameter")
    reading = None
    if isinstance(body, ChatRequest):
        if problem := body.tool_problem():
            raise InvalidRequest(problem[1], param=problem[0], code="invalid_value")
        reading = body.reading()
    # the tokens one request may generate, all its choices together
    limit = c.settings.limits.max_tokens_per_request
    asked = body.asked_tokens()  # type: ignore[attr-defined]
    n = body.n or 1
    if asked is not None and asked * n > limit:
        field = (
            "max_completion_tokens"
            if getattr(body, "max_completion_tokens", None)
            else "max_tokens"
        )
        times = f"n × {field} = {n} × {asked} = {asked * n}" if n > 1 else f"{field}: {asked}"
        raise InvalidRequest(
            f"{times} is over this service's limit of {limit} tokens per request "
            f"({Limits.var('max_tokens_per_request')}); ask for fewer",
            param=field,
            code="invalid_value",
        )
    target = await run_in_threadpool(target_of, c.settings, c.store, tenant, body.model)
    payload: dict[str, Any] = {
        **body.payload(),  # type: ignore[attr-defined]
        "max_tokens": asked,
        "default_max_tokens": limit // n,  # each choice's share when none is asked
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "n": n,
        "seed": body.seed,
        "stop": body.stops(),
    }
    first, events = await started(c, tenant, target, payload)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        chunks = stream_chunks(chat, body.model, n, include_usage, events, reading)
        return StreamingResponse(
            c.generations.guard(tenant, chunks),
            media_type="text/event-stream",
            headers=STREAM_HEADERS,
        )
    try:
        ans = await collect(first, events, n)
    finally:
        c.generations.give_back(tenant)
    if chat:
        return respond(chat_completion(body.model, ans, reading))
    return respond(text_completion(body.model, ans))


async def started(
    c: Context, tenant: str, target: Any, payload: dict[str, Any]
) -> tuple[dict, AsyncIterator[dict]]:
    """The first event of the model's answer and the rest, one of the tenant's generation
    slots taken (given back here if the answer does not start; by the caller after)."""
    c.generations.take(tenant)
    try:
        events = await c.backend.open(target, payload)
        first = await anext(events)
        if "error" in first:
            await events.aclose()
            raise refusal(first["error"])
    except BaseException:
        c.generations.give_back(tenant)
        raise
    return first, events
