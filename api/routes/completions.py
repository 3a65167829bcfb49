"""`POST /v1/chat/completions` and `POST /v1/completions`: every model the tenant sees
(base models, its fine-tuned models, each checkpoint as `<model>:ckpt-step-N`) answers
as OpenAI's do, streamed or whole. Prompts and answers are never logged."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from api.completion_schemas import ChatCompletion, ChatRequest, CompletionRequest
from api.context import Context
from api.errors import responses
from api.generate import (
    Answer,
    chat_completion,
    collect,
    refusal,
    stream_chunks,
    text_completion,
)
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


async def _generate(
    request: Request, tenant: str, body: ChatRequest | CompletionRequest, chat: bool
) -> Response:
    c = ctx(request)
    if refused := body.refused():
        raise InvalidRequest(refused[1], param=refused[0], code="unsupported_parameter")
    if problem := body.scoring_problem():
        raise InvalidRequest(problem[1], param=problem[0], code="invalid_value")
    reading = None
    if isinstance(body, ChatRequest):
        if problem := body.tool_problem() or body.format_problem():
            raise InvalidRequest(problem[1], param=problem[0], code="invalid_value")
        reading = body.reading()
    # the tokens one request may generate, all its prompts' choices together
    limit = c.settings.limits.max_tokens_per_request
    asked = body.asked_tokens()
    prompts = body.payloads()
    n = (body.n or 1) * len(prompts)
    if asked is not None and asked * n > limit:
        field = (
            "max_completion_tokens"
            if getattr(body, "max_completion_tokens", None)
            else "max_tokens"
        )
        count = "n × prompts" if len(prompts) > 1 else "n"
        times = f"{count} × {field} = {n} × {asked} = {asked * n}" if n > 1 else f"{field}: {asked}"
        raise InvalidRequest(
            f"{times} is over this service's limit of {limit} tokens per request "
            f"({Limits.var('max_tokens_per_request')}); ask for fewer",
            param=field,
            code="invalid_value",
        )
    target = await run_in_threadpool(target_of, c.settings, c.store, tenant, body.model)
    common: dict[str, Any] = {
        "max_tokens": asked,
        "default_max_tokens": limit // n,  # each choice's share when none is asked
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "n": body.n or 1,
        "seed": body.seed,
        "stop": body.stops(),
    }
    if isinstance(body, CompletionRequest) and not body.stream:
        answers = await _all_prompts(c, tenant, target, [{**p, **common} for p in prompts])
        return respond(text_completion(body.model, answers, _echoed(body, answers)))
    if isinstance(body, CompletionRequest) and (len(prompts) > 1 or body.echo):
        merged = await _streamed_prompts(
            c, tenant, target, body, [{**p, **common} for p in prompts]
        )
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        chunks = stream_chunks(False, body.model, n, include_usage, merged)
        return StreamingResponse(
            c.generations.guard(tenant, chunks),
            media_type="text/event-stream",
            headers=STREAM_HEADERS,
        )
    first, events = await started(c, tenant, target, {**prompts[0], **common})
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        chunks = stream_chunks(chat, body.model, n, include_usage, events, reading)
        return StreamingResponse(
            c.generations.guard(tenant, chunks),
            media_type="text/event-stream",
            headers=STREAM_HEADERS,
        )
    assert chat  # a text completion's whole answer is _all_prompts'
    try:
        ans = await collect(first, events, body.n or 1)
    finally:
        c.generations.give_back(tenant)
    return respond(chat_completion(body.model, ans, reading))


async def _all_prompts(
    c: Context, tenant: str, target: Any, payloads: list[dict[str, Any]]
) -> list[Answer]:
    """Each prompt's whole answer, the prompts decoded together (one generation slot for
    the request); a prompt the model refuses refuses the request."""
    if len(payloads) == 1:
        first, events = await started(c, tenant, target, payloads[0])
        try:
            return [await collect(first, events, payloads[0]["n"])]
        finally:
            c.generations.give_back(tenant)
    opened, firsts = await open_all(c, tenant, target, payloads)
    try:
        return list(
            await asyncio.gather(
                *(collect(f, e, p["n"]) for f, e, p in zip(firsts, opened, payloads, strict=True))
            )
        )
    finally:
        for e in opened:
            await e.aclose()  # type: ignore[attr-defined]
        c.generations.give_back(tenant)


async def open_all(
    c: Context, tenant: str, target: Any, payloads: list[dict[str, Any]]
) -> tuple[list[AsyncIterator[dict]], list[dict]]:
    """Every prompt opened and started, one generation slot taken: (their events, their
    first events). A prompt the model refuses refuses them all (closed, the slot given
    back); the caller closes them and gives the slot back otherwise."""
    c.generations.take(tenant)
    opened: list[AsyncIterator[dict]] = []
    firsts: list[dict] = []
    try:
        for p in payloads:  # each prompt joins the batch as its first event is read
            opened.append(await c.backend.open(target, p, tenant))
            firsts.append(await anext(opened[-1]))
        for f in firsts:
            if "error" in f:
                raise refusal(f["error"])
    except BaseException:
        for e in opened:
            await e.aclose()  # type: ignore[attr-defined]
        c.generations.give_back(tenant)
        raise
    return opened, firsts


async def _streamed_prompts(
    c: Context, tenant: str, target: Any, body: CompletionRequest, payloads: list[dict]
) -> AsyncIterator[dict]:
    """A streamed batch (or an echoed prompt): every prompt opened and started before the
    response does (a prompt the model refuses is the request's 400), one generation slot
    taken (the stream's guard gives it back), then the prompts' events as one stream:
    prompt p's choice j is choice p*n + j, as OpenAI numbers a batch's choices; with
    echo each choice's first text is its prompt; the usage is the prompts' sum."""
    n = payloads[0]["n"]
    opened, firsts = await open_all(c, tenant, target, payloads)
    given = body.prompt if isinstance(body.prompt, list) else [body.prompt]
    if given and isinstance(given[0], int):
        given = [""]  # one prompt of token ids: its text is the model's decoding
    heads = [
        (g if isinstance(g, str) else "") or f.get("prompt_text", "")
        for g, f in zip(given, firsts, strict=True)
    ]
    return _merged(opened, n, heads if body.echo else None)


async def _merged(
    opened: list[AsyncIterator[dict]], n: int, heads: list[str] | None
) -> AsyncIterator[dict]:
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(p: int, events: AsyncIterator[dict]) -> None:
        try:
            async for ev in events:
                await queue.put((p, ev))
        finally:
            await queue.put((p, None))

    tasks = [asyncio.create_task(pump(p, e)) for p, e in enumerate(opened)]
    try:
        for p, head in enumerate(heads or ()):
            for j in range(n):
                if head:
                    yield {"i": p * n + j, "text": head}
        usage = {"prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0}
        left = len(opened)
        while left:
            p, ev = await queue.get()
            if ev is None:
                left -= 1
            elif "usage" in ev:
                for k in usage:
                    usage[k] += int(ev["usage"].get(k, 0))
            elif "error" in ev:
                yield ev
                return
            else:
                yield {**ev, "i": p * n + ev["i"]} if "i" in ev else ev
        yield {"usage": usage}
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # each generator let go first
        for e in opened:
            await e.aclose()  # type: ignore[attr-defined]


def _echoed(body: CompletionRequest, answers: list[Answer]) -> list[str] | None:
    """Each prompt's text for echo: a string as the request gave it, token ids decoded."""
    if not body.echo:
        return None
    given = body.prompt if isinstance(body.prompt, list) else [body.prompt]
    texts = [p if isinstance(p, str) else "" for p in given]
    if given and isinstance(given[0], int):
        texts = [""]
    return [t or a.prompt.get("prompt_text", "") for t, a in zip(texts, answers, strict=True)]


async def started(
    c: Context, tenant: str, target: Any, payload: dict[str, Any]
) -> tuple[dict, AsyncIterator[dict]]:
    """The first event of the model's answer and the rest, one of the tenant's generation
    slots taken (given back here if the answer does not start; by the caller after)."""
    c.generations.take(tenant)
    try:
        events = await c.backend.open(target, payload, tenant)
        first = await anext(events)
        if "error" in first:
            await events.aclose()
            raise refusal(first["error"])
    except BaseException:
        c.generations.give_back(tenant)
        raise
    return first, events
